"""llama.cpp's LoRA adapters: loaded at start with --lora, chosen per request by id; engine-check."""

from __future__ import annotations

import re

import attrs
import pytest
from llmgw_engine_llamacpp import LlamaCppEngine, lora_args

from llmgw.enginecheck import check_engine
from llmgw.models import LaunchSpec, LoraSpec

VERSIONS = LlamaCppEngine.checked_versions
AT_START = (("sql", "/adapters/sql.gguf"), ("chat", "/adapters/chat.gguf"), ("poem", "/adapters/poem.gguf"))

SPEC = LaunchSpec(
    model_source="/models/llama-3.1-8b.Q4_K_M.gguf",
    served_name="llama-8b",
    host="10.0.0.5",
    port=20001,
    gpus=(0,),
    lora=LoraSpec(max_loaded=3, at_start=AT_START),
)


def help_files(engine_help_dir, version: str) -> dict[str, str]:
    return {
        "llama-server": (engine_help_dir / f"llamacpp-{version}-llama-server.txt").read_text(),
        "rpc-server": (engine_help_dir / f"llamacpp-{version}-rpc-server.txt").read_text(),
    }


@pytest.fixture(params=VERSIONS)
def real_helps(engine_help_dir, request) -> dict[str, str]:
    return help_files(engine_help_dir, request.param)


class TestLoraCommand:
    """Every adapter is loaded at start, in id order, applied to no request by default."""

    def test_one_lora_flag_per_adapter_in_order(self):
        """Rank 0 gets --lora FILE per adapter in at_start order, then --lora-init-without-apply."""
        argv = LlamaCppEngine().build_command(SPEC).argv
        files = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--lora"]
        assert files == ["/adapters/sql.gguf", "/adapters/chat.gguf", "/adapters/poem.gguf"]
        assert "--lora-init-without-apply" in argv

    def test_workers_get_no_adapters(self):
        """RPC workers only hold layers: no LoRA flag (rpc-server has none)."""
        spec = attrs.evolve(
            SPEC,
            nnodes=2,
            rank=1,
            dist_init_addr="10.0.0.5:20002",
            peer_addrs=("10.0.0.5:20001", "10.0.0.6:20011"),
            host="10.0.0.6",
        )
        argv = LlamaCppEngine().build_command(spec).argv
        assert not [arg for arg in argv if "lora" in arg]

    def test_no_adapters_no_lora(self):
        """A model without adapters starts without any LoRA flag."""
        argv = LlamaCppEngine().build_command(attrs.evolve(SPEC, lora=None)).argv
        assert not [arg for arg in argv if "lora" in arg]

    def test_adapters_must_be_given_at_start(self):
        """A LoraSpec with nothing at start is an error naming the field: llama-server cannot load later."""
        with pytest.raises(ValueError, match="spec.lora.at_start is empty"):
            LlamaCppEngine().build_command(attrs.evolve(SPEC, lora=LoraSpec(max_loaded=3)))

    def test_comma_in_a_path(self):
        """A path with a comma is refused, naming the adapter: 0c1e570 splits --lora values on commas."""
        with pytest.raises(ValueError, match="LoRA adapter 'sql'.*comma"):
            lora_args(LoraSpec(max_loaded=1, at_start=(("sql", "/adapters/a,b.gguf"),)))


class TestLoraCalls:
    """No call loads or unloads; a request chooses its adapter by id."""

    def test_load_and_unload_need_no_call(self):
        """Every adapter was loaded at start: load and unload are no calls."""
        assert LlamaCppEngine.lora_at_start
        assert LlamaCppEngine().lora_load("sql", "/adapters/sql.gguf") is None
        assert LlamaCppEngine().lora_unload("sql") is None

    def test_request_selects_by_id(self):
        """The chosen adapter at scale 1 by its --lora position, every other at 0."""
        known = [name for name, _ in AT_START]
        assert LlamaCppEngine().lora_request_fields("chat", "llama-8b", known) == {
            "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}, {"id": 2, "scale": 0.0}]
        }

    def test_base_request_zeroes_every_adapter(self):
        """A base-model request lists every adapter at scale 0 (some builds apply them otherwise)."""
        known = [name for name, _ in AT_START]
        assert LlamaCppEngine().lora_base_request_fields("llama-8b", known) == {
            "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}, {"id": 2, "scale": 0.0}]
        }
        assert LlamaCppEngine().lora_base_request_fields("llama-8b", []) == {}

    def test_unknown_adapter(self):
        """An adapter llama-server was not started with is an error naming it."""
        with pytest.raises(ValueError, match="'other' is not one llama-server loaded at start"):
            LlamaCppEngine().lora_request_fields("other", "llama-8b", ["sql"])


class TestLoraEngineCheck:
    """engine-check knows the LoRA flags from the real help texts."""

    def test_accepted_with_their_feature(self, real_helps):
        """Both checked commits document --lora and --lora-init-without-apply on llama-server."""
        report = check_engine(LlamaCppEngine(), real_helps)
        assert report.ok and not report.warnings
        features = {(f.program, f.flag): f.feature for f in report.flags}
        assert features[("llama-server", "--lora")] == "LoRA adapters (loaded at start)"
        assert (
            features[("llama-server", "--lora-init-without-apply")] == "LoRA adapters (applied per request)"
        )

    def test_a_help_without_lora_init_without_apply_says_so(self, real_helps):
        """A llama-server help without --lora-init-without-apply fails, naming the flag and what it serves."""
        server = real_helps["llama-server"]
        lacking = re.sub(r"^--lora-init-without-apply .*\n", "", server, count=1, flags=re.MULTILINE)
        assert lacking != server
        report = check_engine(LlamaCppEngine(), {**real_helps, "llama-server": lacking})
        [missing] = report.missing
        assert (missing.program, missing.flag) == ("llama-server", "--lora-init-without-apply")
        assert missing.feature == "LoRA adapters (applied per request)"
