"""Real processes in tests, cleaned up even when the test fails.

:func:`start` runs a command in its own session (so its whole process group
can be signalled), with stdout and stderr captured to files; the
:func:`running` context manager and the :func:`processes` fixture end every
group they started. :func:`wait_for` (trio) and :func:`wait_until` (plain
code) poll a condition until a deadline and fail loudly, naming the
condition, with the captured stderr of the processes involved, when it does
not come true.

In trio tests the caller owns the deadline::

    with trio.fail_after(10):
        await wait_for(ready, "the replica to be ready", processes)

:func:`wait_for` reads the deadline of the enclosing cancel scope and fails
with :class:`WaitTimeout` just before it, so the failure says what did not
happen rather than a bare ``TooSlowError``. Plain (non-trio) code has no
cancel scope to carry a deadline, so :func:`wait_until` takes it as
``timeout`` seconds from now.

Use the fixture from a ``conftest.py``::

    from llmgw.testing.processes import processes  # noqa: F401
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
import trio

from llmgw.agent.launcher import group_members, pid_alive

__all__ = [
    "ManagedProcess",
    "ProcessSet",
    "WaitTimeout",
    "free_port",
    "group_alive",
    "pid_alive",
    "processes",
    "resume",
    "run_pytest",
    "running",
    "sigint_default",
    "start",
    "taken_port",
    "wait_for",
    "wait_until",
]

T = TypeVar("T")

#: how often the wait helpers re-check their condition
POLL_INTERVAL = 0.02


class WaitTimeout(AssertionError):
    """A condition a test waited for did not come true in time."""


class ManagedProcess:
    """A process started by :func:`start`, leader of its own process group."""

    def __init__(self, argv: Sequence[str], popen: subprocess.Popen, name: str, log_dir: Path) -> None:
        self.argv = list(argv)
        self.popen = popen
        self.name = name
        self.stdout_path = log_dir / f"{name}.stdout"
        self.stderr_path = log_dir / f"{name}.stderr"

    @property
    def pid(self) -> int:
        """The process id, which is also its process group id."""
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        return self.popen.poll()

    def stderr(self) -> str:
        """Everything the process wrote to stderr so far."""
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        """Everything the process wrote to stdout so far."""
        return self.stdout_path.read_text(errors="replace")

    def stderr_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of stderr, headed by the process's name and state."""
        tail = self.stderr().splitlines()[-lines:]
        state = "running" if self.returncode is None else f"exited {self.returncode}"
        header = f"--- {self.name} (pid {self.pid}, {state}) stderr, last {len(tail)} lines ---"
        return "\n".join([header, *tail])

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process itself (not its group); no-op once it exited."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signum)

    def kill_group(self) -> None:
        """SIGKILL the whole process group, reap the leader, and wait (up to 5 s) for the rest to die."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait()
        deadline = time.monotonic() + 5
        while group_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL)

    def wait_exit(self, timeout: float) -> int:
        """Wait for the process to exit and return its code; fail loudly after ``timeout`` seconds."""
        wait_until(lambda: self.returncode is not None, timeout, f"{self.name} to exit", self)
        return self.popen.returncode

    async def wait_exit_trio(self) -> int:
        """:meth:`wait_exit` for trio tests, by the caller's deadline (``trio.fail_after`` around it)."""
        await wait_for(lambda: self.returncode is not None, f"{self.name} to exit", self)
        return self.popen.returncode

    def wait_for_stderr(self, text: str, timeout: float) -> str:
        """Wait until a line of stderr contains ``text``, and return that line."""
        return wait_until(lambda: self._line_with(text), timeout, f"{self.name} to log {text!r}", self)

    async def wait_for_stderr_trio(self, text: str) -> str:
        """:meth:`wait_for_stderr` for trio tests, by the caller's deadline (``trio.fail_after``)."""
        return await wait_for(lambda: self._line_with(text), f"{self.name} to log {text!r}", self)

    def _line_with(self, text: str) -> str | None:
        return next((line for line in self.stderr().splitlines() if text in line), None)

    def __repr__(self) -> str:
        return f"<ManagedProcess {self.name} pid={self.pid}>"


def resume(pids: Iterable[int]) -> None:
    """SIGCONT each of ``pids`` still running: called (in a ``finally``) by tests that SIGSTOP engines, so
    that none is left stopped for the cleanup to wait on."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies do not count)."""
    return bool(group_members(pgid))


def start(
    argv: Sequence[str],
    *,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    extra_env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    log_dir: str | os.PathLike | None = None,
) -> ManagedProcess:
    """Start ``argv`` in a new session with stdout and stderr going to files.

    The caller must end it with :meth:`ManagedProcess.kill_group`; prefer
    :func:`running` or the :func:`processes` fixture, which always do.

    :param name: names the log files and failure messages; the program's name by default.
    :param env: the whole environment; the current one by default.
    :param extra_env: variables set on top of ``env``.
    :param log_dir: where ``NAME.stdout``/``NAME.stderr`` go; a new temporary directory by default.
    :returns: the started process.
    """
    name = name or Path(argv[0]).name
    directory = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="llmgw-test-"))
    directory.mkdir(parents=True, exist_ok=True)
    environment = dict(os.environ if env is None else env) | dict(extra_env or {})
    with open(directory / f"{name}.stdout", "wb") as out, open(directory / f"{name}.stderr", "wb") as err:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=environment,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=sigint_default(),
        )
    return ManagedProcess(argv, popen, name, directory)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sigint_default() -> Callable[[], None] | None:
    """The ``preexec_fn`` that gives a child SIGINT's default disposition back when this process has it
    ignored (pytest started as a background job of a script, as CI does: children inherit the ignore, and
    a Python child then never turns SIGINT into KeyboardInterrupt); None when nothing needs restoring.

    Used by :func:`start` and by tests that start a process that must stop on SIGINT with ``Popen``.
    """
    return _default_sigint if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else None


@contextlib.contextmanager
def running(argv: Sequence[str], **kwargs) -> Iterator[ManagedProcess]:
    """Start ``argv`` as :func:`start` does; kill its whole process group on exit, however the block ends."""
    process = start(argv, **kwargs)
    try:
        yield process
    finally:
        process.kill_group()


class ProcessSet:
    """Processes started for one test, all killed (group by group) by :meth:`kill_all`."""

    def __init__(self, log_dir: str | os.PathLike | None = None) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="llmgw-test-"))
        self.started: list[ManagedProcess] = []

    def start(self, argv: Sequence[str], *, name: str | None = None, **kwargs) -> ManagedProcess:
        """Start a process as :func:`start` does, logging under this set's directory.

        Names are made unique (``sim``, ``sim-2``...) so logs never overwrite each other.
        """
        base = name or Path(argv[0]).name
        taken = {process.name for process in self.started}
        name = base
        counter = 2
        while name in taken:
            name, counter = f"{base}-{counter}", counter + 1
        process = start(argv, name=name, log_dir=self.log_dir, **kwargs)
        self.started.append(process)
        return process

    def stderr_tails(self, lines: int = 40) -> str:
        """Every process's stderr tail, for a failure message."""
        return "\n".join(process.stderr_tail(lines) for process in self.started)

    def kill_all(self) -> None:
        """SIGKILL every process group this set started and reap the leaders."""
        for process in self.started:
            process.kill_group()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[ProcessSet]:
    """A :class:`ProcessSet` whose groups are all killed when the test ends, pass or fail."""
    process_set = ProcessSet(tmp_path / "processes")
    try:
        yield process_set
    finally:
        process_set.kill_all()


def _timeout_message(what: str, timeout: float, last: object, involved: Iterable[ManagedProcess]) -> str:
    lines = [f"timed out after {timeout:g}s waiting for {what}"]
    if last is not None:
        lines.append(f"last error: {last!r}")
    lines.extend(process.stderr_tail() for process in involved)
    return "\n".join(lines)


def _involved(
    processes: ManagedProcess | ProcessSet | Iterable[ManagedProcess] | None,
) -> list[ManagedProcess]:
    if processes is None:
        return []
    if isinstance(processes, ManagedProcess):
        return [processes]
    if isinstance(processes, ProcessSet):
        return list(processes.started)
    return list(processes)


def _check(predicate: Callable[[], T]) -> tuple[T | None, Exception | None]:
    try:
        return predicate(), None
    except AssertionError:  # a check inside the predicate failed: that fails the wait (see wait_until)
        raise
    except Exception as exc:  # e.g. connection refused while a server starts
        return None, exc


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    processes: ManagedProcess | ProcessSet | Iterable[ManagedProcess] | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    An exception from ``predicate`` counts as "not yet" (connection refused
    while a server starts), except an ``AssertionError``: an ``assert`` inside
    the predicate checks what every answer must be, so a failing one fails the
    wait at once. A condition not met yet is a falsy return, never an assert.
    After ``timeout`` seconds, raises :class:`WaitTimeout` naming ``what``,
    the last exception, and the stderr tail of each of ``processes``.
    """
    deadline = time.monotonic() + timeout
    while True:
        result, error = _check(predicate)
        if result:
            return result
        if time.monotonic() >= deadline:
            raise WaitTimeout(_timeout_message(what, timeout, error, _involved(processes)))
        time.sleep(POLL_INTERVAL)


async def wait_for(
    predicate: Callable[[], T | Awaitable[T]],
    what: str,
    processes: ManagedProcess | ProcessSet | Iterable[ManagedProcess] | None = None,
) -> T:
    """Poll ``predicate`` (a plain or async function) until it returns something truthy, and return that.

    Called inside the caller's ``trio.fail_after``: an exception from
    ``predicate`` counts as "not yet" except an ``AssertionError``, which
    fails the wait at once (as in :func:`wait_until`), and just before the caller's deadline
    it raises :class:`WaitTimeout` naming ``what``, the last exception, and
    the stderr tail of each of ``processes``. With no deadline it waits
    until pytest-timeout ends the test.
    """
    started = trio.current_time()
    error: Exception | None = None
    # end one poll early, so that this scope (not the caller's) sees the deadline and can say what failed
    with trio.move_on_at(trio.current_effective_deadline() - POLL_INTERVAL):
        while True:
            try:
                result, error = predicate(), None
                if isinstance(result, Awaitable):
                    result = await result
            except AssertionError:
                raise
            except Exception as exc:
                result, error = None, exc
            if result:
                return result
            await trio.sleep(POLL_INTERVAL)
    waited = round(trio.current_time() - started + POLL_INTERVAL, 2)
    raise WaitTimeout(_timeout_message(what, waited, error, _involved(processes)))


def run_pytest(
    folder: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run ``pytest tests -q ARGS`` in ``folder`` (an engine distribution) with this interpreter, no cache.

    Called by tests of what an engine distribution's own suite reports. :returns: the finished run, output
    captured as text.
    """
    argv = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def taken_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A TCP port on ``host`` that a listening socket holds until the block ends.

    Used by tests of a process told to listen where it cannot. :returns: (yields) the port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((host, 0))
        taken.listen()
        yield taken.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (any 127.0.0.x works on Linux).

    Drawn below the kernel's range for outgoing connections (``ip_local_port_range``, from 32768 by
    default), so that no client socket takes it between now and the moment a server listens on it (a
    standby started seconds after the check found its port+1 taken by a connection's local port).
    """
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 9000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded machine: any free one
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (32768 when it cannot be read)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > 23000 else 32768
