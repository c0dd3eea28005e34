"""The agent's configuration: agent.toml, flags over it, and errors that say what to fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw.agent.cli import agent
from llmgw.agent.config import (
    AgentConfigError,
    load_agent_config,
    parse_engine_option,
    parse_port_range,
)
from llmgw.dev.cluster import program
from llmgw.errors import FabricError
from llmgw.testing import make_gpus, write_fake_nvidia_smi

FLAGS = {
    "node": "node-1",
    "server": "https://127.0.0.1:7443",
    "address": "127.0.0.5",
    "cert": "/etc/llmgw/node.pem",
    "key": "/etc/llmgw/node.key",
    "ca": "/etc/llmgw/ca.pem",
    "state_dir": "/var/lib/llmgw-agent",
}


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


class TestLoad:
    """load_agent_config: the file, the flags, and which wins."""

    def test_flags_alone_with_defaults(self):
        """Flags alone make a config; the port range and grace have their defaults."""
        config = load_agent_config(FLAGS)
        assert config.port_range == (20000, 20999)
        assert config.stop_grace == 10.0
        assert config.logs_dir == Path("/var/lib/llmgw-agent/logs")
        assert config.discovery.nvidia_smi == "nvidia-smi"

    def test_file_with_every_key_and_flags_override(self, tmp_path):
        """Every key of agent.toml is read; relative paths are the file's; flags override, engines merge."""
        path = write(
            tmp_path / "agent.toml",
            """
            node = "gpu-17"
            server = "https://llmgw.example.net:7443"
            address = "10.0.0.17"
            cert = "pki/node.pem"
            key = "pki/node.key"
            ca = "pki/ca.pem"
            state_dir = "state"
            nvidia_smi = "/usr/bin/nvidia-smi"
            ib_root = "/sys/class/infiniband"
            fabrics = ["ib-a"]
            port_range = [21000, 21099]
            stop_grace = 3
            sidecar_timeout = 30.5

            [engines.vllm]
            vllm = "/opt/vllm/bin/vllm"

            [engines.sim]
            "llmgw-sim" = "bin/llmgw-sim"

            [health]
            interval = 0.25
            timeout = 1
            failures = 5

            [sync]
            timeout = 20
            backoff_max = 4
            refused_retry = 60
            facts_interval = 120
            """,
        )
        config = load_agent_config(
            {"node": "gpu-18", "fabrics": (), "engines": {"vllm": {"vllm": "/usr/bin/vllm"}}}, path
        )
        assert config.node == "gpu-18"
        assert config.address == "10.0.0.17"
        assert config.cert == tmp_path / "pki" / "node.pem"
        assert config.state_dir == tmp_path / "state"
        assert config.fabrics == ("ib-a",)
        assert config.port_range == (21000, 21099)
        assert config.stop_grace == 3.0 and config.sidecar_timeout == 30.5
        sim = str(tmp_path / "bin/llmgw-sim")
        assert config.engines == {"vllm": {"vllm": "/usr/bin/vllm"}, "sim": {"llmgw-sim": sim}}
        assert (config.health.interval, config.health.failures) == (0.25, 5)
        assert (config.sync.timeout, config.sync.refused_retry) == (20.0, 60.0)
        assert config.sync.facts_interval == 120.0
        assert config.discovery.nvidia_smi == "/usr/bin/nvidia-smi"

    def test_unknown_key_names_the_key_and_file(self, tmp_path):
        """A misspelt key is an error naming it and the file."""
        path = write(tmp_path / "agent.toml", 'node = "n"\nport_rnage = "1-2"\n')
        with pytest.raises(AgentConfigError, match=r"agent.toml: unknown key 'port_rnage'"):
            load_agent_config({}, path)

    def test_unknown_key_in_a_section(self, tmp_path):
        """Keys inside [health] and [sync] are checked too."""
        path = write(tmp_path / "agent.toml", "[sync]\nbackof_max = 3\n")
        with pytest.raises(AgentConfigError, match=r"unknown key 'sync.backof_max'"):
            load_agent_config({}, path)

    def test_wrong_type_names_the_key(self, tmp_path):
        """A value of the wrong type is an error naming its key."""
        path = write(tmp_path / "agent.toml", 'stop_grace = "ten"\n')
        with pytest.raises(AgentConfigError, match=rf"{path}: stop_grace: expected a number >= 0, got 'ten'"):
            load_agent_config(FLAGS, path)

    def test_every_problem_of_the_file_in_one_message(self, tmp_path):
        """A bad engine table, a table that is not one and a count out of range: all named, with the file."""
        path = write(tmp_path / "agent.toml", "sync = 3\n[engines.vllm]\nvllm = 5\n[health]\nfailures = 0\n")
        with pytest.raises(AgentConfigError) as caught:
            load_agent_config(FLAGS, path)
        assert str(caught.value).split("; ") == [
            f"{path}: sync: expected a table ([sync]), got 3",
            f"{path}: engines: expected tables [engines.NAME] of PROGRAM = PATH, got "
            + repr({"vllm": {"vllm": 5}}),
            f"{path}: health.failures: expected an integer >= 1, got 0",
        ]

    def test_missing_settings_are_named_as_flags(self):
        """Missing required settings are listed as the flags to give."""
        with pytest.raises(AgentConfigError, match=r"missing --cert, --key, --ca, --state-dir"):
            load_agent_config({"node": "n", "server": "https://h:1", "address": "127.0.0.1"})

    def test_server_must_be_https_host_port(self):
        """The server URL must be https://HOST:PORT."""
        with pytest.raises(AgentConfigError, match=r"expected https://HOST:PORT"):
            load_agent_config({**FLAGS, "server": "http://127.0.0.1:7443"})

    def test_bad_fabric_is_refused_before_anything_starts(self):
        """A malformed --fabric is a FabricError at configuration time."""
        with pytest.raises(FabricError, match=r"invalid fabric name"):
            load_agent_config({**FLAGS, "fabrics": ("IB A",)})


class TestOptions:
    """The option syntaxes."""

    def test_port_range(self):
        """LO-HI within 1024-65535."""
        assert parse_port_range("20000-20999") == (20000, 20999)
        for bad in ("20000", "a-b", "30000-20000", "80-90"):
            with pytest.raises(AgentConfigError, match="--port-range"):
                parse_port_range(bad)

    def test_engine_option(self):
        """NAME:PROGRAM=PATH."""
        assert parse_engine_option("vllm:vllm=/opt/vllm/bin/vllm") == ("vllm", "vllm", "/opt/vllm/bin/vllm")
        with pytest.raises(AgentConfigError, match="expected NAME:PROGRAM=PATH"):
            parse_engine_option("vllm=/opt/vllm")


class TestCommand:
    """`llmgw agent` refuses bad settings with a message, never a traceback."""

    def test_missing_flags(self):
        """No settings at all: the missing flags are named, exit 2."""
        result = CliRunner().invoke(agent, [])
        assert result.exit_code == 2
        assert "error: missing --node, --server, --address" in result.output

    def test_bad_fabric_refuses_to_start(self, tmp_path, test_pki):
        """A --fabric the node's adapters cannot meet refuses the start, saying why."""
        node = test_pki.client("node", "node-1")
        smi = tmp_path / "nvidia-smi"
        write_fake_nvidia_smi(smi, make_gpus(2))
        args = [
            "--node",
            "node-1",
            "--server",
            "https://127.0.0.1:1",
            "--address",
            "127.0.0.1",
            "--cert",
            str(node.cert_path),
            "--key",
            str(node.key_path),
            "--ca",
            str(test_pki.ca.cert_path),
            "--state-dir",
            str(tmp_path / "state"),
            "--nvidia-smi",
            str(smi),
            "--ib-root",
            str(tmp_path / "no-ib"),
            "--fabric",
            "ib-a",
            "--engine",
            f"sim:llmgw-sim={program('llmgw-sim')}",
        ]
        result = CliRunner().invoke(agent, args)
        assert result.exit_code == 1, result.output
        assert "error: --fabric ib-a needs 2 active adapters but this node has no RDMA" in result.output
