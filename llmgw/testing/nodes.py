"""Simulated nodes' syncs: what an agent on fake GPUs with the sim engine reports to the server.

For tests and benchmarks that talk to a real server (or its state) as many nodes, without running agents::

    request = sim_node_sync("node-1", gpus=8, address="127.0.0.5", revision=known, wait=True)
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.models import NodeFacts
from llmgw.testing.fakes import make_gpus
from llmgw.wire import SyncRequest

__all__ = ["sim_node_facts", "sim_node_sync"]


def sim_node_facts(
    node_id: str,
    gpus: int = 4,
    *,
    sources: tuple[str, ...] = ("tiny/model",),
    engines: Mapping[str, str] | None = None,
) -> NodeFacts:
    """The facts of a node with ``gpus`` fake GPUs (the same ones for one ``node_id``) and the sim engine.

    :param sources: the model sources found on the node.
    :param engines: engine -> the version installed, when not the sim alone.
    :returns: the facts its agent would report.
    """
    return NodeFacts(
        node_id=node_id,
        agent_version="0.1.0",
        gpus=make_gpus(gpus, seed=node_id),
        engines=dict(engines) if engines is not None else {"sim": "0.1.0"},
        model_sources=list(sources),
    )


def sim_node_sync(
    node_id: str,
    *,
    gpus: int = 4,
    address: str = "127.0.0.5",
    port_range: tuple[int, int] = (21000, 21099),
    sources: tuple[str, ...] = ("tiny/model",),
    engines: Mapping[str, str] | None = None,
    **fields: object,
) -> SyncRequest:
    """One sync of a node with :func:`sim_node_facts`, called where a test plays that node's agent.

    :param sources: the model sources found on the node (as :func:`sim_node_facts`).
    :param engines: the engines installed (as :func:`sim_node_facts`).
    :param fields: the other :class:`SyncRequest` fields (``revision``, ``wait``, ``observed``...).
    :returns: the request; the sources it checked are those its facts name, unless ``checked_sources``
        says others.
    """
    facts = sim_node_facts(node_id, gpus, sources=sources, engines=engines)
    fields.setdefault("checked_sources", facts.model_sources)
    return SyncRequest(node_id=node_id, address=address, facts=facts, port_range=port_range, **fields)
