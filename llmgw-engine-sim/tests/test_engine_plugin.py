"""The sim engine's plugin: commands from launch specs, its help, its version."""

from __future__ import annotations

import subprocess

import pytest
from llmgw_engine_sim import SimEngine

from llmgw.dev.cluster import program
from llmgw.testing.contract import EngineContract
from llmgw.testing.engine_checks import shard_rendezvous, shard_serving, shard_spec


def sim_exe() -> str:
    """The installed ``llmgw-sim`` console script."""
    return program("llmgw-sim")


@pytest.fixture(scope="module")
def sim_help() -> str:
    """What the real ``llmgw-sim --help`` prints."""
    result = subprocess.run([sim_exe(), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


class TestSimContract(EngineContract):
    """The sim engine passes the conformance suite against its own real help."""

    distribution = "llmgw-engine-sim"
    engine_class = SimEngine

    @pytest.fixture
    def help_texts(self, sim_help):
        return {"llmgw-sim": sim_help}


#: rank 0 of a two-node replica, with a profile arg
SPEC = shard_spec({"llmgw-sim": "/opt/sim/bin/llmgw-sim"}, extra_args=("--tokens-per-second", "50"))


class TestSimCommands:
    """What the agent will start for each shard."""

    def test_rank_zero_serves_and_binds_dist_init(self):
        """Rank 0 gets the HTTP address and the dist-init address it binds."""
        command = SimEngine().build_command(SPEC)
        assert command.argv == (
            "/opt/sim/bin/llmgw-sim",
            *shard_serving("--model"),
            *shard_rendezvous(rank=0),
            "--tokens-per-second",
            "50",
        )

    def test_worker_serves_nothing(self):
        """A worker joins rank 0 from its own address and is given no HTTP port."""
        import attrs

        command = SimEngine().build_command(attrs.evolve(SPEC, rank=1, host="10.0.0.6"))
        assert "--port" not in command.argv
        assert command.argv[command.argv.index("--host") + 1] == "10.0.0.6"
        assert command.argv[command.argv.index("--node-rank") + 1] == "1"

    def test_single_node_has_no_rendezvous_flags(self):
        """One node: no --nnodes, --node-rank or --dist-init-addr."""
        import attrs

        spec = attrs.evolve(SPEC, nnodes=1, dist_init_addr=None, adapters=())
        command = SimEngine().build_command(spec)
        assert not {"--nnodes", "--node-rank", "--dist-init-addr"} & set(command.argv)
        assert "NCCL_IB_HCA" not in command.env
