"""Agents and servers of different llmgw versions still read each other's sync documents."""

from __future__ import annotations

from llmgw.models import LaunchSpec
from llmgw.wire import DesiredShard, ObservedShard, ShardStatus, from_json, to_json

SPEC = LaunchSpec(model_source="/m", served_name="m", host="127.0.0.1", port=9000)


def test_a_desired_shard_from_an_older_server_gets_the_defaults():
    """No stop_grace (the agent's own applies) and not held: what an older server means."""
    data = to_json(DesiredShard("m-0", 1, 0, "m", "sim", SPEC))
    del data["stop_grace"], data["stop_after_rank0"]
    shard = from_json(data, DesiredShard)
    assert shard.stop_grace is None and shard.stop_after_rank0 is False


def test_an_older_agent_reads_a_newer_desired_shard():
    """Fields an older agent does not know are ignored, not refused."""
    data = {**to_json(DesiredShard("m-0", 1, 0, "m", "sim", SPEC, stop_after_rank0=True)), "future": 1}
    assert from_json(data, DesiredShard).key == "m-0/1/r0"


def test_an_observed_shard_from_an_older_agent_has_no_command():
    """An older agent reports no argv, env, log or version: they read as empty."""
    shard = from_json({"replica_id": "m-0", "attempt": 1, "rank": 0, "state": "running"}, ObservedShard)
    assert (shard.argv, shard.env, shard.log_path, shard.engine_version) == ((), {}, None, None)


def test_the_command_round_trips():
    """argv and env travel as a list and a mapping, and come back equal."""
    shard = ObservedShard("m-0", 1, 0, "running", argv=["llmgw-sim", "--port", "9000"], env={"A": "1"})
    assert to_json(shard)["argv"] == ["llmgw-sim", "--port", "9000"]
    assert from_json(to_json(shard), ObservedShard) == shard
    status = ShardStatus(0, "node-1", (0,), 9000, "running", argv=shard.argv, env=shard.env)
    assert from_json(to_json(status), ShardStatus) == status
