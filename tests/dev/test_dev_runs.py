"""``llmgw dev``'s runs: stop signals at any moment, a log folder per run, leftovers of a killed run ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from llmgw.agent.launcher import group_members
from llmgw.dev import runs
from llmgw.dev.signals import Stopped, deferred, stop_on_signals, stopping
from llmgw.testing.agent import kill_group
from llmgw.testing.processes import wait_until


def _send(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs between bytecodes of the main thread


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_each_stop_signal_raises_stopped_even_when_sigint_came_ignored(sig):
    """SIGINT, SIGTERM and SIGHUP each raise Stopped; SIGINT too when the process inherited it ignored."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job of a script starts
    try:
        with stop_on_signals(), pytest.raises(Stopped) as stopped:
            _send(sig)
        assert stopped.value.signum == sig
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGTERM) is not None


def test_a_signal_while_a_process_starts_waits_until_it_is_recorded():
    """Within deferred() the signal is held; it is raised at the block's end, after the work is done."""
    done = []
    with stop_on_signals(), pytest.raises(Stopped):
        with deferred():
            _send(signal.SIGTERM)
            done.append("recorded")
    assert done == ["recorded"]


def test_a_signal_during_the_stop_does_not_cut_it(capsys):
    """Within stopping() a second signal is reported, and the stop runs to its end."""
    finished = False
    with stop_on_signals():
        with stopping():
            _send(signal.SIGINT)
            finished = True
    assert finished
    assert "SIGINT: already stopping" in capsys.readouterr().err


def test_each_run_logs_into_a_folder_of_its_own(tmp_path):
    """A new folder per run, `latest` pointing at it, only the last KEEP_RUNS kept, old flat logs gone."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "server.log").write_text("from before folders per run\n")
    made = [runs.new_log_dir(tmp_path) for _ in range(runs.KEEP_RUNS + 2)]
    assert len(set(made)) == len(made)
    kept = sorted(p for p in (tmp_path / "logs").iterdir() if p.is_dir() and not p.is_symlink())
    assert kept == sorted(made[-runs.KEEP_RUNS :])
    assert (tmp_path / "logs" / "latest").resolve() == made[-1]
    assert not (tmp_path / "logs" / "server.log").exists()


def end_groups(*processes: subprocess.Popen) -> None:
    """SIGKILL each process's group (each leads one) and reap it, whatever the test left running."""
    for process in processes:
        kill_group(process.pid)
        process.wait()


def test_an_agent_started_but_never_recorded_is_ended_by_the_next_run(tmp_path):
    """A run killed between starting an agent and recording it: the next run finds it by its state dir."""
    sleeper = "import time; time.sleep(60)"
    argv = ["/opt/venv/bin/llmgw", "agent", "--state-dir", str(tmp_path / "nodes" / "node-1" / "agent")]
    unrecorded = subprocess.Popen(["python3", "-c", sleeper, *argv], start_new_session=True)
    elsewhere = subprocess.Popen(
        ["python3", "-c", sleeper, argv[0], "agent", "--state-dir", "/var/lib/llmgw"], start_new_session=True
    )
    try:
        for child in (unrecorded, elsewhere):  # until exec, /proc shows the forking test's command line
            wait_until(
                lambda c=child: b"--state-dir" in Path(f"/proc/{c.pid}/cmdline").read_bytes(), 10, "exec"
            )
        assert runs.stop_leftovers(tmp_path, grace=5) == [f"agent (pid {unrecorded.pid})"]
        assert unrecorded.wait(5) is not None
        assert elsewhere.poll() is None, "an agent of another state dir was ended"
    finally:
        end_groups(unrecorded, elsewhere)


def test_processes_a_killed_run_left_are_ended_by_the_next(tmp_path):
    """Recorded processes still running are ended, group and all; a pid reused by another program is not."""
    left = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        runs.record_process(tmp_path, "server", left.pid)
        runs.record_process(tmp_path, "agent-node-1", bystander.pid)
        entries = json.loads((tmp_path / "processes.json").read_text())
        entries[1]["start_time"] -= 1  # this pid was reused by another program since the record was made
        (tmp_path / "processes.json").write_text(json.dumps(entries))

        assert runs.stop_leftovers(tmp_path, grace=5) == [f"server (pid {left.pid})"]
        assert left.wait(5) is not None and group_members(left.pid) == []
        assert bystander.poll() is None, "a process the record does not match was ended"
        assert not (tmp_path / "processes.json").exists()
    finally:
        end_groups(left, bystander)
