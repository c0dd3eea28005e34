"""Starting and stopping the agent's processes, each under a launcher in its own process group.

:func:`run_child` runs one command (an engine or a sidecar) under
:mod:`llmgw.agent.launcher`, started with ``start_new_session=True`` through
``trio.run_process``, whose ``deliver_cancel`` stops the whole process group:
SIGTERM, a grace period, SIGKILL, logging which step ended it. The launcher
watches a pipe from the agent and ends the group when the agent dies, even
by ``kill -9``.

:class:`ProcessRecords` keeps, in the agent's runtime directory, a file per
process group started and per shard run; :func:`end_leftovers` ends the
groups an earlier agent left, so a restarted agent leaves no orphan holding
a port or a GPU.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import attrs
import trio

from llmgw.agent.launcher import LAUNCHER_PREFIX, group_members
from llmgw.errors import LlmgwError
from llmgw.models import Command

__all__ = [
    "Child",
    "run_child",
    "ProcessRecords",
    "AgentLockError",
    "hold_agent_lock",
    "end_leftovers",
    "last_log_line",
    "describe_exit",
]

log = logging.getLogger("llmgw.agent")

#: seconds the launcher has to say it started the command
LAUNCH_TIMEOUT = 30.0
#: the agent waits this much longer than the grace before it SIGKILLs the group
#: itself, so that the launcher (which SIGKILLs at the grace) reports the exit code
KILL_MARGIN = 2.0


@attrs.define(eq=False)
class Child:
    """One command run by :func:`run_child`: made by the caller, filled in as it runs."""

    #: what it is, for logs: ``engine`` or ``sidecar NAME``
    name: str
    log_path: Path
    #: the launcher's process (``pgid`` is its pid)
    process: trio.Process | None = None
    #: the command's own pid, once the launcher reported it
    pid: int | None = None
    #: why the launcher could not start the command (then it exits with 127)
    start_error: str | None = None
    #: the command's exit code (negative: killed by that signal), once it ended
    returncode: int | None = None
    #: set when the process is gone (or was never started)
    exited: trio.Event = attrs.field(factory=trio.Event)
    #: which step of a stop ended it: ``SIGTERM``, ``SIGKILL`` (launcher) or ``SIGKILL (agent)``
    stopped_by: str | None = None

    @property
    def pgid(self) -> int | None:
        """The process group id (the launcher's pid), once started."""
        return self.process.pid if self.process is not None else None


def _open_log(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)


def _killpg(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


async def _stop_group(
    child: Child, grace: float, stop_after: Callable[[], Awaitable[None]] | None, process: trio.Process
) -> None:
    """``deliver_cancel`` of :func:`run_child`: SIGTERM the group, wait ``grace``, SIGKILL."""
    if stop_after is not None:
        await stop_after()
    if process.returncode is not None:
        return
    started = trio.current_time()
    _killpg(process.pid, signal.SIGTERM)
    with trio.move_on_after(grace + KILL_MARGIN):
        code = await process.wait()
        took = trio.current_time() - started
        if code == -signal.SIGKILL:
            child.stopped_by = "SIGKILL"
            log.warning(
                "%s (pgid %d) did not end within %g s of SIGTERM: its launcher SIGKILLed the group",
                child.name,
                process.pid,
                grace,
            )
        else:
            child.stopped_by = "SIGTERM"
            log.info("%s (pgid %d) ended by SIGTERM in %.1f s", child.name, process.pid, took)
        return
    child.stopped_by = "SIGKILL (agent)"
    log.warning(
        "%s (pgid %d): launcher still running %g s after SIGTERM: SIGKILL to the process group",
        child.name,
        process.pid,
        grace + KILL_MARGIN,
    )
    _killpg(process.pid, signal.SIGKILL)


async def _read_line(stream: trio.lowlevel.FdStream) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(4096)
        if not chunk:
            break
        data += chunk
    return data


async def run_child(
    child: Child,
    command: Command,
    *,
    grace: float,
    stop_after: Callable[[], Awaitable[None]] | None = None,
    on_spawn: Callable[[Child], None] | None = None,
    task_status: trio.TaskStatus[Child] = trio.TASK_STATUS_IGNORED,
) -> Child:
    """Run ``command`` under a launcher in a new process group, until it exits or this is cancelled.

    Use as ``await nursery.start(run_child, child, command, grace=...)``:
    ``start`` returns once the launcher said whether the command started
    (``child.pid``, or ``child.start_error``). The command's output goes to
    ``child.log_path`` (appended). Cancelling stops the whole group: SIGTERM,
    ``grace`` seconds, SIGKILL; ``stop_after`` is awaited first (a sidecar
    waits for its engine to be gone).

    :param on_spawn: called with ``child`` as soon as the launcher runs
        (``child.pgid`` is known), before the command starts: record the group.
    :returns: ``child``, with ``returncode`` set, once the process is gone;
        ``child.exited`` is set whatever happened.
    """
    argv = [sys.executable, "-m", "llmgw.agent.launcher", "--name", child.name]
    spec = {
        "argv": list(command.argv),
        "env": {**os.environ, **command.env},
        "cwd": command.cwd,
        "grace": grace,
    }
    try:
        log_fd = _open_log(child.log_path)
    except OSError:
        child.exited.set()
        raise
    control_r, control_w = os.pipe()
    status_r, status_w = os.pipe()
    control = trio.lowlevel.FdStream(control_w)
    status = trio.lowlevel.FdStream(status_r)
    try:
        try:
            async with trio.open_nursery() as nursery:
                try:
                    child.process = await nursery.start(
                        functools.partial(
                            trio.run_process,
                            argv,
                            stdin=control_r,
                            stdout=status_w,
                            stderr=log_fd,
                            start_new_session=True,
                            check=False,
                            deliver_cancel=functools.partial(_stop_group, child, grace, stop_after),
                        )
                    )
                finally:
                    for fd in (control_r, status_w, log_fd):
                        os.close(fd)
                if on_spawn is not None:
                    on_spawn(child)
                try:
                    await control.send_all((json.dumps(spec) + "\n").encode())
                    with trio.fail_after(LAUNCH_TIMEOUT):
                        line = await _read_line(status)
                    reply = json.loads(line) if line.strip() else {"error": "the launcher exited at once"}
                except trio.TooSlowError:
                    reply = {"error": f"the launcher did not start the command within {LAUNCH_TIMEOUT:g} s"}
                    nursery.cancel_scope.cancel()
                except (trio.BrokenResourceError, ValueError) as exc:
                    reply = {"error": f"the launcher failed: {exc!r}"}
                    nursery.cancel_scope.cancel()
                child.pid = reply.get("pid")
                child.start_error = reply.get("error")
                task_status.started(child)
        finally:
            if child.process is not None:
                child.returncode = child.process.returncode
        return child
    finally:
        # closing our end of the pipe only now: the launcher reads EOF as "end the group"
        control.close()
        status.close()
        child.exited.set()


def describe_exit(code: int | None) -> str:
    """``exited with code 1`` or ``killed by SIGKILL``."""
    if code is None:
        return "ended"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code}"


def last_log_line(path: Path, skip_launcher: bool = True) -> str | None:
    """The last non-empty line of a log (not one the launcher wrote), at most 300 characters."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 16384))
            text = handle.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line and not (skip_launcher and line.startswith(LAUNCHER_PREFIX)):
            return line[:300]
    return None


# -- records of what this agent started -----------------------------------------------------------


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
    restarted agent reads both: it ends the groups (:func:`end_leftovers`) and
    reports the shards as ``exited``, since their processes died with it.
    """

    def __init__(self, runtime_dir: Path) -> None:
        self.groups = runtime_dir / "groups"
        self.shards = runtime_dir / "shards"
        self.groups.mkdir(parents=True, exist_ok=True)
        self.shards.mkdir(parents=True, exist_ok=True)

    def add_group(self, pgid: int, shard: str, name: str) -> None:
        """Record a process group just started for ``shard``."""
        record = {
            "pgid": pgid,
            "start_time": _start_time(pgid),
            "shard": shard,
            "name": name,
            "agent_pid": os.getpid(),
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
        """Record that this agent runs shard ``key``."""
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


def _still_ours(record: dict[str, Any]) -> bool:
    """Whether the recorded group still has members and is the one recorded (not a reused pid)."""
    pgid = record["pgid"]
    leader_start = _start_time(pgid)
    if leader_start is not None:
        # the leader lives: it is ours only if it is the very process recorded
        return record.get("start_time") in (None, leader_start) and bool(group_members(pgid))
    # leader gone: while any member lives the kernel keeps the group id from being reused
    return bool(group_members(pgid))


async def end_leftovers(records: ProcessRecords, grace: float) -> list[str]:
    """End every recorded process group that is still alive: SIGTERM, ``grace`` seconds, SIGKILL.

    Called by the agent at start, before it starts anything: the groups are
    what an earlier agent on this state directory left running (its
    launchers normally end them when it dies; this catches the rest).

    :returns: one line per group ended, for the log.
    """
    alive = [r for r in records.group_records() if _still_ours(r)]
    for record in records.group_records():
        if record not in alive:
            records.remove_group(record["pgid"])
    ended = []
    for record in alive:
        _killpg(record["pgid"], signal.SIGTERM)
    with trio.move_on_after(grace):
        # no event tells when another agent's processes end: poll /proc
        while any(group_members(r["pgid"]) for r in alive):  # noqa: ASYNC110
            await trio.sleep(0.05)
    for record in alive:
        how = "SIGTERM"
        if group_members(record["pgid"]):
            _killpg(record["pgid"], signal.SIGKILL)
            how = "SIGKILL"
        with trio.move_on_after(5):
            while group_members(record["pgid"]):  # noqa: ASYNC110
                await trio.sleep(0.05)
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
    path = runtime_dir / "agent.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise AgentLockError(
                f"another llmgw agent (pid {holder}) is running with state directory {runtime_dir.parent}; "
                "stop it first, or give this one its own --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
