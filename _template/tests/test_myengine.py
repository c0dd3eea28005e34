"""The myengine plugin: the conformance suite, its commands, its version."""

from __future__ import annotations

from pathlib import Path

import attrs
from llmgw_engine_myengine import MyEngine

from llmgw.testing.contract import EngineContract
from llmgw.testing.engine_checks import version_fixture

#: real help output, one file per program and checked version
HELP = Path(__file__).parent / "help"

#: the contract reads the help of each checked version
version = version_fixture(MyEngine)


class TestMyEngineContract(EngineContract):
    """The engine passes the conformance suite against each checked version's real help."""

    distribution = "llmgw-engine-myengine"
    engine_class = MyEngine
    help_files = {program: f"{program}-{{version}}.txt" for program in MyEngine.programs}
    help_dir = HELP


class TestCommands:
    """What the agent starts for each shard."""

    def test_rank_zero_and_worker(self):
        """Every rank joins rank 0's dist-init address; only the rank differs."""
        engine = MyEngine()
        spec = engine.widest_spec()
        rank0, worker = (engine.build_command(attrs.evolve(spec, rank=r)).argv for r in (0, 1))
        assert rank0[rank0.index("--dist-init-addr") + 1] == worker[worker.index("--dist-init-addr") + 1]
        assert [a for a in rank0 if a != "0"] == [a for a in worker if a != "1"]
