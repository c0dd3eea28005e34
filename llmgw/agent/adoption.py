"""Adopting the shards an earlier agent left running: its records name them, their launchers answer.

An agent killed, restarted or upgraded leaves its engines running under their
launchers (for the launchers' orphan grace: :mod:`llmgw.agent.launcher`). The
next agent on the same state directory reads what its predecessor recorded
(:class:`~llmgw.agent.records.ProcessRecords`: each process group with its
launcher's attach socket, each shard with its desired state) and connects to
each launcher: one that answers with its command's pid is adopted, with the
same shard and the same attempt, and nothing restarts. The records are plain
files and the socket speaks JSON lines, so an upgraded agent reads what an
older one wrote. Groups that do not answer (an older launcher, or one whose
shard record is unreadable) are ended, as leftovers; shards with no engine
to adopt are reported ``exited`` (their processes ended with the agent).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from llmgw.agent.launcher import attach_address
from llmgw.agent.process import Child, read_line
from llmgw.agent.records import ProcessRecords, end_groups, shard_log_path, still_ours
from llmgw.wire import PREVIOUS_AGENT_EXIT, DesiredShard, ObservedShard, WireError, from_json
from llmgw.wire.causes import FailureCause

__all__ = ["Attached", "AdoptedShard", "adopt_running", "previous_exits"]

log = logging.getLogger("llmgw.agent")

#: seconds a launcher has to answer on its attach socket
ATTACH_TIMEOUT = 5.0


class Attached:
    """A launcher this agent attached to through its socket (a :class:`~llmgw.agent.process.Launcher`)."""

    def __init__(self, pgid: int, command_pid: int, stream: trio.SocketStream) -> None:
        #: the launcher's pid (its process group's id)
        self.pid = pgid
        #: the pid of the command it runs
        self.command_pid = command_pid
        self._stream = stream
        self._buffer = b""
        self.returncode: int | None = None

    async def wait(self) -> int | None:
        """Wait until the launcher says its command exited (or is gone); its exit code."""
        while self.returncode is None:
            try:
                chunk = await self._stream.receive_some(4096)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                # a launcher says how its command ended before it exits: this one was killed
                self.returncode = -signal.SIGKILL
                break
            self._buffer += chunk
            while b"\n" in self._buffer:
                line, _, self._buffer = self._buffer.partition(b"\n")
                with contextlib.suppress(ValueError, TypeError):
                    message = json.loads(line)
                    if isinstance(message, dict) and isinstance(message.get("exit"), int):
                        self.returncode = message["exit"]
        return self.returncode

    def close(self) -> None:
        """Detach: the launcher keeps its command for its orphan grace."""
        self._stream.socket.close()


async def _attach(pgid: int, name: str) -> Attached | str:
    """Connect to the attach socket ``name`` of launcher ``pgid``; the attachment, or why there is none."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stream = trio.SocketStream(sock)
    try:
        with trio.fail_after(ATTACH_TIMEOUT):
            await sock.connect(attach_address(name))
            reply = json.loads(await read_line(stream))
        if isinstance(reply, dict) and isinstance(reply.get("pid"), int):
            return Attached(pgid, reply["pid"], stream)
        why = reply.get("error") if isinstance(reply, dict) else None
        problem = f"its launcher refused: {why}" if why else "its launcher answered nonsense"
    except OSError as exc:
        problem = f"its launcher does not answer: {exc.strerror or exc}"
    except trio.TooSlowError:
        problem = f"its launcher did not answer within {ATTACH_TIMEOUT:g} s"
    except ValueError:
        problem = "its launcher answered nonsense"
    sock.close()
    return problem


@attrs.define
class AdoptedShard:
    """A shard an earlier agent ran whose engine (and every sidecar) this agent attached to."""

    desired: DesiredShard
    #: what the earlier agent last recorded of it (None: nothing readable)
    observed: ObservedShard | None
    engine: Child
    #: sidecar name -> its child
    sidecars: dict[str, Child]
    engine_version: str | None = None


def _child(record: dict[str, Any], attached: Attached, log_path: Path) -> Child:
    child = Child(str(record.get("name") or "process"), log_path, socket=record.get("socket"))
    child.sidecar = record.get("sidecar")
    child.process, child.pid = attached, attached.command_pid
    return child


def _shard_of(record: dict[str, Any]) -> tuple[DesiredShard | None, ObservedShard | None]:
    desired = observed = None
    with contextlib.suppress(WireError, ValueError, TypeError, KeyError):
        desired = from_json(record["desired"], DesiredShard)
    with contextlib.suppress(WireError, ValueError, TypeError, KeyError):
        observed = from_json(record["observed"], ObservedShard)
    return desired, observed


async def adopt_running(
    records: ProcessRecords, logs_dir: Path, grace: float
) -> tuple[list[AdoptedShard], list[dict[str, Any]], list[str]]:
    """Attach to what an earlier agent left running; end what cannot be adopted.

    Called by the agent at start, before its first sync.

    :param logs_dir: where shards' logs are (:func:`~llmgw.agent.records.shard_log_path`).
    :param grace: seconds between SIGTERM and SIGKILL for the groups ended.
    :returns: the shards adopted, the shard records not adopted (their processes are gone:
        reported ``exited``), and one line per group ended, for the log.
    """
    groups: dict[str, list[tuple[dict[str, Any], Attached]]] = {}
    leftovers: list[dict[str, Any]] = []
    for record in records.group_records():
        if not still_ours(record):
            records.remove_group(record["pgid"])
            continue
        name = record.get("socket")
        attached = await _attach(record["pgid"], name) if name else "its launcher takes no agent but its own"
        if isinstance(attached, str):
            log.warning("process group %d (%s): %s", record["pgid"], record.get("name"), attached)
            leftovers.append(record)
        else:
            groups.setdefault(str(record.get("shard")), []).append((record, attached))
    adopted: list[AdoptedShard] = []
    gone: list[dict[str, Any]] = []
    for record in records.shard_records():
        desired, observed = _shard_of(record)
        found = groups.pop(record["key"], [])
        engines = [(g, a) for g, a in found if g.get("sidecar") is None]
        if desired is None or len(engines) != 1 or not _all_sidecars(desired, found):
            gone.append(record)
            _let_go(found, leftovers)
            continue
        [(engine_record, engine)] = engines
        adopted.append(
            AdoptedShard(
                desired,
                observed,
                _child(engine_record, engine, shard_log_path(logs_dir, desired)),
                {
                    g["sidecar"]: _child(g, a, shard_log_path(logs_dir, desired, g["sidecar"]))
                    for g, a in found
                    if g.get("sidecar") is not None
                },
                engine_version=record.get("engine_version"),
            )
        )
    for found in groups.values():
        _let_go(found, leftovers)  # groups of shards no record names
    ended = await trio.to_thread.run_sync(end_groups, records, leftovers, grace)
    return adopted, gone, ended


def _all_sidecars(desired: DesiredShard, found: Sequence[tuple[dict[str, Any], Attached]]) -> bool:
    """Whether every sidecar of ``desired`` was attached to (a shard is adopted whole, or not at all)."""
    names = {g.get("sidecar") for g, _ in found if g.get("sidecar") is not None}
    return names == {s.name for s in desired.sidecars}


def _let_go(found: Sequence[tuple[dict[str, Any], Attached]], leftovers: list[dict[str, Any]]) -> None:
    for record, attached in found:
        attached.close()
        leftovers.append(record)


def previous_exits(shard_records: list[dict[str, Any]], records: ProcessRecords) -> list[ObservedShard]:
    """The shards an earlier agent ran that were not adopted, as ``exited`` (unreadable records forgotten)."""
    shards = []
    for record in shard_records:
        try:
            shards.append(
                ObservedShard(
                    replica_id=record["replica_id"],
                    attempt=record["attempt"],
                    rank=record["rank"],
                    state="exited",
                    port=record.get("port"),
                    detail=f"{PREVIOUS_AGENT_EXIT} (pid {record.get('agent_pid')}); it starts again",
                    cause=FailureCause.PREVIOUS_AGENT,
                    since=time.time(),
                )
            )
        except (KeyError, TypeError, ValueError):
            records.remove_shard(record.get("key", ""))
    return shards
