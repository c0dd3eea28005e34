"""The launcher: the small process every engine and sidecar runs under.

The agent starts ``python -m llmgw.agent.launcher --name NAME`` in a new
session, so the launcher leads its own process group, and talks to it over
two pipes:

- **stdin** (agent → launcher): one JSON line ``{"argv": [...], "env": {...},
  "cwd": ..., "grace": 10.0, "orphan_grace": 300.0, "socket": NAME}``, then
  nothing. The agent keeps the write end open for as long as it is attached.
  End of file means the agent is gone (it exited or was killed, even with
  ``kill -9``: the kernel closes its end).
- **stdout** (launcher → agent): one JSON line, ``{"pid": N}`` once the command
  started, or ``{"error": "..."}`` when it could not be started.
- **the attach socket** (``socket``, a name in Linux's abstract unix socket
  namespace, so no file and no path-length limit): a later agent (the same
  user only) connects to adopt the command. The launcher answers one line,
  ``{"pid": N}`` (or ``{"error": ...}`` when another agent is attached), and
  the connection is then what stdin was: closing it detaches the agent. When
  the command ends, the attached agent gets ``{"exit": CODE}`` before the
  launcher exits.

stderr is the shard's log; the command inherits it as its stdout and stderr.

The command runs in the launcher's process group, so one signal to the group
reaches it and everything it starts. The launcher:

- when its agent goes away, keeps the command running for ``orphan_grace``
  seconds for another agent to attach (an agent upgraded or restarted
  restarts no engine); past it, or at once when ``orphan_grace`` is 0, sends
  SIGTERM to its group, waits ``grace`` seconds, then SIGKILLs whatever of the
  group is left;
- on SIGTERM (the agent signals the whole group: the command got it too),
  waits ``grace`` seconds for the command, then SIGKILLs the rest;
- when the command exits by itself, ends the rest of the group the same way
  (SIGTERM, grace, SIGKILL), so no grandchild outlives it;
- exits as the command did: the same exit code, or killed by the same signal.

It needs no ``PR_SET_PDEATHSIG`` (which fires when the spawning *thread*
exits, and trio spawns from worker threads); it does make itself a child
subreaper, so orphaned grandchildren are reaped here and never escape the
group's bookkeeping. It imports nothing heavy: it starts in a few
milliseconds and holds no locks of the agent's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import time

__all__ = ["main", "LAUNCHER_PREFIX", "group_members", "pid_alive", "attach_address"]

#: every line the launcher itself writes to the log starts with this
LAUNCHER_PREFIX = "[llmgw-launcher]"
_PR_SET_CHILD_SUBREAPER = 36
_POLL = 0.05


def attach_address(name: str) -> str:
    """The address of a launcher's attach socket called ``name`` (in the abstract namespace)."""
    return "\0" + name


def _state_and_group(pid: int) -> tuple[bytes, int] | None:
    """(state letter, process group) of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rpartition(b")")[2].split()
    except OSError:
        return None  # it exited while we looked
    return fields[0], int(fields[2])


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is neither a zombie nor dead."""
    found = _state_and_group(pid)
    return found is not None and found[0] not in (b"Z", b"X")


def group_members(pgid: int, exclude: int | None = None) -> list[int]:
    """Pids of the live (not zombie) processes in process group ``pgid``, except ``exclude``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        found = _state_and_group(int(entry))
        if found is not None and found[1] == pgid and found[0] not in (b"Z", b"X"):
            members.append(int(entry))
    return members


class _Launcher:
    def __init__(self, name: str) -> None:
        self.name = name
        self.pgid = os.getpgrp()
        self.me = os.getpid()
        self.signals: list[int] = []
        self.child: subprocess.Popen | None = None
        #: the command's exit code once reaped (negative: killed by that signal)
        self.code: int | None = None
        self.stopping = False
        #: the agent is attached through stdin (the one that started us)
        self.on_stdin = True
        #: or through this connection to the attach socket (one that adopted us)
        self.conn: socket.socket | None = None
        self.listener: socket.socket | None = None

    def say(self, message: str) -> None:
        with contextlib.suppress(OSError):
            os.write(2, f"{LAUNCHER_PREFIX} {self.name}: {message}\n".encode())

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)

    def others(self) -> list[int]:
        return group_members(self.pgid, exclude=self.me)

    def reap(self) -> None:
        """Reap every exited child: the command (recording its code) and orphans we adopted."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.child is not None and pid == self.child.pid:
                self.code = os.waitstatus_to_exitcode(status)

    def signal_others(self, signum: int) -> None:
        for pid in self.others():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_signal)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

        spec = self.read_spec()
        if spec is None:
            return 0
        if self.signals:
            self.report({"error": "stopped before it started"})
            return 143
        if spec.get("socket"):
            try:
                self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                self.listener.bind(attach_address(spec["socket"]))
                self.listener.listen(4)
            except OSError as exc:
                message = f"cannot make the attach socket {spec['socket']}: {exc.strerror or exc}"
                self.say(message)
                self.report({"error": message})
                return 127
        try:
            self.child = subprocess.Popen(
                spec["argv"],
                stdin=subprocess.DEVNULL,
                stdout=2,
                stderr=2,
                env=spec.get("env"),
                cwd=spec.get("cwd"),
                close_fds=True,
            )
        except OSError as exc:
            message = f"cannot start {spec['argv'][0]}: {exc.strerror or exc}"
            self.say(message)
            self.report({"error": message})
            return 127
        self.report({"pid": self.child.pid})
        grace = float(spec.get("grace", 10.0))
        code = self.supervise(wake_r, grace, float(spec.get("orphan_grace", 0.0)))
        self.end_rest(grace)
        if self.conn is not None:
            self.send(self.conn, {"exit": code})
        return code

    def read_spec(self) -> dict | None:
        data = b""
        while not data.endswith(b"\n"):
            try:
                chunk = os.read(0, 65536)
            except InterruptedError:
                continue
            if not chunk:
                return None  # the agent went away before telling us what to run
            data += chunk
        return json.loads(data)

    def report(self, message: dict) -> None:
        with contextlib.suppress(OSError):
            os.write(1, (json.dumps(message) + "\n").encode())
            os.close(1)

    @staticmethod
    def send(conn: socket.socket, message: dict) -> None:
        with contextlib.suppress(OSError):
            conn.sendall((json.dumps(message) + "\n").encode())

    def accept(self) -> bool:
        """Take a connection to the attach socket; whether an agent attached through it."""
        assert self.listener is not None and self.child is not None
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return False
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer_pid, peer_uid, _ = struct.unpack("3i", creds)
        if peer_uid != os.getuid() or self.on_stdin or self.conn is not None:
            why = "another agent is attached" if peer_uid == os.getuid() else "not the launcher's user"
            self.send(conn, {"error": why})
            conn.close()
            return False
        conn.setblocking(False)
        self.conn = conn
        self.send(conn, {"pid": self.child.pid})
        self.say(f"adopted by the agent with pid {peer_pid}")
        return True

    def agent_left(self) -> bool:
        """Read from the attached agent; whether it went away (end of file)."""
        try:
            if self.on_stdin:
                chunk = os.read(0, 4096)
            else:
                assert self.conn is not None
                chunk = self.conn.recv(4096)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if chunk:
            return False
        if self.conn is not None:
            self.conn.close()
        self.on_stdin, self.conn = False, None
        return True

    def supervise(self, wake_r: int, grace: float, orphan_grace: float) -> int:
        assert self.child is not None
        try:
            exit_fd = os.pidfd_open(self.child.pid)
        except (AttributeError, OSError):
            exit_fd = None
        kill_at: float | None = None
        orphan_until: float | None = None
        while True:
            self.reap()
            if self.code is not None:
                break
            fds: list = [wake_r] + ([exit_fd] if exit_fd is not None else [])
            fds += [0] if self.on_stdin else [self.conn] if self.conn is not None else []
            fds += [self.listener] if self.listener is not None else []
            timeout = _POLL if exit_fd is None else 1.0
            for at in (kill_at, orphan_until):
                if at is not None:
                    timeout = max(0.0, min(timeout, at - time.monotonic()))
            readable, _, _ = select.select(fds, [], [], timeout)
            if wake_r in readable:
                os.read(wake_r, 512)
            if (0 in readable or self.conn in readable) and self.agent_left() and kill_at is None:
                if orphan_grace > 0 and self.listener is not None:
                    self.say(f"the agent went away: keeping the command for up to {orphan_grace:g} s "
                             "for an agent to adopt it")  # fmt: skip
                    orphan_until = time.monotonic() + orphan_grace
                else:
                    self.say(f"the agent went away: SIGTERM to the process group, {grace:g} s grace")
                    kill_at = time.monotonic() + grace
                    self.signal_others(signal.SIGTERM)
            if self.listener in readable and self.accept():
                orphan_until = None
            if orphan_until is not None and time.monotonic() >= orphan_until and kill_at is None:
                self.say(
                    f"no agent adopted the command within {orphan_grace:g} s: "
                    f"SIGTERM to the process group, {grace:g} s grace"
                )
                orphan_until, kill_at = None, time.monotonic() + grace
                self.signal_others(signal.SIGTERM)
            if self.signals and kill_at is None:
                name = signal.Signals(self.signals[0]).name
                kill_at = time.monotonic() + grace
                orphan_until = None
                if self.signals[0] == signal.SIGTERM:
                    # the agent signals the whole group: the command got it too; do not send a second
                    self.say(f"{name}: waiting up to {grace:g} s for the command to exit")
                else:
                    self.say(f"{name}: SIGTERM to the process group, {grace:g} s grace")
                    self.signal_others(signal.SIGTERM)
            self.reap()
            if kill_at is not None and time.monotonic() >= kill_at and self.code is None:
                self.say(f"still running {grace:g} s after SIGTERM: SIGKILL to the process group")
                self.signal_others(signal.SIGKILL)
                kill_at = time.monotonic() + 3600
        if exit_fd is not None:
            os.close(exit_fd)
        if self.listener is not None:
            self.listener.close()  # no agent adopts a command that ended
        self.stopping = kill_at is not None
        return self.code

    def end_rest(self, grace: float) -> None:
        """End every other member of the group: SIGTERM (unless stopping already), grace, SIGKILL."""
        self.reap()
        if not self.others():
            return
        try:
            self._end_rest(grace)
        finally:
            self.reap()

    def _end_rest(self, grace: float) -> None:
        if not self.stopping:
            self.signal_others(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.others() and time.monotonic() < deadline:
            self.reap()
            time.sleep(_POLL)
        left = self.others()
        if left:
            self.say(f"{len(left)} processes of the group outlived the command: SIGKILL")
        give_up = time.monotonic() + 10
        while left and time.monotonic() < give_up:
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            self.reap()
            time.sleep(_POLL)
            left = self.others()


def _exit_like(code: int) -> None:
    """Exit with ``code``; a negative code (killed by a signal) is mirrored by dying of that signal."""
    sys.stdout.flush()
    if code >= 0:
        os._exit(code)
    signum = -code
    # mirroring SIGSEGV or SIGABRT must not dump the launcher's own core
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(OSError, ValueError):
        signal.signal(signum, signal.SIG_DFL)  # fails for SIGKILL, which needs no reset
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    """Run one command as described in the module docstring; never returns."""
    parser = argparse.ArgumentParser(prog="python -m llmgw.agent.launcher")
    parser.add_argument("--name", default="command", help="what the command is, for the log")
    args = parser.parse_args(argv)
    _exit_like(_Launcher(args.name).run())


if __name__ == "__main__":
    main()
