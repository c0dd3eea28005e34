"""The SGLang plugin: commands from launch specs (LoRA too), help parsing, engine-check on real help texts."""

from __future__ import annotations

import re

import attrs
import pytest
from llmgw_engine_sglang import SglangEngine

from llmgw.engine import help_and_version_of
from llmgw.enginecheck import check_engine, option_flags
from llmgw.models import LoraSpec
from llmgw.testing.contract import EngineContract, flag_value
from llmgw.testing.engine_checks import (
    real_help_fixture,
    shard_rendezvous,
    shard_serving,
    shard_spec,
    version_fixture,
)


class TestSglangContract(EngineContract):
    """The SGLang engine passes the conformance suite against each checked version's real help."""

    distribution = "llmgw-engine-sglang"
    engine_class = SglangEngine
    help_files = {"python": "sglang-{version}-launch_server.txt"}


version = version_fixture(SglangEngine)
#: ``python -m sglang.launch_server --help`` of one checked version
real_help = real_help_fixture(TestSglangContract, "python")
#: rank 0 of a two-node replica on 8 GPUs a node, with a profile arg
SPEC = shard_spec(
    {"python": "/opt/sglang/bin/python"}, gpus=tuple(range(8)), extra_args=("--context-length", "32768")
)


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
            *shard_serving("--model-path"),
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
            *shard_rendezvous(rank=0),
            "--context-length",
            "32768",
        )

    def test_worker_differs_by_rank_and_address(self):
        """A worker runs the same command with its own --node-rank, host and port (its health endpoint)."""
        engine = SglangEngine()
        rank0 = engine.build_command(SPEC).argv
        worker = engine.build_command(attrs.evolve(SPEC, rank=1, host="10.0.0.6", port=30007)).argv
        differing = {
            flag
            for flag in ("--node-rank", "--host", "--port")
            if flag_value(rank0, flag) != flag_value(worker, flag)
        }
        assert differing == {"--node-rank", "--host", "--port"}
        assert [a for a in rank0 if a not in ("0", "10.0.0.5", "20001")] == [
            a for a in worker if a not in ("1", "10.0.0.6", "30007")
        ]

    def test_every_rank_gets_the_same_dist_init_address(self):
        """All ranks join rank 0's dist-init address, with the same --nnodes and --tp-size."""
        engine = SglangEngine()
        ranks = [engine.build_command(attrs.evolve(SPEC, nnodes=3, rank=r)).argv for r in range(3)]
        assert {flag_value(argv, "--dist-init-addr") for argv in ranks} == {"10.0.0.5:20002"}
        sizes = {(flag_value(argv, "--nnodes"), flag_value(argv, "--tp-size")) for argv in ranks}
        assert sizes == {("3", "24")}
        assert [flag_value(argv, "--node-rank") for argv in ranks] == ["0", "1", "2"]

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


#: the flags every rank of a replica with adapters gets
LORA_FLAGS = (
    "--enable-lora",
    "--max-lora-rank",
    "--lora-target-modules",
    "--max-loras-per-batch",
    "--max-loaded-loras",
)
#: a one-node replica of a model with adapters
LORA_SPEC = attrs.evolve(
    SPEC, nnodes=1, dist_init_addr=None, adapters=(), extra_args=(), lora=LoraSpec(max_loaded=8, max_rank=64)
)


class TestLoraCommand:
    """What a replica of a model with adapters is started with, as SGLang's dynamic-loading guide has it."""

    def test_flags(self):
        """Rank and target modules fixed at start; N adapters plus the base model per batch and loaded."""
        argv = SglangEngine().build_command(LORA_SPEC).argv
        assert "--enable-lora" in argv
        assert flag_value(argv, "--max-lora-rank") == "64"
        assert flag_value(argv, "--lora-target-modules") == "all"
        assert flag_value(argv, "--max-loras-per-batch") == "9"
        assert flag_value(argv, "--max-loaded-loras") == "9"
        assert "--lora-paths" not in argv, "adapters are loaded at run time, not at start"


    def test_every_rank_gets_the_flags(self):
        """Every node of a multi-node replica runs the same LoRA configuration."""
        spec = attrs.evolve(LORA_SPEC, nnodes=2, dist_init_addr="10.0.0.5:20002")
        commands = [SglangEngine().build_command(attrs.evolve(spec, rank=rank)).argv for rank in (0, 1)]
        for argv in commands:
            assert [f for f in LORA_FLAGS if f in argv] == list(LORA_FLAGS)


class TestLoraCalls:
    """The calls the agent sends rank 0, and the fields the gateway sets."""

    def test_load_and_unload(self):
        """Loads and unloads are SGLang's /load_lora_adapter and /unload_lora_adapter (no /v1 prefix)."""
        load = SglangEngine().lora_load("sql", "/var/lib/llmgw/adapters/sql")
        assert (load.method, load.path) == ("POST", "/load_lora_adapter")
        assert load.body == {"lora_name": "sql", "lora_path": "/var/lib/llmgw/adapters/sql"}
        unload = SglangEngine().lora_unload("sql")
        assert (unload.path, unload.body) == ("/unload_lora_adapter", {"lora_name": "sql"})

    def test_request_fields(self):
        """A request names the base model and the adapter as lora_path, which every checked version reads."""
        assert SglangEngine().lora_request_fields("sql", "llama-8b", ["sql", "chat"]) == {
            "model": "llama-8b",
            "lora_path": "sql",
        }
        assert SglangEngine().lora_base_request_fields("llama-8b", ["sql"]) == {}


class TestLoraEngineCheck:
    """engine-check knows the LoRA flags from the real help texts."""

    def test_accepted_with_their_feature(self, real_help):
        """Each checked version documents every LoRA flag, each reported under a LoRA feature."""
        report = check_engine(SglangEngine(), {"python": real_help})
        assert report.ok and not report.warnings
        features = {f.flag: f.feature for f in report.flags}
        assert all(features[flag].startswith("LoRA adapters") for flag in LORA_FLAGS)

    def test_a_help_without_max_loaded_loras_says_so(self, real_help):
        """A help without --max-loaded-loras (neither in its usage nor as an option) fails naming the flag."""
        lacking = re.sub(r"\s*\[--max-loaded-loras MAX_LOADED_LORAS\]", "", real_help, count=1)
        lacking = re.sub(
            r"^  --max-loaded-loras MAX_LOADED_LORAS\n", "", lacking, count=1, flags=re.MULTILINE
        )
        report = check_engine(SglangEngine(), {"python": lacking})
        [missing] = report.missing
        assert (missing.flag, missing.feature) == ("--max-loaded-loras", "LoRA adapters (max_adapters)")
        assert not missing.possibly_truncated and not report.warnings
