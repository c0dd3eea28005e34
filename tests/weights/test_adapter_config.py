"""A LoRA adapter's folder: its rank read from PEFT's adapter_config.json, and why it would not load."""

from __future__ import annotations

import json

import pytest

from llmgw.weights import adapter_problem, adapter_rank


def adapter(tmp_path, config: object | None, raw: bytes | None = None):
    """A folder with ``config`` as its adapter_config.json (None: no such file)."""
    if raw is not None:
        (tmp_path / "adapter_config.json").write_bytes(raw)
    elif config is not None:
        (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    return tmp_path


class TestAdapterRank:
    """The rank is PEFT's ``r``, or the largest of its ``rank_pattern``."""

    def test_r_and_rank_pattern(self, tmp_path):
        """``r`` alone, then a larger per-module rank wins."""
        assert adapter_rank(adapter(tmp_path, {"r": 16, "lora_alpha": 32})) == 16
        assert adapter_rank(adapter(tmp_path, {"r": 8, "rank_pattern": {"q_proj": 32, "v_proj": 4}})) == 32


class TestAdapterProblem:
    """The reason a load would fail, naming the folder or the setting to change."""

    def test_a_rank_within_the_profile_is_fine(self, tmp_path):
        """Rank 16 on an engine started for 16: nothing keeps it from loading."""
        assert adapter_problem(adapter(tmp_path, {"r": 16}), 16) is None

    def test_a_rank_above_the_profile_names_the_setting(self, tmp_path):
        """Rank 64 on an engine started for 16: the reason names max_adapter_rank."""
        problem = adapter_problem(adapter(tmp_path, {"r": 64}), 16)
        assert problem is not None
        assert problem.startswith("its LoRA rank is 64, above the profile's max_adapter_rank 16")

    @pytest.mark.parametrize(
        "config, raw, expected",
        [
            (None, None, "no adapter_config.json in"),
            (None, b"{not json", "not JSON"),
            ({"lora_alpha": 16}, None, "expected a positive integer 'r' (the LoRA rank), got None"),
            ({"r": "16"}, None, "expected a positive integer 'r' (the LoRA rank), got '16'"),
            ([16], None, "expected a positive integer 'r'"),
        ],
    )
    def test_a_folder_that_is_no_adapter(self, tmp_path, config, raw, expected):
        """No config, a broken one, or one without a rank: said, with the file's path."""
        problem = adapter_problem(adapter(tmp_path, config, raw), 16)
        assert problem is not None and expected in problem, problem
