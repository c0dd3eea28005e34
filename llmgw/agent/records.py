"""What an agent leaves on disk for the next one: its process groups, its shards, and its lock.

:class:`ProcessRecords` keeps, in the agent's runtime directory, a file per
process group started (with the name of its launcher's attach socket) and per
shard run (with the desired shard, so a new agent can adopt it:
:mod:`llmgw.agent.adoption`). Plain JSON files, written atomically: they are
the one thing two agent versions must agree on across an upgrade, and an
agent killed with ``kill -9`` leaves them as they were.
:func:`end_groups` ends the groups no agent can adopt, so a restarted agent
leaves no orphan holding a port or a GPU.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from llmgw.agent.launcher import group_members
from llmgw.errors import LlmgwError

if TYPE_CHECKING:
    from llmgw.wire import DesiredShard

__all__ = [
    "ProcessRecords", "end_groups", "still_ours", "AgentLockError", "hold_agent_lock", "shard_log_path",
    "FileClaimed", "claim_file",
]  # fmt: skip


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return int(fields[19])  # field 22 (starttime) counted from the state field


class ProcessRecords:
    """Files under ``<runtime_dir>`` naming the process groups and shards this agent started.

    ``groups/<pgid>.json`` exists while a group may be alive;
    ``shards/<key>.json`` while the server may still want that shard. A
    restarted agent reads both: it adopts the groups whose launchers answer
    (and their shards), ends the others (:func:`end_groups`), and reports
    their shards as ``exited``.
    """

    def __init__(self, runtime_dir: Path) -> None:
        self.groups = runtime_dir / "groups"
        self.shards = runtime_dir / "shards"
        self.groups.mkdir(parents=True, exist_ok=True)
        self.shards.mkdir(parents=True, exist_ok=True)

    def add_group(
        self, pgid: int, shard: str, name: str, *, socket: str | None = None, sidecar: str | None = None
    ) -> None:
        """Record a process group just started for ``shard``.

        :param socket: the name of its launcher's attach socket (None: it cannot be adopted).
        :param sidecar: the sidecar it runs (None: the shard's engine).
        """
        record = {
            "pgid": pgid,
            "start_time": _start_time(pgid),
            "shard": shard,
            "name": name,
            "agent_pid": os.getpid(),
            "socket": socket,
            "sidecar": sidecar,
        }
        _write_json(self.groups / f"{pgid}.json", record)

    def remove_group(self, pgid: int) -> None:
        """Forget a group that is gone."""
        with contextlib.suppress(FileNotFoundError):
            (self.groups / f"{pgid}.json").unlink()

    def group_records(self) -> list[dict[str, Any]]:
        """Every recorded group, as written by :meth:`add_group`."""
        return [record for record in _read_all(self.groups) if isinstance(record.get("pgid"), int)]

    def add_shard(self, key: str, data: dict[str, Any]) -> None:
        """Record (or record again, with more) that this agent runs shard ``key``."""
        _write_json(self.shards / f"{quote(key, safe='')}.json", {"key": key, **data})

    def remove_shard(self, key: str) -> None:
        """Forget shard ``key``: the server no longer wants it."""
        with contextlib.suppress(FileNotFoundError):
            (self.shards / f"{quote(key, safe='')}.json").unlink()

    def shard_records(self) -> list[dict[str, Any]]:
        """Every recorded shard, as written by :meth:`add_shard`."""
        records = []
        for path in sorted(self.shards.glob("*.json")):
            record = _read_json(path)
            if record is not None and record.get("key") == unquote(path.stem):
                records.append(record)
        return records

    def save_check_sources(self, sources: tuple[str, ...]) -> None:
        """Remember which model sources the server asks about, for the next agent's first sync."""
        _write_json(self.groups.parent / "check_sources.json", {"sources": list(sources)})

    def check_sources(self) -> tuple[str, ...]:
        """The model sources the server last asked about (empty when never told)."""
        data = _read_json(self.groups.parent / "check_sources.json") or {}
        sources = data.get("sources")
        return tuple(s for s in sources if isinstance(s, str)) if isinstance(sources, list) else ()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_all(directory: Path) -> Iterator[dict[str, Any]]:
    for path in sorted(directory.glob("*.json")):
        data = _read_json(path)
        if data is not None:
            yield data


def still_ours(record: dict[str, Any]) -> bool:
    """Whether the recorded group still has members and is the one recorded (not a reused pid)."""
    pgid = record["pgid"]
    leader_start = _start_time(pgid)
    if leader_start is not None:
        # the leader lives: it is ours only if it is the very process recorded
        return record.get("start_time") in (None, leader_start) and bool(group_members(pgid))
    # leader gone: while any member lives the kernel keeps the group id from being reused
    return bool(group_members(pgid))


def _killpg(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _wait_gone(pgids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(group_members(p) for p in pgids) and time.monotonic() < deadline:
        time.sleep(0.05)


def end_groups(records: ProcessRecords, groups: list[dict[str, Any]], grace: float) -> list[str]:
    """End the recorded ``groups`` still alive: SIGTERM, ``grace`` seconds, SIGKILL; forget them all.

    Blocking (it polls /proc: no event tells when another agent's processes
    end); the agent calls it in a worker thread at start for the groups it
    could not adopt, ``llmgw dev`` when it stops every node.

    :returns: one line per group ended, for the log.
    """
    alive = [r for r in groups if still_ours(r)]
    for record in groups:
        if record not in alive:
            records.remove_group(record["pgid"])
    for record in alive:
        _killpg(record["pgid"], signal.SIGTERM)
    _wait_gone([r["pgid"] for r in alive], grace)
    ended = []
    for record in alive:
        how = "SIGTERM"
        if group_members(record["pgid"]):
            _killpg(record["pgid"], signal.SIGKILL)
            how = "SIGKILL"
            _wait_gone([record["pgid"]], 5)
        ended.append(
            f"process group {record['pgid']} ({record.get('name')} of shard {record.get('shard')}, "
            f"started by agent pid {record.get('agent_pid')}) ended by {how}"
        )
        records.remove_group(record["pgid"])
    return ended


class AgentLockError(LlmgwError):
    """Another agent runs with the same state directory."""


@contextlib.contextmanager
def hold_agent_lock(runtime_dir: Path) -> Iterator[None]:
    """Hold ``<runtime_dir>/agent.lock`` while the block runs.

    :raises AgentLockError: another agent holds it (two agents on one state
        directory would end each other's processes).
    """
    runtime_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = claim_file(runtime_dir / "agent.lock", str(os.getpid()))
    except FileClaimed as claimed:
        raise AgentLockError(
            f"another llmgw agent (pid {claimed.holder or 'unknown'}) is running with state directory"
            f" {runtime_dir.parent}; stop it first, or give this one its own --state-dir"
        ) from None
    try:
        yield
    finally:
        os.close(fd)


class FileClaimed(Exception):
    """Another process holds the file :func:`claim_file` was asked for (:attr:`holder`: what it wrote)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is claimed by {holder or 'another process'}")
        self.holder = holder


def claim_file(path: Path, holder: str) -> int:
    """Lock ``path`` (made when missing) without waiting, and write ``holder`` in it for whoever is refused.

    Called by the agent (its state directory) and ``llmgw dev`` (its nodes' network). The lock goes with
    the returned descriptor: closing it, or the process ending however it ends, releases it.

    :raises FileClaimed: another process holds it.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        held = exc.errno in (errno.EAGAIN, errno.EACCES)
        other = os.pread(fd, 4096, 0).decode(errors="replace").strip() if held else ""
        os.close(fd)
        if not held:
            raise
        raise FileClaimed(path, other) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{holder}\n".encode(), 0)
    return fd


def shard_log_path(logs_dir: Path, desired: DesiredShard, sidecar: str | None = None) -> Path:
    """``<logs>/<replica>-<attempt>-r<rank>.log`` (``.<sidecar>.log`` for a sidecar)."""
    base = f"{desired.replica_id}-{desired.attempt}-r{desired.rank}"
    return logs_dir / (f"{base}.{sidecar}.log" if sidecar else f"{base}.log")
