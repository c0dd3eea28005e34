"""How `ctl replicas --wide` and `ctl describe replica` show what a shard runs."""

from __future__ import annotations

from llmgw.ctl.replicas import command_line, describe_lines
from llmgw.wire import ReplicaStatus, ShardStatus

SHARD = ShardStatus(
    rank=0,
    node="node-1",
    gpus=(0, 1),
    port=20001,
    state="ready",
    pid=4242,
    argv=("llmgw-sim", "--model", "/models/a b", "--port", "20001"),
    env={"NCCL_IB_HCA": "mlx5_0,mlx5_1", "CUDA_VISIBLE_DEVICES": "0,1"},
    log_path="/var/lib/llmgw/logs/a-0-7-r0.log",
    engine_version="0.2.0",
)


def test_command_line_is_a_shell_line():
    """The variables llmgw set come first, sorted, then the argv, quoted as a shell would need."""
    assert command_line(SHARD) == (
        "CUDA_VISIBLE_DEVICES=0,1 NCCL_IB_HCA=mlx5_0,mlx5_1 llmgw-sim --model '/models/a b' --port 20001"
    )


def test_command_line_before_the_agent_reported():
    """A shard whose agent has not reported yet shows `-`."""
    assert command_line(ShardStatus(rank=0, node="n", gpus=(), port=1, state="pending")) == "-"


def test_describe_shows_each_shard():
    """describe names the node, GPUs, engine version, log, each variable and the argv of every shard."""
    replica = ReplicaStatus("a-0", "a", "ready", 7, 0, None, "ib-a", None, (SHARD,))
    assert describe_lines(replica) == [
        "replica   a-0",
        "model     a",
        "state     ready (attempt 7, 0 failures)",
        "fabric    ib-a",
        "shard r0 on node-1, port 20001, GPUs 0,1: ready, pid 4242",
        "  engine   0.2.0",
        "  log      /var/lib/llmgw/logs/a-0-7-r0.log",
        "  env      CUDA_VISIBLE_DEVICES=0,1",
        "           NCCL_IB_HCA=mlx5_0,mlx5_1",
        "  argv     llmgw-sim --model '/models/a b' --port 20001",
    ]


def test_replicas_marks_outdated_ones_and_shows_rollouts_not_done(monkeypatch):
    """`ctl replicas` says which replicas run an old command, and each rollout not done, with why."""
    from click.testing import CliRunner

    from llmgw.ctl import replicas as module
    from llmgw.wire import ReplicaList, RolloutStatus

    data = ReplicaList(
        replicas=(ReplicaStatus("a-0", "a", "ready", 7, 0, None, None, None, (SHARD,), outdated=True),),
        rollouts=(
            RolloutStatus("a", "waiting", 2, 1, 0, 1, reason="no room to place a replacement: ..."),
            RolloutStatus("b", "done", 2, 1, 1, 0),
        ),
    )

    class Client:
        def request(self, *args, **kwargs):
            return data

    monkeypatch.setattr(module.AdminClient, "for_command", staticmethod(lambda ctx: Client()))
    output = CliRunner().invoke(module.replicas, []).output
    assert "ready (outdated)" in output
    assert "rollout a: waiting (0/1 updated, 1 outdated): no room to place a replacement: ..." in output
    assert "rollout b" not in output
