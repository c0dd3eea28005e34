"""The agent's model-copy settings: models dir, peer port, max uploads, bandwidth limit, seed root."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.agent.config import AgentConfigError, load_agent_config
from tests.agent.test_agent_config import FLAGS


def test_defaults():
    """Without flags: copies in /var/lib/llmgw/models, files served on 7444, 4 at once, unthrottled."""
    config = load_agent_config(FLAGS)
    assert config.models_dir == Path("/var/lib/llmgw/models")
    assert (config.peer_port, config.max_uploads, config.bandwidth_limit) == (7444, 4, 0.0)
    assert config.seed_root == Path("/")


def test_flags_and_file(tmp_path):
    """agent.toml sets them (a relative models_dir is relative to the file); flags override it."""
    path = tmp_path / "agent.toml"
    path.write_text('models_dir = "models"\npeer_port = 7500\nmax_uploads = 2\nbandwidth_limit = 50.0\n')
    config = load_agent_config({**FLAGS, "max_uploads": 8}, path)
    assert config.models_dir == tmp_path / "models"
    assert (config.peer_port, config.max_uploads, config.bandwidth_limit) == (7500, 8, 50.0)


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("peer_port", 70000, "--peer-port: expected a port from 0 to 65535"),
        ("max_uploads", 0, "--max-uploads: expected an integer >= 1"),
        ("bandwidth_limit", -1.0, "--bandwidth-limit: expected MB/s >= 0"),
    ],
)
def test_bad_values_name_the_flag(flag, value, words):
    """A value out of range is refused naming the flag and what was expected."""
    with pytest.raises(AgentConfigError, match=words):
        load_agent_config({**FLAGS, flag: value})
