"""The vLLM plugin: commands from launch specs (LoRA too), help parsing, engine-check on real help texts."""

from __future__ import annotations

import re

import attrs
import pytest
from llmgw_engine_vllm import LORA_RANKS, VllmEngine, lora_rank, split_host_port

from llmgw.enginecheck import check_engine
from llmgw.models import LoraSpec
from llmgw.testing.contract import EngineContract, flag_value
from llmgw.testing.engine_checks import real_help_fixture, shard_serving, shard_spec, version_fixture

VERSIONS = VllmEngine.checked_versions


def read_help(engine_help_dir, name: str) -> str:
    """One saved help text, by file name (``vllm-0.34.0-serve.txt``, ``lacking/...``)."""
    return (engine_help_dir / name).read_text()


class TestVllmContract(EngineContract):
    """The vLLM engine passes the conformance suite against each checked version's real help."""

    distribution = "llmgw-engine-vllm"
    engine_class = VllmEngine
    help_files = {"vllm": "vllm-{version}-serve.txt"}


version = version_fixture(VllmEngine)
#: ``vllm serve --help=all`` of one checked version
real_help = real_help_fixture(TestVllmContract, "vllm")
#: rank 0 of a two-node replica on 4 GPUs a node, with a profile arg
SPEC = shard_spec({"vllm": "/opt/vllm/bin/vllm"}, extra_args=("--max-model-len", "32768"))


#: how single-node and rank 0 commands of SPEC begin: serve the model by name, tensor parallel over 4 GPUs
SERVE = ("/opt/vllm/bin/vllm", "serve", *shard_serving(model=None), "--tensor-parallel-size", "4")


class TestCommands:
    """What the agent starts for each shard, as vLLM's multi-node guide (without Ray) has it."""

    def test_single_node(self):
        """One node: serve the model under its name on host:port, tensor parallel over the node's GPUs."""
        spec = attrs.evolve(SPEC, nnodes=1, dist_init_addr=None, adapters=())
        command = VllmEngine().build_command(spec)
        assert command.argv == (
            *SERVE,
            "--max-model-len",
            "32768",
        )
        assert command.env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}

    def test_rank_zero(self):
        """Rank 0 serves the API and leads: pipeline stage per node, --node-rank 0, the master address."""
        argv = VllmEngine().build_command(SPEC).argv
        assert argv == (
            *SERVE,
            "--pipeline-parallel-size",
            "2",
            "--distributed-executor-backend",
            "mp",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "10.0.0.5",
            "--master-port",
            "20002",
            "--max-model-len",
            "32768",
        )

    def test_worker_is_headless(self):
        """A worker runs the same model and parallelism with its rank and --headless, and serves no API."""
        argv = VllmEngine().build_command(attrs.evolve(SPEC, rank=1, host="10.0.0.6")).argv
        assert argv[:3] == ("/opt/vllm/bin/vllm", "serve", "/models/llama-3.1-70b")
        assert "--headless" in argv
        assert flag_value(argv, "--node-rank") == "1"
        assert not {"--host", "--port", "--served-model-name"} & set(argv)
        assert argv[-2:] == ("--max-model-len", "32768"), "profile args reach every rank"

    def test_every_rank_joins_the_same_master(self):
        """Every rank gets rank 0's dist-init address as --master-addr/--master-port, and the same sizes."""
        engine = VllmEngine()
        ranks = [engine.build_command(attrs.evolve(SPEC, nnodes=3, rank=r)).argv for r in range(3)]
        for argv in ranks:
            master = (flag_value(argv, "--master-addr"), flag_value(argv, "--master-port"))
            assert master == ("10.0.0.5", "20002")
            assert flag_value(argv, "--nnodes") == "3"
            assert flag_value(argv, "--pipeline-parallel-size") == "3"
            assert flag_value(argv, "--tensor-parallel-size") == "4"
        assert [flag_value(argv, "--node-rank") for argv in ranks] == ["0", "1", "2"]
        assert ["--headless" in argv for argv in ranks] == [False, True, True]

    def test_ipv6_master_address(self):
        """An IPv6 dist-init address loses its brackets in --master-addr."""
        argv = VllmEngine().build_command(attrs.evolve(SPEC, dist_init_addr="[fd00::5]:20002")).argv
        assert (flag_value(argv, "--master-addr"), flag_value(argv, "--master-port")) == ("fd00::5", "20002")

    @pytest.mark.parametrize("address", ["10.0.0.5", "10.0.0.5:", ":20002", "host:port"])
    def test_bad_dist_init_address(self, address):
        """A dist-init address without HOST:PORT is refused."""
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            split_host_port(address)


class TestHelpParsing:
    """parse_help reads option definition lines of ``vllm serve --help=all`` only."""

    def test_documents_the_multi_node_flags(self, real_help):
        """Long and short spellings of the flags llmgw relies on are found."""
        flags = VllmEngine().parse_help(real_help)
        assert {
            "--nnodes",
            "-n",
            "--node-rank",
            "-r",
            "--master-addr",
            "--master-port",
            "--headless",
            "--tensor-parallel-size",
            "-tp",
            "--pipeline-parallel-size",
            "-pp",
            "--enable-log-requests",
            "--disable-log-requests",
            "-h",
            "--help",
        } <= flags

    def test_json_note_defines_nothing(self, real_help):
        """The example lines of the closing note on JSON arguments are not options."""
        assert "   --json-arg.key1 value1" in real_help
        assert not {f for f in VllmEngine().parse_help(real_help) if f.startswith("--json-arg")}

    def test_newer_release_only_adds_flags(self, engine_help_dir):
        """0.34.0 documents every flag 0.33.0 does (the README says it adds 9, removes none)."""
        old, new = (
            VllmEngine().parse_help(read_help(engine_help_dir, f"vllm-{v}-serve.txt")) for v in VERSIONS
        )
        assert old <= new


class TestEngineCheck:
    """engine-check on real vLLM help, and on real help that must not pass."""

    def test_passes_on_each_checked_version(self, real_help):
        """Every flag of every rank is documented, and the help looks complete."""
        report = check_engine(VllmEngine(), {"vllm": real_help})
        assert report.ok and not report.warnings
        assert {f.flag for f in report.flags} >= {"--nnodes", "--headless", "--master-port"}

    def test_vllm_0_11_0_lacks_multi_node_without_ray(self, engine_help_dir):
        """0.11.0 (before 0.11.1) lacks --nnodes, --node-rank, --master-addr, --master-port: named missing."""
        lacking = read_help(engine_help_dir, "lacking/vllm-0.11.0-serve.txt")
        report = check_engine(VllmEngine(), {"vllm": lacking})
        assert not report.ok
        assert [f.flag for f in report.missing] == [
            "--nnodes",
            "--node-rank",
            "--master-addr",
            "--master-port",
        ]
        assert not report.warnings, "0.11.0's help is complete; its flags are missing for real"
        assert not any(f.possibly_truncated for f in report.missing)
        assert {f.feature for f in report.missing} == {"multi-node rendezvous"}

    def test_plain_help_is_not_the_full_help(self, engine_help_dir):
        """``vllm serve --help`` (a summary naming --help=all) draws a not-the-full-help warning."""
        report = check_engine(
            VllmEngine(), {"vllm": read_help(engine_help_dir, "lacking/vllm-0.34.0-serve-plain-help.txt")}
        )
        assert any("defines no --help option" in w for w in report.warnings)
        assert any("not `vllm serve --help=all`" in w for w in report.warnings)
        assert report.missing and all(f.possibly_truncated for f in report.missing)

    def test_node_rank_renamed_longer(self, real_help):
        """--node-rank renamed --node-rank-offset on its option line is missing, mentions elsewhere or not."""
        renamed = real_help.replace(
            "  --node-rank NODE_RANK, -r NODE_RANK", "  --node-rank-offset NODE_RANK", 1
        )
        assert renamed != real_help
        report = check_engine(VllmEngine(), {"vllm": renamed})
        assert [f.flag for f in report.missing] == ["--node-rank"]
        assert not report.missing[0].possibly_truncated

    @pytest.mark.parametrize("half", ["first", "second"])
    def test_half_a_help_looks_truncated(self, real_help, half):
        """Either half of the help draws a truncation warning; flags missing from it are marked."""
        lines = real_help.splitlines(keepends=True)
        cut = len(lines) // 2
        text = "".join(lines[:cut] if half == "first" else lines[cut:])
        report = check_engine(VllmEngine(), {"vllm": text})
        assert report.warnings
        assert all(f.possibly_truncated for f in report.missing)
        if half == "second":
            assert {"--served-model-name", "--host", "--port"} <= {f.flag for f in report.missing}


class TestContinuation:
    """Which vLLM versions continue a final assistant message (``continue_final_message``)."""

    @pytest.mark.parametrize(
        ("version", "continues"),
        [
            ("0.6.2", False),
            ("0.6.3", True),
            ("0.6.3.post1", True),
            ("0.33.0", True),
            ("0.34.0", True),
            (None, False),
        ],
    )
    def test_from_0_6_3(self, version, continues):
        """vLLM has ``continue_final_message`` from 0.6.3 (vllm-project/vllm#8942); unknown: no."""
        assert VllmEngine().continues_final_message(version, ()) is continues


#: a one-node replica of a model with adapters
LORA_SPEC = attrs.evolve(
    SPEC, nnodes=1, dist_init_addr=None, adapters=(), extra_args=(), lora=LoraSpec(max_loaded=8, max_rank=24)
)


class TestLoraCommand:
    """What a replica of a model with adapters is started with."""

    def test_flags_and_environment(self):
        """--enable-lora, --max-loras = max_adapters, --max-lora-rank rounded up, runtime updating on."""
        command = VllmEngine().build_command(LORA_SPEC)
        assert "--enable-lora" in command.argv
        assert flag_value(command.argv, "--max-loras") == "8"
        assert flag_value(command.argv, "--max-lora-rank") == "32"
        assert command.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


    def test_every_rank_gets_the_flags(self):
        """Headless workers get the same LoRA flags as rank 0 (one engine configuration)."""
        spec = attrs.evolve(LORA_SPEC, nnodes=2, dist_init_addr="10.0.0.5:20002")
        for rank in (0, 1):
            argv = VllmEngine().build_command(attrs.evolve(spec, rank=rank)).argv
            assert flag_value(argv, "--max-loras") == "8" and "--enable-lora" in argv

    def test_profile_args_come_last(self):
        """A profile's args follow the LoRA flags, so an operator's --max-loras wins in argparse."""
        argv = VllmEngine().build_command(attrs.evolve(LORA_SPEC, extra_args=("--max-cpu-loras", "16"))).argv
        assert argv[-2:] == ("--max-cpu-loras", "16")
        assert argv.index("--enable-lora") < argv.index("--max-cpu-loras")

    @pytest.mark.parametrize("rank, flag", [(1, 1), (2, 8), (16, 16), (17, 32), (300, 320), (512, 512)])
    def test_rank_rounded_up_to_a_choice(self, rank, flag):
        """vLLM takes only some ranks: the adapter rank is rounded up to the next one."""
        assert lora_rank(rank) == flag

    def test_rank_above_512(self):
        """A rank vLLM cannot take is an error naming the setting."""
        with pytest.raises(ValueError, match="max_adapter_rank 600"):
            lora_rank(600)

    def test_rank_choices_are_the_helps(self, real_help):
        """The ranks llmgw may pass are exactly the choices --max-lora-rank offers in each checked version."""
        line = re.search(r"^\s+--max-lora-rank \{([\d,]+)\}", real_help, re.MULTILINE)
        assert line, "--max-lora-rank has no choices line"
        assert tuple(int(v) for v in line.group(1).split(",")) == LORA_RANKS


class TestLoraCalls:
    """The calls the agent sends rank 0, and the fields the gateway sets."""

    def test_load(self):
        """A load is POST /v1/load_lora_adapter with the adapter's name and directory."""
        call = VllmEngine().lora_load("sql", "/var/lib/llmgw/adapters/sql")
        assert (call.method, call.path) == ("POST", "/v1/load_lora_adapter")
        assert call.body == {"lora_name": "sql", "lora_path": "/var/lib/llmgw/adapters/sql"}

    def test_unload(self):
        """An unload is POST /v1/unload_lora_adapter with the name."""
        call = VllmEngine().lora_unload("sql")
        assert (call.method, call.path, call.body) == (
            "POST",
            "/v1/unload_lora_adapter",
            {"lora_name": "sql"},
        )

    def test_request_names_the_adapter_as_model(self):
        """A request for an adapter names it as its model; a base-model request needs nothing."""
        assert VllmEngine().lora_request_fields("sql", "llama-8b", ["sql"]) == {"model": "sql"}
        assert VllmEngine().lora_base_request_fields("llama-8b", ["sql"]) == {}


class TestLoraEngineCheck:
    """engine-check knows the LoRA flags from the real help texts."""

    def test_accepted_with_their_feature(self, real_help):
        """Each checked version documents the three LoRA flags, reported under the LoRA feature."""
        report = check_engine(VllmEngine(), {"vllm": real_help})
        assert report.ok
        features = {f.flag: f.feature for f in report.flags}
        assert features["--enable-lora"] == "LoRA adapters"
        assert features["--max-loras"] == "LoRA adapters (max_adapters)"
        assert features["--max-lora-rank"] == "LoRA adapters (max_adapter_rank)"

    def test_a_help_without_max_loras_says_so(self, real_help):
        """A help whose --max-loras option line is gone fails, naming the flag and what it serves."""
        lacking = re.sub(r"^  --max-loras MAX_LORAS\n", "", real_help, count=1, flags=re.MULTILINE)
        assert lacking != real_help
        report = check_engine(VllmEngine(), {"vllm": lacking})
        [missing] = report.missing
        assert missing.flag == "--max-loras" and missing.feature == "LoRA adapters (max_adapters)"
        assert "missing --max-loras (vllm, LoRA adapters (max_adapters))" == missing.describe()

    def test_vllm_0_11_0_has_the_lora_flags(self, engine_help_dir):
        """0.11.0 lacks multi-node flags but has every LoRA flag (its --max-lora-rank takes any integer)."""
        report = check_engine(
            VllmEngine(), {"vllm": (engine_help_dir / "lacking/vllm-0.11.0-serve.txt").read_text()}
        )
        assert not {f.flag for f in report.missing} & {"--enable-lora", "--max-loras", "--max-lora-rank"}
