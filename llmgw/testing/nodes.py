"""Simulated nodes' syncs: what an agent on fake GPUs with the sim engine reports to the server.

For tests and benchmarks that talk to a real server (or its state) as many nodes, without running agents::

    request = sim_node_sync("node-1", gpus=8, address="127.0.0.5", revision=known, wait=True)
"""

from __future__ import annotations

from llmgw.models import NodeFacts
from llmgw.testing.fakes import make_gpus
from llmgw.wire import SyncRequest

__all__ = ["sim_node_facts", "sim_node_sync"]


def sim_node_facts(node_id: str, gpus: int = 4, *, sources: tuple[str, ...] = ("tiny/model",)) -> NodeFacts:
    """The facts of a node with ``gpus`` fake GPUs (the same ones for one ``node_id``) and the sim engine.

    :param sources: the model sources found on the node.
    :returns: the facts its agent would report.
    """
    return NodeFacts(
        node_id=node_id,
        agent_version="0.1.0",
        gpus=make_gpus(gpus, seed=node_id),
        engines={"sim": "0.1.0"},
        model_sources=list(sources),
    )


def sim_node_sync(
    node_id: str,
    *,
    gpus: int = 4,
    address: str = "127.0.0.5",
    port_range: tuple[int, int] = (21000, 21099),
    sources: tuple[str, ...] = ("tiny/model",),
    **fields: object,
) -> SyncRequest:
    """One sync of a node with :func:`sim_node_facts`, called where a test plays that node's agent.

    :param sources: the model sources found on the node (as :func:`sim_node_facts`).
    :param fields: the other :class:`SyncRequest` fields (``revision``, ``wait``, ``observed``...).
    :returns: the request; the sources it checked are those its facts name.
    """
    facts = sim_node_facts(node_id, gpus, sources=sources)
    return SyncRequest(
        node_id=node_id,
        address=address,
        facts=facts,
        port_range=port_range,
        checked_sources=facts.model_sources,
        **fields,
    )
