"""The process helpers every test relies on: whole groups end, timeouts say what and why."""

from __future__ import annotations

import sys

import pytest
import trio

from llmgw.testing.processes import WaitTimeout, group_alive, pid_alive, start, wait_for, wait_until

GRANDCHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_kill_group_ends_grandchildren(tmp_path):
    """Killing a process started by the helper also ends the processes it started."""
    process = start([sys.executable, "-c", GRANDCHILD], log_dir=tmp_path)
    try:
        grandchild = int(wait_until(lambda: process.stdout().strip() or None, 10, "the grandchild's pid"))
        assert group_alive(process.pid)
    finally:
        process.kill_group()
    wait_until(lambda: not pid_alive(grandchild), 5, "the grandchild to be gone")
    assert not group_alive(process.pid)


def test_wait_timeout_names_the_condition_and_shows_stderr(tmp_path):
    """A wait that runs out says what it waited for and shows the process's stderr."""
    code = (
        "import sys, time; sys.stderr.write('engine: CUDA out of memory\\n'); sys.stderr.flush(); "
        "time.sleep(60)"
    )
    process = start([sys.executable, "-c", code], log_dir=tmp_path)
    try:
        process.wait_for_stderr("CUDA out of memory", 10)
        with pytest.raises(WaitTimeout) as info:
            wait_until(lambda: False, 0.2, "the engine to be ready", process)
        assert "the engine to be ready" in str(info.value)
        assert "CUDA out of memory" in str(info.value)
    finally:
        process.kill_group()


async def test_wait_for_returns_what_the_condition_gave(autojump_clock):
    """wait_for returns the predicate's first truthy value, an async predicate's included."""
    ready_at = trio.current_time() + 3

    async def ready():
        return "ready" if trio.current_time() >= ready_at else None

    with trio.fail_after(10):
        assert await wait_for(ready, "the engine to be ready") == "ready"
    assert trio.current_time() >= ready_at


async def test_wait_for_fails_at_the_callers_deadline_naming_the_condition(autojump_clock):
    """At the caller's deadline wait_for fails naming what it waited for and the last error."""
    started = trio.current_time()

    def refused():
        raise ConnectionRefusedError("port 8000")

    with pytest.raises(WaitTimeout, match=r"after 5s waiting for the engine to be ready") as info:
        with trio.fail_after(5):
            await wait_for(refused, "the engine to be ready")
    assert "ConnectionRefusedError('port 8000')" in str(info.value)
    assert trio.current_time() - started == pytest.approx(5, abs=0.05)


def _answers(*codes: int):
    """A predicate over a server's successive answers that asserts each is a 200 or a 503."""
    answers = iter(codes)

    def listed() -> bool:
        code = next(answers)
        assert code in (200, 503), f"answered {code}"
        return code == 200

    return listed


def test_a_failing_assert_inside_a_predicate_fails_wait_until_at_once():
    """An assert in the predicate is a check of every answer: its failure ends the wait, not "not yet"."""
    with pytest.raises(AssertionError, match="answered 500") as info:
        wait_until(_answers(503, 500, 200), 10, "the listing")
    assert not isinstance(info.value, WaitTimeout)
    assert wait_until(_answers(503, 503, 200), 10, "the listing") is True


async def test_a_failing_assert_inside_a_predicate_fails_wait_for_at_once(autojump_clock):
    """wait_for as wait_until: a failing assert fails the wait before the deadline; "not yet" still waits."""
    started = trio.current_time()
    with pytest.raises(AssertionError, match="answered 500"):
        with trio.fail_after(10):
            await wait_for(_answers(503, 500, 200), "the listing")
    assert trio.current_time() - started < 1
    with trio.fail_after(10):
        assert await wait_for(_answers(503, 503, 200), "the listing") is True
