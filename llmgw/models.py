"""The domain records llmgw passes between its parts.

Every record is frozen; change one with :func:`attrs.evolve`. Validators guard
invariants only; parsing from YAML, JSON or the wire lives in
:mod:`llmgw.catalog`, never here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

__all__ = [
    "GPU",
    "AdapterPort",
    "Adapter",
    "Fabric",
    "DiscoverySettings",
    "GpuReport",
    "AdapterReport",
    "ModelCopy",
    "NodeFacts",
    "Sidecar",
    "Profile",
    "Rollout",
    "ScaleTarget",
    "Autoscale",
    "Model",
    "Catalog",
    "LoraSpec",
    "LaunchSpec",
    "Command",
]


def _non_negative(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    """A validator: a whole number of at least 1 (replicas' nodes, a machine's cores...)."""
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


#: llmgw's limits on what a catalog may ask for, so that no catalog costs more than the fleet can hold
MAX_REPLICAS = 10_000
MAX_NODES_PER_REPLICA = 64
MAX_GPUS_PER_NODE = 64
#: the most adapters one replica may keep loaded, and the largest LoRA rank (vLLM's largest choice)
MAX_ADAPTERS_LOADED = 256
MAX_ADAPTER_RANK = 512
#: ... and on the size of what catalogs and agents send: one string (a source, an argument, a line)
MAX_TEXT = 4096
#: one list (a profile's args, a node's model sources, a node's GPUs...)
MAX_ITEMS = 1024


def _at_most(limit: int) -> Callable[[object, attrs.Attribute, int], None]:
    def check(instance: object, attribute: attrs.Attribute, value: int) -> None:
        if value > limit:
            raise ValueError(f"{attribute.name} must be at most {limit} (llmgw's limit), got {value}")

    return check


def bounded(items: int = MAX_ITEMS, text: int = MAX_TEXT) -> Callable[[object, attrs.Attribute, Any], None]:
    """A validator: a string of at most ``text`` characters, or a collection of at most ``items``
    entries whose strings (keys and values of a mapping) are at most ``text`` characters each."""

    def check(instance: object, attribute: attrs.Attribute, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, str):
            if len(value) > text:
                limit = f"at most {text} characters (llmgw's limit)"
                raise ValueError(f"{attribute.name}: {limit}, got {len(value)}")
            return
        if len(value) > items:
            raise ValueError(f"{attribute.name}: at most {items} entries (llmgw's limit), got {len(value)}")
        strings = [*value, *value.values()] if isinstance(value, Mapping) else value
        longest = max((len(s) for s in strings if isinstance(s, str)), default=0)
        if longest > text:
            raise ValueError(
                f"{attribute.name}: each entry at most {text} characters (llmgw's limit), got {longest}"
            )

    return check


#: the longest ready timeout and stop grace a profile may ask for, in seconds
MAX_READY_TIMEOUT = 86_400.0
MAX_STOP_GRACE = 3_600.0
#: what a profile that sets none gets
DEFAULT_READY_TIMEOUT = 600.0
DEFAULT_STOP_GRACE = 30.0


def _seconds(
    low: float, high: float, *, above: bool
) -> Callable[[object, attrs.Attribute, float | None], None]:
    """A validator: None, or seconds in ``(low, high]`` (``above``) or ``[low, high]``."""
    bound = f"above {low:g}" if above else f"from {low:g}"

    def check(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
        if value is None:
            return
        if not (low < value if above else low <= value) or value > high:
            raise ValueError(
                f"{attribute.name} must be: expected a number of seconds {bound} to {high:g}, got {value:g}"
            )

    return check


def _frozen_mapping(value: Mapping[str, str] | None) -> Mapping[str, str]:
    return dict(value or {})


@attrs.frozen
class GPU:
    """One GPU as ``nvidia-smi`` reports it."""

    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_free_mib: int
    pci_bus_id: str
    driver_version: str


@attrs.frozen
class AdapterPort:
    """One port of a fabric adapter, as sysfs describes it."""

    number: int
    #: The state word of ``ports/N/state``: ``ACTIVE``, ``DOWN``, ``INIT``, ``ARMED``...
    state: str
    #: The text of ``ports/N/rate``, e.g. ``400 Gb/sec (4X NDR)``.
    rate: str
    #: ``InfiniBand`` or ``Ethernet`` (RoCE).
    link_layer: str

    @property
    def active(self) -> bool:
        """True when the port can carry traffic."""
        return self.state == "ACTIVE"


@attrs.frozen
class Adapter:
    """One RDMA adapter (``mlx5_0``...) under the sysfs InfiniBand root."""

    name: str
    node_guid: str
    ports: tuple[AdapterPort, ...] = attrs.field(converter=tuple, default=())

    @property
    def active(self) -> bool:
        """True when at least one port is ``ACTIVE``."""
        return any(port.active for port in self.ports)


@attrs.frozen
class Fabric:
    """A fabric this node declared it is on, and the adapters it uses there."""

    name: str
    adapters: tuple[str, ...] = attrs.field(converter=tuple)


@attrs.frozen
class DiscoverySettings:
    """Where discovery looks: set by the agent's ``--nvidia-smi`` and ``--ib-root``."""

    nvidia_smi: str = "nvidia-smi"
    ib_root: str = "/sys/class/infiniband"
    #: seconds a discovery tool may run before it counts as failed
    timeout: float = 30.0


@attrs.frozen
class _DiscoveryReport:
    """What one discovery plugin found; ``status`` tells the three outcomes apart. Each subclass adds what
    was found, then ``problem`` (the message of a failure, or notes)."""

    source: str
    status: str = attrs.field(validator=attrs.validators.in_({"ok", "not-found", "failed"}))

    def describe(self) -> str:
        """One line for an operator: what was found, or what went wrong."""
        if self.status == "ok":
            return f"{self.source}: {self._found()}"
        return f"{self.source}: {self.problem}"

    def _found(self) -> str:
        """What was found, counted (``8 GPUs``)."""
        raise NotImplementedError


@attrs.frozen
class GpuReport(_DiscoveryReport):
    """What one GPU discovery plugin found.

    ``status`` tells the three outcomes apart: ``ok`` (``gpus`` may be empty:
    the tool ran and listed none), ``not-found`` (the tool is not there) and
    ``failed`` (it ran and failed; ``problem`` holds its message).
    """

    gpus: tuple[GPU, ...] = attrs.field(converter=tuple, default=())
    problem: str | None = None

    def _found(self) -> str:
        return f"{len(self.gpus)} GPUs"


@attrs.frozen
class AdapterReport(_DiscoveryReport):
    """What one fabric discovery plugin found under its root (``status`` as :class:`GpuReport`'s)."""

    adapters: tuple[Adapter, ...] = attrs.field(converter=tuple, default=())
    problem: str | None = None

    def _found(self) -> str:
        return f"{len(self.adapters)} adapters"


@attrs.frozen
class ModelCopy:
    """One copy of a distributable model on a node: in its models directory, or the seed itself."""

    #: the manifest digest of the copy (:attr:`llmgw.weights.Manifest.digest`)
    digest: str = attrs.field(validator=bounded(text=64))
    #: the catalog source it is a copy of (``seed:///data/llama``)
    source: str = attrs.field(validator=bounded())
    bytes_present: int = attrs.field(validator=_non_negative)
    bytes_total: int = attrs.field(validator=_non_negative)
    #: every file present and verified against the manifest
    complete: bool = False
    #: when a shard last started on it (epoch seconds; 0: never)
    last_used: float = 0.0
    #: the seed directory itself (never evicted, never moved), not a copy llmgw made
    seed: bool = False


@attrs.frozen
class NodeFacts:
    """Everything an agent reports about its node."""

    node_id: str = attrs.field(validator=bounded())
    agent_version: str = attrs.field(validator=bounded())
    gpus: tuple[GPU, ...] = attrs.field(converter=tuple, default=(), validator=bounded())
    fabrics: tuple[Fabric, ...] = attrs.field(converter=tuple, default=(), validator=bounded())
    #: engine name -> version string the installed engine reported
    engines: Mapping[str, str] = attrs.field(converter=_frozen_mapping, factory=dict, validator=bounded())
    #: model sources that exist on this node's disk
    model_sources: tuple[str, ...] = attrs.field(converter=tuple, default=(), validator=bounded(10_000))
    #: discovery problems, one line each (``nvidia-smi failed: ...``)
    problems: tuple[str, ...] = attrs.field(converter=tuple, default=(), validator=bounded())
    #: copies of distributable models on this node, complete or partial (``--models-dir``)
    model_copies: tuple[ModelCopy, ...] = attrs.field(converter=tuple, default=(), validator=bounded())
    #: free bytes of the filesystem of the models directory; None when it cannot be read
    models_free_bytes: int | None = None
    #: the port this node serves model files to its peers on; None: it serves none
    peer_port: int | None = None


@attrs.frozen
class Sidecar:
    """A helper process started before a shard's engine, ready before it starts."""

    name: str
    argv: tuple[str, ...] = attrs.field(converter=tuple, validator=bounded())
    #: ``tcp:PORT`` (a port accepts connections) or ``http:PORT/PATH`` (answers 200)
    ready: str | None = None


@attrs.frozen
class Profile:
    """How to run one replica: which engine, on how many nodes and GPUs."""

    engine: str
    nodes: int = attrs.field(default=1, validator=[positive, _at_most(MAX_NODES_PER_REPLICA)])
    gpus_per_node: int = attrs.field(default=1, validator=[_non_negative, _at_most(MAX_GPUS_PER_NODE)])
    args: tuple[str, ...] = attrs.field(converter=tuple, default=(), validator=bounded())
    min_gpu_memory_mib: int | None = None
    sidecars: tuple[Sidecar, ...] = attrs.field(converter=tuple, default=(), validator=bounded(16))
    #: seconds rank 0 may take to pass its health check; None: :data:`DEFAULT_READY_TIMEOUT`
    ready_timeout: float | None = attrs.field(
        default=None, validator=_seconds(0, MAX_READY_TIMEOUT, above=True)
    )
    #: seconds a stopping shard has between SIGTERM and SIGKILL to finish in-flight
    #: requests; None: :data:`DEFAULT_STOP_GRACE`
    stop_grace: float | None = attrs.field(default=None, validator=_seconds(0, MAX_STOP_GRACE, above=False))
    #: seconds a rollout to this profile may go without replacing a replica before it pauses; None: no limit
    progress_deadline: float | None = attrs.field(
        default=None, validator=_seconds(0, MAX_READY_TIMEOUT, above=True)
    )
    #: how many LoRA adapters one replica of a model with ``adapters:`` keeps loaded at once
    max_adapters: int = attrs.field(default=4, validator=[positive, _at_most(MAX_ADAPTERS_LOADED)])
    #: the largest LoRA rank an adapter of this profile's models may have (engines size buffers by it)
    max_adapter_rank: int = attrs.field(default=16, validator=[positive, _at_most(MAX_ADAPTER_RANK)])
    #: the profile's engine loads LoRA adapters only at start (its plugin's
    #: :attr:`llmgw.engine.Engine.lora_at_start`): a replica starts with every adapter of its model and
    #: never loads one later. Not a catalog key: :func:`llmgw.catalog.parse_catalog` sets it from the
    #: engines, and a replica's recorded launch keeps what it was started with
    adapters_at_start: bool = attrs.field(default=False, metadata={"catalog_key": False})


def _some_progress(instance: Rollout, attribute: attrs.Attribute, value: int) -> None:
    if value == 0 and instance.max_surge == 0:
        raise ValueError(
            "max_unavailable must be: expected at least 1 when max_surge is 0 "
            "(with both 0 no outdated replica could ever be replaced), got 0"
        )


@attrs.frozen
class Rollout:
    """How a model's outdated replicas are replaced (its catalog key ``rollout:``)."""

    #: replacements placed beside the replicas they replace, at once (each ready before its original stops)
    max_surge: int = attrs.field(default=1, validator=[_non_negative, _at_most(MAX_REPLICAS)])
    #: outdated replicas that may be stopped and restarted in place at once (not serving meanwhile)
    max_unavailable: int = attrs.field(
        default=0, validator=[_non_negative, _at_most(MAX_REPLICAS), _some_progress]
    )


def _share(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not 0 < value <= 1:
        raise ValueError(f"{attribute.name} must be: expected a share above 0 and at most 1, got {value:g}")


def _above_zero(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{attribute.name} must be: expected a number above 0, got {value:g}")


#: the longest stabilization window and cooldown an autoscaled model may ask for, in seconds
MAX_SCALE_WINDOW = 3_600.0
#: the most priority a model may have
MAX_PRIORITY = 1_000


#: the largest ``replicas.target.ttft_p95`` (seconds)
MAX_TTFT_TARGET = 600.0


@attrs.frozen
class ScaleTarget:
    """What an autoscaled model keeps each replica at (the catalog's ``replicas.target``).

    The first two are read from the engines' own gauges, which agents send with
    their syncs; the time to first token is measured by the gateways on streamed
    answers and sent with their activity reports. The autoscaler asks for the
    replicas the most demanding one needs.
    """

    #: requests waiting in the engine's queue, per ready replica (vLLM's ``num_requests_waiting``)
    waiting_per_replica: float | None = attrs.field(default=None, validator=_above_zero)
    #: the share of the KV cache in use, averaged over the ready replicas (vLLM's ``kv_cache_usage_perc``)
    kv_cache_usage: float | None = attrs.field(default=None, validator=_share)
    #: seconds to the first token of a streamed answer, 95th percentile over the gateways' last reports
    ttft_p95: float | None = attrs.field(default=None, validator=_seconds(0, MAX_TTFT_TARGET, above=True))

    def signals(self) -> dict[str, float]:
        """Each target that is set: its key -> its value."""
        return {a.name: v for a in attrs.fields(ScaleTarget) if (v := getattr(self, a.name)) is not None}


@attrs.frozen
class Autoscale:
    """A model's replicas that follow demand (``replicas:`` given as a mapping rather than a number)."""

    min: int = attrs.field(validator=[_non_negative, _at_most(MAX_REPLICAS)])
    max: int = attrs.field(validator=[_non_negative, _at_most(MAX_REPLICAS)])
    target: ScaleTarget = ScaleTarget()
    #: seconds demand must stay low before replicas are stopped (the stabilization window)
    scale_down_after: float = attrs.field(default=60.0, validator=_seconds(0, MAX_SCALE_WINDOW, above=False))
    #: seconds after a change before the next one (a new replica's signals settle meanwhile)
    cooldown: float = attrs.field(default=10.0, validator=_seconds(0, MAX_SCALE_WINDOW, above=False))
    #: replicas added or stopped by one decision at most
    max_step: int = attrs.field(default=2, validator=[positive, _at_most(MAX_REPLICAS)])


@attrs.frozen
class Model:
    """A model the operator wants served, and how many replicas of it."""

    source: str = attrs.field(validator=bounded())
    profile: str
    #: the replicas the catalog asks for; for an autoscaled model, its ``min`` (the autoscaler asks for more)
    replicas: int = attrs.field(default=1, validator=[_non_negative, _at_most(MAX_REPLICAS)])
    #: name clients send as ``model``; the catalog key when not given
    served_name: str | None = None
    #: how outdated replicas are replaced after a change of the command
    rollout: Rollout = Rollout()
    #: replicas that follow demand, when the catalog's ``replicas:`` is a mapping (not a key of its own)
    autoscale: Autoscale | None = attrs.field(default=None, metadata={"catalog_key": False})
    #: which model gives way when the fleet is full: the lower priority
    priority: int = attrs.field(default=0, validator=[_non_negative, _at_most(MAX_PRIORITY)])
    #: seconds without a request after which a model whose ``replicas.min`` is 0 goes to zero replicas
    idle_after: float | None = attrs.field(default=None, validator=_seconds(0, MAX_READY_TIMEOUT, above=True))
    #: LoRA adapters served on top of this model: adapter name (what clients send as ``model``, or
    #: ``SERVED:ADAPTER``) -> its source (``hf://``, ``seed:///`` or a path, as for ``source``)
    adapters: Mapping[str, str] = attrs.field(
        converter=_frozen_mapping, factory=dict, validator=bounded(10_000), hash=False
    )


@attrs.frozen
class Catalog:
    """The operator's desired state: profiles and the models that use them."""

    profiles: Mapping[str, Profile] = attrs.field(factory=dict)
    models: Mapping[str, Model] = attrs.field(factory=dict)

    def served_name(self, key: str) -> str:
        """The name clients use for the model stored under ``key``."""
        return self.models[key].served_name or key


@attrs.frozen
class LoraSpec:
    """What one shard needs to serve its model's LoRA adapters: how many at once, how big, which at start.

    Set on :attr:`LaunchSpec.lora` when the replica's model has ``adapters:`` in the catalog; engines turn it
    into their flags (vLLM's ``--enable-lora --max-loras --max-lora-rank``). Adapters are then loaded and
    unloaded on the running engine (:meth:`llmgw.engine.Engine.lora_load`), except by an engine that loads
    adapters only at start (llama.cpp's ``--lora``), which gets every one in :attr:`at_start`: the server
    fills it with each adapter's source (:attr:`Profile.adapters_at_start`), the agent stages every one
    and starts the engine with their local paths.
    """

    #: how many adapters the replica keeps loaded at once (the profile's ``max_adapters``)
    max_loaded: int = attrs.field(validator=positive)
    #: the largest LoRA rank among the model's adapters (vLLM and SGLang size their buffers by it)
    max_rank: int = attrs.field(default=16, validator=positive)
    #: (adapter name, its path), in the model's catalog order, which is the order the engine numbers
    #: them, for an engine whose :attr:`llmgw.engine.Engine.lora_at_start` is True; empty otherwise. The
    #: server sends each adapter's source; the agent starts the engine with each one's path on the node
    at_start: tuple[tuple[str, str], ...] = attrs.field(converter=tuple, default=())


@attrs.frozen
class LaunchSpec:
    """Everything an engine needs to build the command of one shard.

    A shard is the part of a replica on one node; ``rank`` 0 serves HTTP, the
    others join it at ``dist_init_addr``.
    """

    model_source: str
    served_name: str
    host: str
    port: int
    gpus: tuple[int, ...] = attrs.field(converter=tuple, default=())
    rank: int = attrs.field(default=0, validator=_non_negative)
    nnodes: int = attrs.field(default=1, validator=positive)
    #: ``HOST:PORT``: rank 0 binds it, workers join it; None for one node
    dist_init_addr: str | None = None
    #: addresses of the other ranks' shards, in rank order (engines like
    #: llama.cpp where rank 0 dials its workers need them)
    peer_addrs: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: adapter names of the fabric the replica runs on (``NCCL_IB_HCA``)
    adapters: tuple[str, ...] = attrs.field(converter=tuple, default=())
    extra_args: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: the LoRA adapters the shard serves (None: the model has none, the engine is started without LoRA)
    lora: LoraSpec | None = None
    #: program name -> path on this node, from the agent's configuration;
    #: a program missing here is looked up on PATH by its own name
    executables: Mapping[str, str] = attrs.field(converter=_frozen_mapping, factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.nnodes:
            raise ValueError(f"rank {self.rank} is not below nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("a multi-node launch spec needs dist_init_addr")


@attrs.frozen
class Command:
    """A process to start: what an engine returns for one shard."""

    argv: tuple[str, ...] = attrs.field(converter=tuple)
    env: Mapping[str, str] = attrs.field(converter=_frozen_mapping, factory=dict)
    cwd: str | None = None
