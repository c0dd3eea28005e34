"""The agent protocol's messages and their JSON form.

One call carries it all (DESIGN.md, "Agent protocol"): the agent posts a
:class:`SyncRequest` to ``POST /v1/agent/sync`` and gets a :class:`SyncReply`.
The domain records never see JSON: :func:`to_json` and :func:`from_json` go
through one converter, strict about types, tolerant of keys a newer peer
adds (a newer agent may say more than this server knows).
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError

from llmgw.catalog import register_strict_scalars
from llmgw.errors import LlmgwError
from llmgw.models import LaunchSpec, NodeFacts, Sidecar

__all__ = [
    "SHARD_STATES",
    "ObservedShard",
    "DesiredShard",
    "SyncRequest",
    "SyncReply",
    "WireError",
    "to_json",
    "from_json",
    "shard_key",
]

T = TypeVar("T")

#: What an agent reports for a shard:
#: ``starting`` (sidecars or engine starting), ``running`` (process up; a
#: worker stays here), ``ready`` (rank 0 passes its health check),
#: ``unhealthy`` (was running, now fails its health check, or never became
#: ready in time), ``exited`` (the process ended), ``stopping``.
SHARD_STATES = ("starting", "running", "ready", "unhealthy", "exited", "stopping")


def shard_key(replica_id: str, attempt: int, rank: int) -> str:
    """The name of one shard of one attempt of a replica: ``llama-0/3/r1``."""
    return f"{replica_id}/{attempt}/r{rank}"


@attrs.frozen
class ObservedShard:
    """A shard as the agent running it sees it."""

    replica_id: str
    attempt: int
    rank: int
    state: str = attrs.field(validator=attrs.validators.in_(SHARD_STATES))
    pid: int | None = None
    port: int | None = None
    exit_code: int | None = None
    #: one line for the operator: why it is unhealthy, the log's last line...
    detail: str | None = None
    since: float = 0.0

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

    @property
    def key(self) -> str:
        """This shard's :func:`shard_key`."""
        return shard_key(self.replica_id, self.attempt, self.rank)


@attrs.frozen
class SyncRequest:
    """What an agent posts: its facts, its shards, the revision it has applied."""

    node_id: str
    address: str
    facts: NodeFacts
    #: first and last port the server may give this node's shards
    port_range: tuple[int, int]
    observed: tuple[ObservedShard, ...] = attrs.field(converter=tuple, default=())
    #: the revision of the last reply this agent applied; 0 after it starts
    revision: int = 0
    #: whether the server may hold the reply until something changes
    wait: bool = True
    #: the model sources ``facts.model_sources`` was checked against (the
    #: server's ``check_sources``): a source not in here is not known missing
    checked_sources: tuple[str, ...] = attrs.field(converter=tuple, default=())


@attrs.frozen
class SyncReply:
    """The server's answer: the shards the node should run at ``revision``."""

    revision: int
    shards: tuple[DesiredShard, ...] = attrs.field(converter=tuple, default=())
    #: model sources the agent should report on (exists on disk or not)
    check_sources: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: seconds without a sync after which the server declares the node lost
    lost_after: float = 30.0


class WireError(LlmgwError):
    """A message that does not have the protocol's shape."""


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=False)
    register_strict_scalars(converter)
    return converter


_converter = _make_converter()


def to_json(record: Any) -> Any:
    """A record as JSON-ready data (dicts, lists, strings, numbers)."""
    return _converter.unstructure(record)


def from_json(data: Any, kind: type[T]) -> T:
    """Build a ``kind`` record from JSON data.

    :raises WireError: naming each field that has the wrong shape.
    """
    try:
        return _converter.structure(data, kind)
    except ClassValidationError as exc:
        problems = "; ".join(cattrs.transform_error(exc, path=kind.__name__))
        raise WireError(f"malformed {kind.__name__}: {problems}") from None
    except (TypeError, ValueError, KeyError) as exc:
        raise WireError(f"malformed {kind.__name__}: {exc}") from None
