"""What one scheduling run knows about each node while it places replicas."""

from __future__ import annotations

import copy

from llmgw.models import Model, Profile
from llmgw.scheduler._disk import DiskRoom
from llmgw.scheduler._records import NodeView, Shard
from llmgw.weights import is_distributable


class NodeState:
    """A node's free GPUs and ports, and what runs on it, during one :func:`schedule` run.

    Mutable and private to one run; the run only ever adds to it, except when it
    scales a model down.
    """

    __slots__ = (
        "view",
        "id",
        "ready",
        "engines",
        "sources",
        "fabrics",
        "shared_fabric",
        "gpu_memory",
        "gpu_order",
        "gpu_owner",
        "free_gpu_count",
        "port_owner",
        "low",
        "high",
        "cursor",
        "ports_in_range",
        "shards",
        "model_shards",
        "disk",
    )

    def __init__(self, view: NodeView, copying: frozenset[str] = frozenset()) -> None:
        """:param copying: sources being copied to some node now (see :class:`DiskRoom`)."""
        facts = view.facts
        self.view = view
        self.id = facts.node_id
        self.ready = view.state == "ready"
        self.engines = frozenset(facts.engines)
        self.sources = frozenset(facts.model_sources)
        self.fabrics = tuple(sorted({fabric.name for fabric in facts.fabrics}))
        #: on a fabric with another ready node: a multi-node replica could use it (the run sets it)
        self.shared_fabric = bool(self.fabrics)
        self.gpu_memory = {gpu.index: gpu.memory_total_mib for gpu in facts.gpus}
        self.gpu_order = tuple(sorted(self.gpu_memory))
        self.gpu_owner: dict[int, str] = {}
        self.free_gpu_count = len(self.gpu_memory)
        self.port_owner: dict[int, str] = {}
        self.low, self.high = view.port_range
        self.cursor = self.low
        self.ports_in_range = 0
        self.shards = 0
        self.model_shards: dict[str, int] = {}
        #: what the models directory can still take
        self.disk = DiskRoom(view.facts, copying)

    def copy(self) -> NodeState:
        """A copy whose claims and disk room change apart from this one's (a trial placement); cheap."""
        other = copy.copy(self)
        other.gpu_owner = dict(self.gpu_owner)
        other.port_owner = dict(self.port_owner)
        other.model_shards = dict(self.model_shards)
        other.disk = self.disk.copy()
        return other

    @property
    def state(self) -> str:
        """The node's state: ``ready``, ``cordoned`` or ``lost``."""
        return self.view.state

    def key(self, model: str, holds: bool = True, pack: bool = False) -> tuple[int, int, int, int, str]:
        """Sort key for placing ``model``: fewest of its shards, then (``pack``) not a whole fabric node,
        fewest GPUs used, fewest shards, id.

        Replicas spread first; among nodes with as many of its shards, one
        holding the model's weights (``holds``; elsewhere they are copied
        first, the replica staging meanwhile) comes first. A single-node
        replica (``pack``) then prefers islands and nodes already partly used
        to a fabric node no replica uses, which a multi-node replica may need.
        """
        return (
            2 * self.model_shards.get(model, 0) + (0 if holds else 1),
            int(pack and self.whole_fabric_node),
            len(self.gpu_owner),
            self.shards,
            self.id,
        )

    @property
    def whole_fabric_node(self) -> bool:
        """Whether the node is on a fabric with another ready node, and no replica uses any of its GPUs."""
        return self.shared_fabric and not self.gpu_owner

    def gpus_with(self, min_memory: int | None) -> list[int]:
        """Indices of the GPUs with at least ``min_memory`` MiB (all of them when None)."""
        if min_memory is None:
            return list(self.gpu_order)
        return [index for index in self.gpu_order if self.gpu_memory[index] >= min_memory]

    def fits(self, gpus: int, min_memory: int | None, ports: int) -> bool:
        """True when ``gpus`` unused GPUs of ``min_memory`` MiB and ``ports`` unused ports are left."""
        if self.high - self.low + 1 - self.ports_in_range < ports:
            return False
        if min_memory is None:
            return self.free_gpu_count >= gpus
        return len(self.free_gpus(min_memory)) >= gpus

    def lacks(self, model: Model, profile: Profile) -> str | None:
        """What a replica of ``model`` needs on this node's own disk and does not find there: ``model source
        PATH``, or ``LoRA adapter NAME (PATH)`` for an adapter its profile's engine loads at start
        (``adapters_at_start``) from a path; None when nothing is missing. A distributable source is
        copied, never missing."""
        if model.source not in self.sources and not is_distributable(model.source):
            return f"model source {model.source}"
        if profile.adapters_at_start:
            for name, source in model.adapters.items():
                if source not in self.sources and not is_distributable(source):
                    return f"LoRA adapter {name} ({source})"
        return None

    def free_gpus(self, min_memory: int | None) -> list[int]:
        """Indices of the unused GPUs with at least ``min_memory`` MiB, lowest first."""
        return [index for index in self.gpus_with(min_memory) if index not in self.gpu_owner]

    @property
    def free_ports(self) -> int:
        """How many ports of the node's range no shard uses."""
        return self.high - self.low + 1 - self.ports_in_range

    def next_ports(self, count: int) -> list[int]:
        """The ``count`` lowest unused ports of the range (fewer when it runs out)."""
        found: list[int] = []
        port = self.cursor
        while len(found) < count and port <= self.high:
            if port not in self.port_owner:
                found.append(port)
            port += 1
        return found

    def conflict(self, shard: Shard) -> str | None:
        """Which GPU or port of ``shard`` another replica already holds, or None."""
        for gpu in shard.gpus:
            if gpu in self.gpu_owner:
                return f"GPU {gpu} on {self.id} is already used by {self.gpu_owner[gpu]}"
        for port in _ports(shard):
            if port in self.port_owner:
                return f"port {port} on {self.id} is already used by {self.port_owner[port]}"
        return None

    def claim(self, shard: Shard, replica_id: str, model: str) -> None:
        """Mark the GPUs and ports of ``shard`` as used by ``replica_id``."""
        for gpu in shard.gpus:
            self.gpu_owner[gpu] = replica_id
            self.free_gpu_count -= gpu in self.gpu_memory
        for port in _ports(shard):
            self.port_owner[port] = replica_id
            if self.low <= port <= self.high:
                self.ports_in_range += 1
        while self.cursor in self.port_owner:
            self.cursor += 1
        self.shards += 1
        self.model_shards[model] = self.model_shards.get(model, 0) + 1

    def release(self, shard: Shard, model: str) -> None:
        """Undo :meth:`claim` for ``shard``."""
        for gpu in shard.gpus:
            del self.gpu_owner[gpu]
            self.free_gpu_count += gpu in self.gpu_memory
        for port in _ports(shard):
            self.port_owner.pop(port, None)
            if self.low <= port <= self.high:
                self.ports_in_range -= 1
                self.cursor = min(self.cursor, port)
        self.shards -= 1
        self.model_shards[model] -= 1


def _ports(shard: Shard) -> tuple[int, ...]:
    if shard.dist_init_port is None:
        return (shard.port,)
    return (shard.port, shard.dist_init_port)
