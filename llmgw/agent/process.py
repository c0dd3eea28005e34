"""Starting and stopping the agent's processes, each under a launcher in its own process group.

:func:`run_child` runs one command (an engine or a sidecar) under
:mod:`llmgw.agent.launcher`, started with ``start_new_session=True``;
:func:`keep_child` watches one an earlier agent started and this one adopted
(:mod:`llmgw.agent.adoption`). Cancelling either stops the whole process
group: SIGTERM, a grace period, SIGKILL, logging which step ended it; unless
the child was *detached* (the agent leaves it running for the next agent:
the launcher keeps it for its orphan grace). The launcher watches a pipe
from the agent (or its attach socket) and notices when the agent is gone,
even by ``kill -9``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import attrs
import trio

from llmgw.agent.launcher import LAUNCHER_PREFIX, group_members
from llmgw.models import Command

__all__ = [
    "Child", "Launcher", "AdoptedLauncher", "run_child", "keep_child", "read_line", "last_log_line",
    "describe_exit",
]  # fmt: skip

log = logging.getLogger("llmgw.agent")

#: seconds the launcher has to say it started the command
LAUNCH_TIMEOUT = 30.0
#: the agent waits this much longer than the grace before it SIGKILLs the group
#: itself, so that the launcher (which SIGKILLs at the grace) reports the exit code
KILL_MARGIN = 2.0


class Launcher(Protocol):
    """A launcher process as the agent watches it: its own child, or one it adopted."""

    #: the launcher's pid, which is its process group's id
    pid: int

    @property
    def returncode(self) -> int | None:
        """The launcher's exit code (its command's), once it exited."""

    async def wait(self) -> int | None:
        """Wait until the launcher exited; its exit code."""


class AdoptedLauncher(Launcher, Protocol):
    """A launcher an earlier agent started, attached through its socket."""

    def close(self) -> None:
        """Detach from it: it keeps its command for its orphan grace."""


@attrs.define(eq=False)
class Child:
    """One command run by :func:`run_child`: made by the caller, filled in as it runs."""

    #: what it is, for logs: ``engine`` or ``sidecar NAME``
    name: str
    log_path: Path
    #: the launcher's process (``pgid`` is its pid)
    process: Launcher | None = None
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
    #: when set (a hung engine), a stop SIGKILLs the group this many seconds after SIGTERM
    #: when that is sooner than the grace
    kill_after: float | None = None
    #: the name of the launcher's attach socket (None: its command ends with the agent)
    socket: str | None = None
    #: the sidecar it runs (None: a shard's engine)
    sidecar: str | None = None
    #: set when the agent leaves it running on purpose: a cancel then stops nothing
    detached: bool = False

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


async def _group_gone(child: Child, pgid: int) -> None:
    """Wait until no process of group ``pgid`` runs, at most :data:`KILL_MARGIN` seconds, after the agent
    SIGKILLed it: the launcher dies at once, the engine (and its workers) while they exit, and until
    then they hold their GPU memory and ports. Called before the child counts as exited."""
    with trio.move_on_after(KILL_MARGIN):
        while group_members(pgid):  # noqa: ASYNC110 - nothing signals a process's end but /proc
            await trio.sleep(0.02)
        return
    log.warning("%s (pgid %d): processes still run %g s after SIGKILL", child.name, pgid, KILL_MARGIN)


async def _stop_group(
    child: Child, grace: float, stop_after: Callable[[], Awaitable[None]] | None, process: Launcher
) -> None:
    """Stop a child being cancelled: SIGTERM the group, wait ``grace``, SIGKILL."""
    if stop_after is not None:
        await stop_after()
    if process.returncode is not None:
        return
    started = trio.current_time()
    _killpg(process.pid, signal.SIGTERM)
    if child.kill_after is not None and child.kill_after < grace:
        with trio.move_on_after(child.kill_after):
            await process.wait()
            child.stopped_by = "SIGTERM"
            log.info(
                "%s (pgid %d) ended by SIGTERM in %.1f s",
                child.name,
                process.pid,
                trio.current_time() - started,
            )
            return
        child.stopped_by = "SIGKILL (agent)"
        log.warning(
            "%s (pgid %d) is hung and did not end within %g s of SIGTERM: SIGKILL to the process group",
            child.name,
            process.pid,
            child.kill_after,
        )
        _killpg(process.pid, signal.SIGKILL)
        await _group_gone(child, process.pid)
        return
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


async def read_line(stream: trio.abc.ReceiveStream) -> bytes:
    """Read up to and including a newline (less when the stream ends first); callers own the deadline."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(4096)
        if not chunk:
            break
        data += chunk
    return data


async def _end_unless_detached(
    child: Child, process: Launcher, grace: float, stop_after: Callable[[], Awaitable[None]] | None
) -> None:
    """Called as a child's watch ends: stop a launcher still running (unless detached); note its code."""
    if process.returncode is None and not child.detached:
        with trio.CancelScope(shield=True):
            await _stop_group(child, grace, stop_after, process)
            await process.wait()
    child.returncode = process.returncode


async def run_child(
    child: Child,
    command: Command,
    *,
    grace: float,
    orphan_grace: float = 0.0,
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
    waits for its engine to be gone). A ``child.detached`` is left running.

    :param orphan_grace: seconds the launcher keeps the command once this agent is gone, for
        another to adopt it through ``child.socket`` (0: the command ends with the agent).
    :param on_spawn: called with ``child`` as soon as the launcher runs
        (``child.pgid`` is known), before the command starts: record the group.
    :returns: ``child``, with ``returncode`` set, once the process is gone (or detached);
        ``child.exited`` is set whatever happened.
    """
    argv = [sys.executable, "-m", "llmgw.agent.launcher", "--name", child.name]
    if orphan_grace > 0:
        child.socket = f"llmgw-launcher-{secrets.token_hex(8)}"
    spec = {
        "argv": list(command.argv),
        "env": {**os.environ, **command.env},
        "cwd": command.cwd,
        "grace": grace,
        "orphan_grace": orphan_grace,
        "socket": child.socket,
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
            process = await trio.lowlevel.open_process(
                argv, stdin=control_r, stdout=status_w, stderr=log_fd, start_new_session=True
            )
        finally:
            for fd in (control_r, status_w, log_fd):
                os.close(fd)
        child.process = process
        try:
            if on_spawn is not None:
                on_spawn(child)
            try:
                await control.send_all((json.dumps(spec) + "\n").encode())
                with trio.fail_after(LAUNCH_TIMEOUT):
                    line = await read_line(status)
                reply = json.loads(line) if line.strip() else {"error": "the launcher exited at once"}
            except trio.TooSlowError:
                reply = {"error": f"the launcher did not start the command within {LAUNCH_TIMEOUT:g} s"}
                await _end_unless_detached(child, process, grace, None)
            except (trio.BrokenResourceError, ValueError) as exc:
                reply = {"error": f"the launcher failed: {exc!r}"}
                await _end_unless_detached(child, process, grace, None)
            child.pid = reply.get("pid")
            child.start_error = reply.get("error")
            task_status.started(child)
            await process.wait()
        finally:
            await _end_unless_detached(child, process, grace, stop_after)
        return child
    finally:
        # closing our end of the pipe only now: the launcher reads EOF as "the agent is gone"
        control.close()
        status.close()
        child.exited.set()


async def keep_child(
    child: Child,
    process: AdoptedLauncher,
    *,
    grace: float,
    stop_after: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[Child] = trio.TASK_STATUS_IGNORED,
) -> Child:
    """Watch an adopted launcher (``child.process`` is ``process``) as :func:`run_child` watches its own.

    :returns: ``child`` once the process is gone (or detached); ``child.exited`` is set.
    """
    child.process = process
    task_status.started(child)
    try:
        await process.wait()
        return child
    finally:
        await _end_unless_detached(child, process, grace, stop_after)
        if child.detached:
            process.close()  # the launcher keeps its command for the next agent
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
