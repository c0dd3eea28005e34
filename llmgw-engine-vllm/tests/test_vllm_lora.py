"""vLLM's LoRA adapters: flags from spec.lora, the runtime load/unload calls, engine-check on real help."""

from __future__ import annotations

import re

import attrs
import pytest
from llmgw_engine_vllm import LORA_RANKS, VllmEngine, lora_rank

from llmgw.enginecheck import check_engine
from llmgw.models import LaunchSpec, LoraSpec

VERSIONS = VllmEngine.checked_versions

SPEC = LaunchSpec(
    model_source="/models/llama-3.1-8b",
    served_name="llama-8b",
    host="10.0.0.5",
    port=20001,
    gpus=(0, 1),
    lora=LoraSpec(max_loaded=8, max_rank=24),
)


def value(argv, flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture(params=VERSIONS)
def real_help(engine_help_dir, request) -> str:
    return (engine_help_dir / f"vllm-{request.param}-serve.txt").read_text()


class TestLoraCommand:
    """What a replica of a model with adapters is started with."""

    def test_flags_and_environment(self):
        """--enable-lora, --max-loras = max_adapters, --max-lora-rank rounded up, runtime updating on."""
        command = VllmEngine().build_command(SPEC)
        assert "--enable-lora" in command.argv
        assert value(command.argv, "--max-loras") == "8"
        assert value(command.argv, "--max-lora-rank") == "32"
        assert command.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"

    def test_no_adapters_no_lora(self):
        """A model without adapters starts without any LoRA flag or the runtime-updating variable."""
        command = VllmEngine().build_command(attrs.evolve(SPEC, lora=None))
        assert not [arg for arg in command.argv if "lora" in arg]
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in command.env

    def test_every_rank_gets_the_flags(self):
        """Headless workers get the same LoRA flags as rank 0 (one engine configuration)."""
        spec = attrs.evolve(SPEC, nnodes=2, dist_init_addr="10.0.0.5:20002")
        for rank in (0, 1):
            argv = VllmEngine().build_command(attrs.evolve(spec, rank=rank)).argv
            assert value(argv, "--max-loras") == "8" and "--enable-lora" in argv

    def test_profile_args_come_last(self):
        """A profile's args follow the LoRA flags, so an operator's --max-loras wins in argparse."""
        argv = VllmEngine().build_command(attrs.evolve(SPEC, extra_args=("--max-cpu-loras", "16"))).argv
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
