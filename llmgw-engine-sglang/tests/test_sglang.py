"""The SGLang plugin: commands from launch specs, help parsing, engine-check on real help texts."""

from __future__ import annotations

import attrs
import pytest
from llmgw_engine_sglang import SglangEngine

from llmgw.engine import help_and_version_of
from llmgw.enginecheck import check_engine, option_flags
from llmgw.models import LaunchSpec
from llmgw.testing.contract import EngineContract

VERSIONS = SglangEngine.checked_versions


@pytest.fixture(params=VERSIONS)
def version(request) -> str:
    return request.param


@pytest.fixture
def real_help(engine_help_dir, version) -> str:
    """``python -m sglang.launch_server --help`` of one checked version."""
    return (engine_help_dir / f"sglang-{version}-launch_server.txt").read_text()


class TestSglangContract(EngineContract):
    """The SGLang engine passes the conformance suite against each checked version's real help."""

    distribution = "llmgw-engine-sglang"
    engine_class = SglangEngine
    help_files = {"python": "sglang-{version}-launch_server.txt"}


SPEC = LaunchSpec(
    model_source="/models/llama-3.1-405b",
    served_name="llama-405b",
    host="10.0.0.5",
    port=30000,
    gpus=(0, 1, 2, 3, 4, 5, 6, 7),
    rank=0,
    nnodes=2,
    dist_init_addr="10.0.0.5:20000",
    adapters=("mlx5_1", "mlx5_10"),
    extra_args=("--context-length", "32768"),
    executables={"python": "/opt/sglang/bin/python"},
)


def value(argv, flag: str) -> str:
    return argv[argv.index(flag) + 1]


class TestCommands:
    """What the agent starts for each shard, as SGLang's multi-node guide has it."""

    def test_single_node(self):
        """One node: the model, its served name, host:port and tensor parallelism over the node's GPUs."""
        spec = attrs.evolve(SPEC, nnodes=1, dist_init_addr=None, adapters=(), gpus=(0, 1))
        command = SglangEngine().build_command(spec)
        assert command.argv == (
            "/opt/sglang/bin/python",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "/models/llama-3.1-405b",
            "--served-model-name",
            "llama-405b",
            "--host",
            "10.0.0.5",
            "--port",
            "30000",
            "--enable-metrics",
            "--tp-size",
            "2",
            "--context-length",
            "32768",
        )
        assert command.env == {"CUDA_VISIBLE_DEVICES": "0,1"}

    def test_rank_zero(self):
        """Rank 0: --tp-size counts every node's GPUs; --nnodes, --node-rank 0 and the dist-init address."""
        argv = SglangEngine().build_command(SPEC).argv
        assert argv[argv.index("--tp-size") :] == (
            "--tp-size",
            "16",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--dist-init-addr",
            "10.0.0.5:20000",
            "--context-length",
            "32768",
        )

    def test_worker_differs_by_rank_and_address(self):
        """A worker runs the same command with its own --node-rank, host and port (its health endpoint)."""
        engine = SglangEngine()
        rank0 = engine.build_command(SPEC).argv
        worker = engine.build_command(attrs.evolve(SPEC, rank=1, host="10.0.0.6", port=30007)).argv
        differing = {
            flag for flag in ("--node-rank", "--host", "--port") if value(rank0, flag) != value(worker, flag)
        }
        assert differing == {"--node-rank", "--host", "--port"}
        assert [a for a in rank0 if a not in ("0", "10.0.0.5", "30000")] == [
            a for a in worker if a not in ("1", "10.0.0.6", "30007")
        ]

    def test_every_rank_gets_the_same_dist_init_address(self):
        """All ranks join rank 0's dist-init address, with the same --nnodes and --tp-size."""
        engine = SglangEngine()
        ranks = [engine.build_command(attrs.evolve(SPEC, nnodes=3, rank=r)).argv for r in range(3)]
        assert {value(argv, "--dist-init-addr") for argv in ranks} == {"10.0.0.5:20000"}
        assert {(value(argv, "--nnodes"), value(argv, "--tp-size")) for argv in ranks} == {("3", "24")}
        assert [value(argv, "--node-rank") for argv in ranks] == ["0", "1", "2"]

    def test_gpus_and_exact_adapter_names(self):
        """GPUs reach CUDA_VISIBLE_DEVICES; the fabric's adapters reach NCCL_IB_HCA as exact names."""
        env = SglangEngine().build_command(attrs.evolve(SPEC, rank=1)).env
        assert env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "NCCL_IB_HCA": "=mlx5_1,mlx5_10"}

    def test_option_args_skip_the_interpreter(self):
        """engine-check reads SGLang's flags, not the interpreter's -m."""
        command = SglangEngine().build_command(SPEC)
        assert option_flags(SglangEngine().option_args(command))[0] == "--model-path"
        assert "-m" not in option_flags(SglangEngine().option_args(command))


class TestHelpParsing:
    """parse_help reads option definition lines only."""

    def test_documents_aliases(self, real_help):
        """Both spellings of aliased options are found."""
        flags = SglangEngine().parse_help(real_help)
        assert {
            "--model-path",
            "--model",
            "--tp-size",
            "--tensor-parallel-size",
            "--dist-init-addr",
            "--nccl-init-addr",
            "--nnodes",
            "--node-rank",
            "-h",
            "--help",
        } <= flags
        assert "--tp" not in flags, "SGLang accepts --tp as an abbreviation; its help does not document it"

    def test_usage_synopsis_defines_nothing(self, real_help):
        """A help reduced to its usage synopsis documents no flag."""
        synopsis = real_help[: real_help.index("\n\n")]
        assert "--dist-init-addr" in synopsis
        assert SglangEngine().parse_help(synopsis) == frozenset()


class TestEngineCheck:
    """engine-check on real SGLang help."""

    def test_passes_on_each_checked_version(self, real_help):
        """Every flag of every rank is documented, and the help looks complete."""
        report = check_engine(SglangEngine(), {"python": real_help})
        assert report.ok and not report.warnings

    def test_dist_init_addr_renamed_longer(self, real_help):
        """--dist-init-addr renamed --dist-init-address on its option line is missing (not as truncation)."""
        renamed = real_help.replace(
            "  --dist-init-addr DIST_INIT_ADDR,", "  --dist-init-address DIST_INIT_ADDR,", 1
        )
        assert renamed != real_help
        report = check_engine(SglangEngine(), {"python": renamed})
        assert [(f.flag, f.possibly_truncated) for f in report.missing] == [("--dist-init-addr", False)]

    @pytest.mark.parametrize("half", ["first", "second"])
    def test_half_a_help_looks_truncated(self, real_help, half):
        """Either half draws a truncation warning (the usage names flags it lacks, or --help is gone)."""
        lines = real_help.splitlines(keepends=True)
        cut = len(lines) // 2
        report = check_engine(
            SglangEngine(), {"python": "".join(lines[:cut] if half == "first" else lines[cut:])}
        )
        assert report.warnings
        assert all(f.possibly_truncated for f in report.missing)


def test_version_asks_the_package_not_python():
    """The agent asks the sglang package for its version: python --version would be Python's."""
    argv = help_and_version_of(SglangEngine(), "python").version_args
    assert argv[0] == "-c" and "sglang.__version__" in argv[1]


class TestContinuation:
    """Which SGLang versions continue a final assistant message (``continue_final_message``)."""

    @pytest.mark.parametrize(
        ("version", "continues"),
        [("0.4.3.post4", False), ("0.4.4", True), ("0.5.3", True), ("0.5.23", True), (None, False)],
    )
    def test_from_0_4_4(self, version, continues):
        """SGLang has ``continue_final_message`` from 0.4.4 (sgl-project/sglang#4226)."""
        assert SglangEngine().continues_final_message(version, ()) is continues
