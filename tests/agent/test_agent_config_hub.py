"""The agent's Hub settings: --hub-endpoint (default $HF_ENDPOINT, else the public Hub), --hub-token-file."""

from __future__ import annotations

import pytest

from llmgw.agent.config import AgentConfigError, load_agent_config
from tests.agent.test_agent_config import FLAGS


def test_defaults_to_hf_endpoint_else_the_public_hub(monkeypatch):
    """No flag: $HF_ENDPOINT when set (a mirror), else https://huggingface.co; no token file."""
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    config = load_agent_config(FLAGS)
    assert (config.hub_endpoint, config.hub_token_file) == ("https://huggingface.co", None)
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.internal:8080/")
    assert load_agent_config(FLAGS).hub_endpoint == "http://mirror.internal:8080"


def test_flag_and_file(tmp_path, monkeypatch):
    """agent.toml sets both (the token file relative to it); the flag overrides the endpoint."""
    monkeypatch.setenv("HF_ENDPOINT", "http://ignored")
    (tmp_path / "hf-token").write_text("secret\n")
    path = tmp_path / "agent.toml"
    path.write_text('hub_endpoint = "https://hub.example"\nhub_token_file = "hf-token"\n')
    config = load_agent_config(FLAGS, path)
    assert (config.hub_endpoint, config.hub_token_file) == ("https://hub.example", tmp_path / "hf-token")
    config = load_agent_config({**FLAGS, "hub_endpoint": "http://127.0.0.5:9000"}, path)
    assert config.hub_endpoint == "http://127.0.0.5:9000"
    assert "secret" not in repr(config), "the config holds the token's path, never the token"


@pytest.mark.parametrize("endpoint", ["huggingface.co", "ftp://hub", "https://", "https://hub/?x=1"])
def test_a_bad_endpoint_names_the_flag(endpoint):
    """Not an http(s) URL: refused naming --hub-endpoint and the expected form."""
    with pytest.raises(
        AgentConfigError, match=r"--hub-endpoint: expected http\(s\)://HOST\[:PORT\]\[/PATH\]"
    ):
        load_agent_config({**FLAGS, "hub_endpoint": endpoint})


def test_a_bad_hf_endpoint_names_the_variable(monkeypatch):
    """A bad $HF_ENDPOINT is named as such (it is only the default)."""
    monkeypatch.setenv("HF_ENDPOINT", "nope")
    with pytest.raises(AgentConfigError, match="HF_ENDPOINT"):
        load_agent_config(FLAGS)


def test_a_missing_token_file_names_the_flag(tmp_path):
    """--hub-token-file must be a readable file; the error says what it should hold."""
    with pytest.raises(AgentConfigError, match="--hub-token-file .*gone: expected a readable file holding"):
        load_agent_config({**FLAGS, "hub_token_file": str(tmp_path / "gone")})
