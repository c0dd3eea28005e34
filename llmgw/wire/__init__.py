"""Every JSON document that crosses a process boundary, and the one converter that reads and writes them.

- The agent protocol (DESIGN.md, "Agent protocol"): the agent posts a
  :class:`SyncRequest` to ``POST /v1/agent/sync`` and gets a :class:`SyncReply`.
- The routes feed: ``GET /v1/routes`` answers a :class:`RouteTable`, built by
  the server's cluster and handed as is to the gateway's balancer.
- Gateway reports: ``POST /v1/gateway/suspect`` takes a :class:`SuspectReport`;
  ``POST /v1/gateway/allowances`` an :class:`AllowanceRequest` (answered an :class:`AllowanceReply`).
- The admin API (``llmgw ctl``): one record per request and answer
  (:class:`NodeList`, :class:`ReplicaList`, :class:`DrainStatus`, ...), and
  :class:`ErrorReply` for every refusal.

The domain records never see JSON: :func:`to_json` and :func:`from_json` go
through :data:`converter`, the one cattrs converter of llmgw (the catalog and
the agent's ``agent.toml`` use it too): strict about types (``"8000"``,
``8000.9`` and ``true`` are not integers; a list is not a string), tolerant
of keys a newer peer adds, except in documents people write (the catalog's
profiles, models and sidecars refuse unknown keys, to catch typos).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError, IterableValidationError
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.v import format_exception

from llmgw.errors import LlmgwError
from llmgw.models import LaunchSpec, NodeFacts, Sidecar, bounded

# the records of each group of documents, re-exported: each module's ``__all__`` is the one list of its names
from llmgw.wire import (
    _adapters,
    _allowances,
    _autoscale,
    _catalog,
    _gateway,
    _keys,
    _load,
    _rollout,
    _routes,
    _weights,
)
from llmgw.wire._adapters import *  # noqa: F403
from llmgw.wire._adapters import AdapterCause, AdapterState, DesiredAdapters, ObservedAdapter
from llmgw.wire._allowances import *  # noqa: F403
from llmgw.wire._autoscale import *  # noqa: F403
from llmgw.wire._catalog import *  # noqa: F403
from llmgw.wire._gateway import *  # noqa: F403
from llmgw.wire._hooks import (
    capped,
    register_catalog_records,
    register_strict_collections,
    register_strict_scalars,
    shown,
)
from llmgw.wire._keys import *  # noqa: F403
from llmgw.wire._keys import BudgetPeriod, Priority, structure_choice
from llmgw.wire._load import *  # noqa: F403
from llmgw.wire._load import ShardLoad
from llmgw.wire._rollout import *  # noqa: F403
from llmgw.wire._rollout import RolloutStatus
from llmgw.wire._routes import *  # noqa: F403
from llmgw.wire._weights import *  # noqa: F403
from llmgw.wire._weights import StagingProgress
from llmgw.wire.causes import FailureCause, structure_cause

__all__ = [  # noqa: RUF022 - grouped by document, not sorted
    "SHARD_STATES", "PREVIOUS_AGENT_EXIT", "ObservedShard", "DesiredShard", "SyncRequest", "SyncReply",
    "NodeStatus", "NodeList", "DrainStatus", "ShardStatus", "ReplicaStatus", "UnplacedStatus", "ReplicaList",
    "EventEntry", "EventList", "EngineInfo", "EngineList", "ErrorDetail", "ErrorReply", "WireError",
    "converter",
    "register_strict_scalars", "to_json", "from_json", "error_message", "shown", "capped", "shard_key",
    "SHARD_PORTS", "valid_port_range",
    *_routes.__all__, *_catalog.__all__, *_rollout.__all__, *_keys.__all__, *_gateway.__all__,
    *_allowances.__all__, *_weights.__all__, *_load.__all__, *_autoscale.__all__, *_adapters.__all__,
]  # fmt: skip

T = TypeVar("T")

# ---------------------------------------------------------------------------
# the agent protocol
# ---------------------------------------------------------------------------

#: What an agent reports for a shard:
#: ``staging`` (waiting for a verified copy of the model's files on this node), ``starting``
#: (sidecars or engine starting), ``running`` (process up; a
#: worker stays here), ``ready`` (rank 0 passes its health check),
#: ``unhealthy`` (was running, now fails its health check, or never became
#: ready in time), ``exited`` (the process ended), ``stopping``.
SHARD_STATES = ("staging", "starting", "running", "ready", "unhealthy", "exited", "stopping")
#: how the ``detail`` of an ``exited`` shard a new agent found its predecessor ran (and ended) begins
PREVIOUS_AGENT_EXIT = "ended with the previous agent"


def shard_key(replica_id: str, attempt: int, rank: int) -> str:
    """The name of one shard of one attempt of a replica: ``llama-0/3/r1``."""
    return f"{replica_id}/{attempt}/r{rank}"


@attrs.frozen
class ObservedShard:
    """A shard as the agent running it sees it."""

    replica_id: str = attrs.field(validator=bounded())
    attempt: int
    rank: int
    state: str = attrs.field(validator=attrs.validators.in_(SHARD_STATES))
    pid: int | None = None
    port: int | None = None
    exit_code: int | None = None
    #: one line for the operator: why it is unhealthy, the log's last line...
    detail: str | None = attrs.field(default=None, validator=bounded())
    since: float = 0.0
    #: the engine's command line, and the environment llmgw set for it (not the agent's own), once built
    argv: tuple[str, ...] = attrs.field(converter=tuple, default=())
    env: Mapping[str, str] = attrs.field(converter=dict, factory=dict)
    #: the shard's log file on its node, and the engine's version as the node found it
    log_path: str | None = None
    engine_version: str | None = None
    #: while ``staging``: the copy's bytes present, total and rate (None: not fetching yet)
    staged: StagingProgress | None = None
    #: once ``exited`` or ``unhealthy``: why (:mod:`llmgw.wire.causes`); None from agents that predate it
    cause: FailureCause | None = attrs.field(default=None, converter=attrs.converters.optional(FailureCause))

    @property
    def key(self) -> str:
        """This shard's :func:`shard_key`."""
        return shard_key(self.replica_id, self.attempt, self.rank)


@attrs.frozen
class DesiredShard:
    """A shard the server wants a node to run."""

    replica_id: str
    attempt: int
    rank: int
    model: str
    engine: str
    #: the launch spec without ``executables``: the agent adds its own paths
    spec: LaunchSpec
    sidecars: tuple[Sidecar, ...] = attrs.field(converter=tuple, default=())
    #: seconds rank 0 may take to pass its health check after starting
    ready_timeout: float = 600.0
    #: seconds between SIGTERM and SIGKILL when the shard is stopped; None: the agent's own setting
    stop_grace: float | None = None
    #: the replica is stopping: keep this worker running until the server drops it (once its rank 0
    #: is gone), and never start it anew
    stop_after_rank0: bool = False

    @property
    def key(self) -> str:
        """This shard's :func:`shard_key`."""
        return shard_key(self.replica_id, self.attempt, self.rank)


#: the ports a node may offer its shards: unprivileged, so an agent never needs root to bind them
SHARD_PORTS = (1024, 65535)


def valid_port_range(first: int, last: int) -> bool:
    """Whether ``first..last`` is a port range a node may offer (within :data:`SHARD_PORTS`, in order)."""
    return SHARD_PORTS[0] <= first <= last <= SHARD_PORTS[1]


def _ports(attribute: attrs.Attribute, value: tuple[int, int]) -> None:
    if not valid_port_range(*value):
        expected = f"expected [FIRST, LAST] with {SHARD_PORTS[0]} <= FIRST <= LAST <= {SHARD_PORTS[1]}"
        raise ValueError(f"{attribute.name}: {expected}, got [{value[0]}, {value[1]}]")


@attrs.frozen
class SyncRequest:
    """What an agent posts: its facts, its shards, the revision it has applied."""

    node_id: str = attrs.field(validator=bounded(text=253))
    address: str = attrs.field(validator=bounded(text=253))
    facts: NodeFacts
    #: first and last port the server may give this node's shards
    port_range: tuple[int, int] = attrs.field(validator=lambda _, attribute, value: _ports(attribute, value))
    observed: tuple[ObservedShard, ...] = attrs.field(converter=tuple, default=(), validator=bounded())
    #: the revision of the last reply this agent applied; 0 after it starts
    revision: int = 0
    #: whether the server may hold the reply until something changes
    wait: bool = True
    #: the model sources ``facts.model_sources`` was checked against (the
    #: server's ``check_sources``): a source not in here is not known missing
    checked_sources: tuple[str, ...] = attrs.field(converter=tuple, default=(), validator=bounded(10_000))
    #: a random id per agent process (a new one: the agent restarted); ``leaving``: it stops on purpose
    instance: str = attrs.field(default="", validator=bounded(text=64))
    leaving: bool = False
    #: the load of each ready rank 0 this node runs, read from its engine; () from agents that predate it
    load: tuple[ShardLoad, ...] = attrs.field(converter=tuple, default=(), validator=bounded())
    #: the LoRA adapters on the replicas whose rank 0 runs here
    adapters: tuple[ObservedAdapter, ...] = attrs.field(converter=tuple, default=(), validator=bounded(4096))


@attrs.frozen
class SyncReply:
    """The server's answer: the shards the node should run at ``revision``."""

    revision: int
    shards: tuple[DesiredShard, ...] = attrs.field(converter=tuple, default=())
    #: model sources the agent should report on (exists on disk or not)
    check_sources: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: distributable sources to copy into the models directory now, with no shard yet (a rollout's
    #: new weights, staged before it stops the replicas running the old ones)
    stage_sources: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: seconds without a sync after which the server declares the node lost
    lost_after: float = 30.0
    #: the share of a model's size to keep free beyond its copy (``llmgw server --disk-headroom``): the
    #: agent evicts unused copies for it
    disk_headroom: float = 0.05
    #: the LoRA adapters each replica whose rank 0 runs on the node should keep loaded
    adapters: tuple[DesiredAdapters, ...] = attrs.field(converter=tuple, default=())


# ---------------------------------------------------------------------------
# the admin API (server <-> llmgw ctl); ``ctl ... -o json`` prints these as they are
# ---------------------------------------------------------------------------


@attrs.frozen
class NodeStatus:
    """One node in ``GET /v1/admin/nodes``."""

    node_id: str
    address: str
    #: ``ready``, ``cordoned``, ``draining``, ``lost`` or ``revoked``
    state: str
    gpus_total: int
    gpus_free: int
    fabrics: tuple[str, ...]
    #: engine name -> version found on the node
    engines: Mapping[str, str]
    agent_version: str
    #: ids of the replicas with a shard on this node
    replicas: tuple[str, ...]
    #: one line each: revoked or expiring certificate, scheduler warnings
    warnings: tuple[str, ...]
    #: seconds since the node's agent last synced
    last_sync_ago: float
    #: GPU model (nvidia-smi's name) -> how many the node has (``ctl nodes -o wide``)
    gpu_models: Mapping[str, int] = attrs.field(factory=dict)
    #: fabric -> the adapters the node uses on it
    fabric_adapters: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    #: free bytes of its models directory's filesystem (None: not known), and its copies there (partial too)
    models_free_bytes: int | None = None
    copies: int = 0


@attrs.frozen
class NodeList:
    """``GET /v1/admin/nodes``: every node, by id."""

    nodes: tuple[NodeStatus, ...] = ()


@attrs.frozen
class DrainStatus:
    """How a drain goes: the answer of ``POST /v1/admin/nodes/N/ACTION`` and ``GET .../N/drain``."""

    node_id: str
    state: str
    #: replicas still on the node (replacements not counted)
    remaining: tuple[str, ...] = ()
    #: of those, the ones whose replacement is being built
    moving: tuple[str, ...] = ()
    #: ``id: reason`` of replacements that cannot be placed
    stuck: tuple[str, ...] = ()


@attrs.frozen
class ShardStatus:
    """One shard of a replica, with what its agent last observed."""

    rank: int
    node: str
    gpus: tuple[int, ...]
    port: int
    #: the observed state (:data:`SHARD_STATES`), or ``pending`` before the agent reports it
    state: str
    pid: int | None = None
    detail: str | None = None
    #: as the agent reported them (:class:`ObservedShard`); empty before it does
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = attrs.field(factory=dict)
    log_path: str | None = None
    engine_version: str | None = None


@attrs.frozen
class ReplicaStatus:
    """One replica in ``GET /v1/admin/replicas``."""

    id: str
    model: str
    #: ``staging`` (a shard waits for its copy of the weights), ``starting``, ``ready`` or ``backoff``
    state: str
    attempt: int
    failures: int
    reason: str | None
    fabric: str | None
    #: the replica this one replaces (a drain's move), if any
    replaces: str | None
    shards: tuple[ShardStatus, ...] = ()
    #: runs another command than the catalog in force asks for (a rollout replaces it)
    outdated: bool = False
    #: while ``staging``: its shards' copies summed (rate summed, ETA of the slowest)
    staging: StagingProgress | None = None
    #: while ``staging``: seconds left for the slowest shard's copy (None: not known yet)
    eta: float | None = None


@attrs.frozen
class UnplacedStatus:
    """A replica the catalog asks for that cannot be placed, and why."""

    id: str
    model: str
    reason: str
    replaces: str | None = None


@attrs.frozen
class ReplicaList:
    """``GET /v1/admin/replicas``."""

    replicas: tuple[ReplicaStatus, ...] = ()
    unplaced: tuple[UnplacedStatus, ...] = ()
    #: the catalog revision in force
    catalog_revision: int = 0
    #: every model's rollout (``ctl rollout status``; ``apply --wait`` stops on a paused one)
    rollouts: tuple[RolloutStatus, ...] = ()


@attrs.frozen
class EventEntry:
    """One entry of ``GET /v1/admin/events``: something the server decided, and why."""

    id: int
    at: float
    kind: str
    subject: str
    message: str


@attrs.frozen
class EventList:
    """``GET /v1/admin/events?since=ID&limit=N``: oldest first."""

    events: tuple[EventEntry, ...] = ()


@attrs.frozen
class EngineInfo:
    """An engine the server's plugins provide."""

    name: str
    checked_versions: tuple[str, ...]
    multi_node: bool


@attrs.frozen
class EngineList:
    """``GET /v1/admin/engines``."""

    engines: tuple[EngineInfo, ...] = ()


@attrs.frozen
class ErrorDetail:
    """What went wrong, for a person: every refusal of the server carries one."""

    message: str
    #: ``invalid_request``, ``unauthenticated``, ``forbidden``, ``revoked`` (the caller's certificate),
    #: ``not_found``, ``invalid_catalog``, ``starting`` (the server is loading its state), ``error``
    type: str = "error"
    #: a refused catalog's problems, one line each (absent from the JSON otherwise)
    problems: tuple[str, ...] | None = None


@attrs.frozen
class ErrorReply:
    """The body of every 4xx answer: ``{"error": {"message": ..., "type": ...}}``."""

    error: ErrorDetail


class WireError(LlmgwError):
    """A message that does not have the protocol's shape."""


# ---------------------------------------------------------------------------
# the converter
# ---------------------------------------------------------------------------


def _make_converter() -> cattrs.Converter:
    made = cattrs.Converter(forbid_extra_keys=False)
    register_strict_scalars(made)
    register_strict_collections(made)
    register_catalog_records(made)
    made.register_unstructure_hook(
        ErrorDetail, make_dict_unstructure_fn(ErrorDetail, made, problems=override(omit_if_default=True))
    )
    made.register_unstructure_hook(FailureCause, str)
    made.register_structure_hook(FailureCause, structure_cause)
    for choice in (Priority, BudgetPeriod, AdapterState, AdapterCause):
        made.register_unstructure_hook(choice, str)
        made.register_structure_hook(choice, structure_choice)
    return made


#: The one converter: wire documents, stored records, the catalog, ``agent.toml``.
converter = _make_converter()


def _reason(exc: BaseException, kind: type | None) -> str:
    """Our own messages (``expected an integer``) as they are; cattrs' wording for the rest."""
    if isinstance(exc, TypeError | ValueError) and not isinstance(exc, KeyError) and str(exc):
        return str(exc)
    return format_exception(exc, kind)


def to_json(record: Any) -> Any:
    """A record as JSON-ready data (dicts, lists, strings, numbers)."""
    return converter.unstructure(record)


def from_json(data: Any, kind: type[T]) -> T:
    """Build a ``kind`` record from JSON data; called on every document received.

    :raises WireError: naming each field that has the wrong shape.
    """
    try:
        return converter.structure(data, kind)
    except (ClassValidationError, IterableValidationError) as exc:
        problems = cattrs.transform_error(exc, path=kind.__name__, format_exception=_reason)
        raise WireError(f"malformed {kind.__name__}: {'; '.join(capped(problems))}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise WireError(f"malformed {kind.__name__}: {capped([str(exc)])[0]}") from None


def error_message(data: Any) -> str | None:
    """The message of an :class:`ErrorReply` in JSON ``data``; None when ``data`` is not one.

    Called by every client of the server (ctl, the gateway's routes feed) on a refusal.
    """
    try:
        return from_json(data, ErrorReply).error.message
    except WireError:
        return None
