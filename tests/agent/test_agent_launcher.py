"""The launcher under every engine and sidecar: it ends its whole process group and exits like its command."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgw.agent.launcher import LAUNCHER_PREFIX, attach_address
from llmgw.testing.agent import kill_group
from llmgw.testing.processes import group_alive, pid_alive, wait_until


class Launched:
    """A launcher started as the agent starts it: new session, control pipe on stdin, status on stdout."""

    def __init__(self, argv: list[str], log: Path, grace: float = 1.0, **more: object) -> None:
        control_r, self.control_w = os.pipe()
        status_r, status_w = os.pipe()
        with open(log, "ab") as log_file:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "llmgw.agent.launcher", "--name", "test"],
                stdin=control_r,
                stdout=status_w,
                stderr=log_file,
                start_new_session=True,
            )
        os.close(control_r)
        os.close(status_w)
        spec = {"argv": argv, "env": dict(os.environ), "grace": grace, **more}
        os.write(self.control_w, (json.dumps(spec) + "\n").encode())
        with os.fdopen(status_r, "rb") as status:
            self.status = json.loads(status.readline())
        self.pgid = self.popen.pid

    def close_pipe(self) -> None:
        """What the kernel does when the agent dies."""
        if self.control_w is not None:
            os.close(self.control_w)
            self.control_w = None

    def wait(self, timeout: float = 10) -> int:
        return self.popen.wait(timeout)


@pytest.fixture
def launch(tmp_path):
    """Start launchers; every group is killed (and pipe closed) when the test ends."""
    started: list[Launched] = []

    def start(argv: list[str], grace: float = 1.0, **more: object) -> Launched:
        launched = Launched(argv, tmp_path / "log", grace, **more)
        started.append(launched)
        return launched

    yield start
    for launched in started:
        kill_group(launched.pgid)
        launched.close_pipe()
        launched.popen.wait()


def _pids_of(log: Path, count: int) -> list[int]:
    return wait_until(
        lambda: (
            (lines := [ln for ln in log.read_text().split() if ln.isdigit()])
            and len(lines) >= count
            and [int(p) for p in lines]
        ),
        5,
        f"{count} pids in the log",
    )


TREE = "sleep 60 & echo $!; sleep 60 & echo $!; wait"


def test_closed_pipe_ends_the_whole_group(launch, tmp_path):
    """When the agent's end of the pipe closes (the agent died), the command and its children all end."""
    launched = launch(["sh", "-c", TREE])
    children = _pids_of(tmp_path / "log", 2)
    assert group_alive(launched.pgid)
    launched.close_pipe()
    assert launched.wait() == -signal.SIGTERM  # sh ended by the SIGTERM, mirrored
    assert not group_alive(launched.pgid)
    assert not any(pid_alive(pid) for pid in children)
    assert f"{LAUNCHER_PREFIX} test: the agent went away" in (tmp_path / "log").read_text()


def test_exit_code_is_mirrored_and_leftovers_ended(launch, tmp_path):
    """The launcher exits with its command's code, after ending what the command left behind."""
    launched = launch(["sh", "-c", "sleep 60 & echo $!; exit 7"])
    assert launched.wait() == 7
    assert not group_alive(launched.pgid)


def test_sigterm_ignored_leads_to_sigkill_after_grace(launch, tmp_path):
    """A command that ignores SIGTERM to its group is SIGKILLed after the grace; the exit says so."""
    launched = launch(["sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.05; done"], grace=0.5)
    wait_until(lambda: "ready" in (tmp_path / "log").read_text(), 5, "the command to start")
    start = time.monotonic()
    os.killpg(launched.pgid, signal.SIGTERM)
    assert launched.wait() == -signal.SIGKILL
    assert time.monotonic() - start >= 0.5
    assert not group_alive(launched.pgid)
    assert "SIGKILL to the process group" in (tmp_path / "log").read_text()


def test_command_that_cannot_start(launch, tmp_path):
    """A program that does not exist: the launcher says why on its status pipe and exits 127."""
    launched = launch([str(tmp_path / "missing")])
    assert "No such file or directory" in launched.status["error"]
    assert launched.wait() == 127


def _attach(name: str) -> tuple[socket.socket, dict]:
    """Connect to a launcher's attach socket as a later agent does; the connection and its answer."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5)
    conn.connect(attach_address(name))
    return conn, json.loads(conn.makefile("rb").readline())


def test_orphan_is_kept_for_its_grace_can_be_adopted_and_ends_past_it(launch, tmp_path):
    """With an orphan grace, the agent's pipe closing ends nothing: a later agent attaches (one at a time)
    and gets the command's pid, and the command's exit code at its end; detached again, the group ends once
    the grace is over."""
    name = f"llmgw-test-{secrets.token_hex(6)}"
    launched = launch(["sh", "-c", TREE], orphan_grace=1.5, socket=name)
    children = _pids_of(tmp_path / "log", 2)
    launched.close_pipe()
    conn, hello = _attach(name)
    assert hello == {"pid": launched.status["pid"]} and group_alive(launched.pgid)
    refused, answer = _attach(name)
    assert answer == {"error": "another agent is attached"}
    refused.close()
    wait_until(lambda: "adopted by the agent with pid" in (tmp_path / "log").read_text(), 5, "the adoption")
    conn.close()  # this agent goes too: 1.5 s later the launcher ends the group
    started = time.monotonic()
    assert launched.wait() == -signal.SIGTERM
    assert time.monotonic() - started >= 1.0
    assert not any(pid_alive(pid) for pid in children)
    assert "no agent adopted the command within 1.5 s" in (tmp_path / "log").read_text()


def test_adopting_agent_is_told_the_exit_code(launch, tmp_path):
    """A command that ends while a later agent is attached: that agent reads its exit code."""
    name = f"llmgw-test-{secrets.token_hex(6)}"
    marker = tmp_path / "go"
    launched = launch(
        ["sh", "-c", f"while [ ! -e {marker} ]; do sleep 0.05; done; exit 5"], orphan_grace=60, socket=name
    )
    launched.close_pipe()
    conn, hello = _attach(name)
    assert hello == {"pid": launched.status["pid"]}
    marker.touch()
    reader = conn.makefile("rb")
    assert json.loads(reader.readline()) == {"exit": 5}
    assert launched.wait() == 5
