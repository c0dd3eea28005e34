"""One agent per state directory: a second one is refused at once, naming the first's pid."""

from __future__ import annotations

import os

import pytest

from llmgw.agent.records import AgentLockError, hold_agent_lock


def test_a_second_agent_on_one_state_directory_is_refused_naming_the_first(tmp_path):
    """The lock is held while the block runs: a second holder is refused with the first's pid and the fix."""
    runtime = tmp_path / "state" / "run"
    with hold_agent_lock(runtime):
        with pytest.raises(AgentLockError) as refused, hold_agent_lock(runtime):
            pass
        message = str(refused.value)
        assert f"(pid {os.getpid()}) is running with state directory {tmp_path / 'state'};" in message
        assert "give this one its own --state-dir" in message
    with hold_agent_lock(runtime):  # released on leaving the block
        pass
