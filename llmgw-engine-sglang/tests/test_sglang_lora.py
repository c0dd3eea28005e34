"""SGLang's LoRA adapters: flags from spec.lora, the load/unload calls, request fields, engine-check."""

from __future__ import annotations

import re

import attrs
import pytest
from llmgw_engine_sglang import SglangEngine

from llmgw.enginecheck import check_engine
from llmgw.models import LaunchSpec, LoraSpec

VERSIONS = SglangEngine.checked_versions
LORA_FLAGS = (
    "--enable-lora",
    "--max-lora-rank",
    "--lora-target-modules",
    "--max-loras-per-batch",
    "--max-loaded-loras",
)

SPEC = LaunchSpec(
    model_source="/models/llama-3.1-8b",
    served_name="llama-8b",
    host="10.0.0.5",
    port=30000,
    gpus=(0, 1),
    lora=LoraSpec(max_loaded=8, max_rank=64),
)


def value(argv, flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture(params=VERSIONS)
def real_help(engine_help_dir, request) -> str:
    return (engine_help_dir / f"sglang-{request.param}-launch_server.txt").read_text()


class TestLoraCommand:
    """What a replica of a model with adapters is started with, as SGLang's dynamic-loading guide has it."""

    def test_flags(self):
        """Rank and target modules fixed at start; N adapters plus the base model per batch and loaded."""
        argv = SglangEngine().build_command(SPEC).argv
        assert "--enable-lora" in argv
        assert value(argv, "--max-lora-rank") == "64"
        assert value(argv, "--lora-target-modules") == "all"
        assert value(argv, "--max-loras-per-batch") == "9"
        assert value(argv, "--max-loaded-loras") == "9"
        assert "--lora-paths" not in argv, "adapters are loaded at run time, not at start"

    def test_no_adapters_no_lora(self):
        """A model without adapters starts without any LoRA flag."""
        argv = SglangEngine().build_command(attrs.evolve(SPEC, lora=None)).argv
        assert not [arg for arg in argv if "lora" in arg]

    def test_every_rank_gets_the_flags(self):
        """Every node of a multi-node replica runs the same LoRA configuration."""
        spec = attrs.evolve(SPEC, nnodes=2, dist_init_addr="10.0.0.5:20000")
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
