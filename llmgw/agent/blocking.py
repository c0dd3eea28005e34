"""Which shards a starting shard waits for: every other shard of the node that holds a port or GPU of its.

A shard being stopped, a worker held until its replica's rank 0 is gone, or a
replica that left the routes and runs on until the gateways let go of it (the
server has given its port and GPUs to the new shard already) may still hold a
port this one binds, or a GPU it uses: the new shard starts once that one is gone.
The server never places two shards it keeps on one port or GPU, so the shards
waited for are all on their way out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import trio

from llmgw.wire import DesiredShard

if TYPE_CHECKING:
    from llmgw.agent.supervisor import ShardSupervisor

__all__ = ["blockers_of"]


def blockers_of(shard: DesiredShard, running: Iterable[ShardSupervisor]) -> list[trio.Event]:
    """The ``done`` events of the shards in ``running`` that ``shard`` must wait for before it starts.

    Called by the agent as it applies a reply, for each shard it starts.
    """
    return [
        other.done for other in running if other.key != shard.key and _shares_resources(other.desired, shard)
    ]


def _shares_resources(a: DesiredShard, b: DesiredShard) -> bool:
    """Whether two shards of this node bind a port in common, or use a GPU in common."""
    return bool(_ports(a) & _ports(b) or set(a.spec.gpus) & set(b.spec.gpus))


def _ports(shard: DesiredShard) -> set[int]:
    """The ports a shard binds on this node: its own, and the dist-init port if it is rank 0."""
    ports = {shard.spec.port}
    if shard.rank == 0 and shard.spec.dist_init_addr:
        ports.add(int(shard.spec.dist_init_addr.rpartition(":")[2]))
    return ports
