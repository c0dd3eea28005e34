"""Every process's settings: flag > environment > file > default, checked first, one name per setting."""

from __future__ import annotations

import json
import re
import signal
import subprocess

import pytest
from click.testing import CliRunner

from llmgw.agent.config import AgentConfig, AgentConfigError, load_agent_config
from llmgw.cli import cli
from llmgw.dev.cli import DevSettings
from llmgw.dev.cluster import program
from llmgw.gateway.cli import GatewaySettings
from llmgw.server.cli import ServerSettings
from llmgw.settings import settings_fields
from llmgw.testing.processes import free_port, running, wait_until


def show(*args: str, env: dict[str, str] | None = None) -> dict[str, tuple[str, str]]:
    """``llmgw ARGS --show-config`` as {key: (value as written, where it came from)}."""
    result = CliRunner().invoke(cli, [*args, "--show-config"], env=env)
    assert result.exit_code == 0, result.output
    shown = {}
    for line in result.output.splitlines()[1:]:
        if not line.startswith("#"):
            setting, _, origin = line.partition("  # ")
            key, _, value = setting.partition(" = ")
            shown[key] = (value, origin)
    return shown


def test_flag_beats_environment_beats_file_beats_default(tmp_path):
    """One setting from each layer: each comes from the highest layer that gives it."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        'server = "https://file:7443"\nmax_attempts = 5\nrouting = "random"\nlog_level = "warning"\n'
        "no_keys = true\n"
    )
    env = {"LLMGW_SERVER": "https://env:7443", "LLMGW_LOG_LEVEL": "error"}
    shown = show("gateway", "--config", str(config), "--routing", "least-outstanding", env=env)
    assert shown["routing"] == ('"least-outstanding"', "flag")
    assert shown["server"] == ('"https://env:7443"', "environment LLMGW_SERVER")
    assert shown["log_level"] == ('"error"', "environment LLMGW_LOG_LEVEL")
    assert shown["max_attempts"] == ("5", f"file {config}")
    assert shown["no_keys"] == ("true", f"file {config}")
    assert shown["workers"] == ("1", "default")


@pytest.mark.parametrize(
    ("args", "env", "file", "expected"),
    [
        ((), {}, "", ('"info"', "default")),
        ((), {}, 'log_level = "warning"', ('"warning"', "file")),
        (
            (),
            {"LLMGW_LOG_LEVEL": "error"},
            'log_level = "warning"',
            ('"error"', "environment LLMGW_LOG_LEVEL"),
        ),
        (("--log-level", "ERROR"), {"LLMGW_LOG_LEVEL": "warning"}, "", ('"error"', "flag")),
        (("-v", "--log-level", "error"), {}, 'log_level = "warning"', ('"debug"', "flag")),
    ],
)
def test_log_level_order(tmp_path, args, env, file, expected):
    """-v, then --log-level, then LLMGW_LOG_LEVEL, then the file, then info."""
    config = tmp_path / "server.toml"
    config.write_text(file + "\n")
    value, origin = show("server", "--config", str(config), *args, env=env)["log_level"]
    assert (value, origin.replace(f"file {config}", "file")) == expected


@pytest.mark.parametrize(
    ("command", "settings"),
    [("server", ServerSettings), ("gateway", GatewaySettings), ("agent", AgentConfig), ("dev", DevSettings)],
)
def test_a_flag_is_its_settings_key(command, settings):
    """Each flag is a setting's name with - for _ (a repeatable one names one item of its list's key)."""
    ctx = cli.make_context("llmgw", [command, "--help"], resilient_parsing=True)
    params = cli.get_command(ctx, command).params
    flags = {p.name: p.opts[0] for p in params if p.name not in ("config", "show_config", "verbose", "help")}
    for field in settings_fields(settings):
        if field.name in ("health", "sync"):  # agent.toml tables: no flag
            continue
        flag = flags.pop(field.name)
        assert flag == "--" + field.name.replace("_", "-") or field.name == flag[2:] + "s", (field.name, flag)
    assert not flags, f"flags that are no setting: {flags}"


def test_server_file_paths_are_relative_to_the_file(tmp_path):
    """A relative path in server.toml is taken from the file's folder, not the working directory."""
    (tmp_path / "etc").mkdir()
    config = tmp_path / "etc" / "server.toml"
    config.write_text('cert = "tls/server.pem"\nstate_dir = "../state"\nlost_after = 12\n')
    shown = show("server", "--config", str(config))
    assert shown["cert"][0] == json.dumps(str(tmp_path / "etc" / "tls" / "server.pem"))
    assert shown["state_dir"][0] == json.dumps(str(tmp_path / "etc" / ".." / "state"))
    assert shown["lost_after"] == ("12.0", f"file {config}")


def test_show_config_is_a_config_file(tmp_path):
    """What --show-config prints, read back with --config, gives the same settings, now from the file."""
    first = CliRunner().invoke(cli, ["server", "--lost-after", "7", "--log-format", "json", "--show-config"])
    config = tmp_path / "server.toml"
    config.write_text(first.output)
    again = show("server", "--config", str(config))
    assert again["lost_after"] == ("7.0", f"file {config}")
    assert again["log_format"] == ('"json"', f"file {config}")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('max_attempts = "3"', "max_attempts: expected an integer from 1 to 10, got '3'"),
        ("max_attempts = 11", "max_attempts: expected an integer from 1 to 10, got 11"),
        ("no_keys = 1", "no_keys: expected true or false, got 1"),
        ('routing = "fastest"', "routing: expected one of least-outstanding, prefix, random, got 'fastest'"),
        ("max_atempts = 3", "unknown key 'max_atempts' (did you mean max_attempts?)"),
        ('log_format = "xml"', "log_format: expected one of text, json, got 'xml'"),
        ("listen = [", "not valid TOML"),
    ],
)
def test_bad_file_is_refused_naming_file_key_and_expectation(tmp_path, text, message):
    """A wrong type, range, choice, unknown key or bad TOML: exit 2, one line naming the file."""
    config = tmp_path / "gateway.toml"
    config.write_text(text + "\n")
    result = CliRunner().invoke(cli, ["gateway", "--config", str(config), "--server", "https://h:7443"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: {config}: ") and message in result.output, result.output


def test_missing_file_is_named(tmp_path):
    """--config naming no file says so."""
    result = CliRunner().invoke(cli, ["server", "--config", str(tmp_path / "nope.toml")])
    assert result.exit_code == 2
    assert f"cannot read config file {tmp_path / 'nope.toml'}: No such file or directory" in result.output


def test_agent_follows_the_same_order(tmp_path):
    """agent.toml's log settings stand unless a flag or variable (same argument) gives one; typos refused."""
    config = tmp_path / "agent.toml"
    base = 'node = "n1"\nserver = "https://s:7443"\naddress = "a"\ncert = "c"\nkey = "k"\nca = "ca"\n'
    config.write_text(base + 'state_dir = "s"\nlog_format = "json"\nlog_level = "warning"\n')
    from_file = load_agent_config({}, config)
    assert (from_file.log_format, from_file.log_level) == ("json", "warning")
    flagged = load_agent_config({"log_format": "text", "log_level": None}, config)
    assert (flagged.log_format, flagged.log_level) == ("text", "warning")
    config.write_text(base + 'state_dir = "s"\nlog_level = "loud"\n')
    with pytest.raises(AgentConfigError, match=f"{config}: log_level: expected one of debug, info"):
        load_agent_config({}, config)


@pytest.mark.timeout(60)
def test_server_runs_from_its_config_file_alone(tmp_path, test_pki):
    """`llmgw server --config server.toml` with nothing else: it serves ctl, logs JSON, exits 0 on SIGTERM."""
    port = free_port()
    config = tmp_path / "server.toml"
    config.write_text(
        f'listen = "127.0.0.1:{port}"\nstate_dir = "state"\nlog_format = "json"\n'
        f'cert = "{test_pki.server.cert_path}"\nkey = "{test_pki.server.key_path}"\n'
        f'ca = "{test_pki.ca.cert_path}"\n'
    )
    admin = test_pki.client("admin", "ops")
    ctl = [
        program("llmgw"),
        "ctl",
        "--server",
        f"https://127.0.0.1:{port}",
        "--ca",
        str(test_pki.ca.cert_path),
    ]
    ctl += ["--cert", str(admin.cert_path), "--key", str(admin.key_path), "nodes", "-o", "json"]

    def listed() -> bool:
        return subprocess.run(ctl, capture_output=True, text=True, timeout=30).stdout.strip() == "[]"

    with running([program("llmgw"), "server", "--config", str(config)], name="server") as server:
        wait_until(listed, 30, "ctl nodes to answer", server)
        server.signal(signal.SIGTERM)
        assert server.wait_exit(30) == 0, server.stderr_tail()
    assert (tmp_path / "state" / "state.db").exists()
    lines = [json.loads(line) for line in server.stderr().splitlines()]
    assert lines and all(line["logger"].startswith("llmgw") for line in lines)


def test_agent_show_config_follows_the_same_order_and_is_an_agent_toml(tmp_path):
    """`agent --show-config`: flag > environment > agent.toml > default; its output loads as agent.toml."""
    config = tmp_path / "agent.toml"
    config.write_text(
        'node = "n1"\nserver = "https://s:7443"\naddress = "a"\ncert = "c"\nkey = "k"\nca = "ca"\n'
        'state_dir = "s"\nlog_format = "json"\nlog_level = "info"\npeer_port = 7000\n'
        '[engines.vllm]\nvllm = "/opt/vllm"\n[health]\nfailures = 5\n'
    )
    result = CliRunner().invoke(
        cli,
        ["agent", "--config", str(config), "--peer-port", "0", "--show-config"],
        env={"LLMGW_LOG_LEVEL": "warning", "LLMGW_SERVER": "https://env:7443"},
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "peer_port = 0  # flag" in lines
    assert 'server = "https://env:7443"  # environment LLMGW_SERVER' in lines
    assert 'log_level = "warning"  # environment LLMGW_LOG_LEVEL' in lines
    assert f'log_format = "json"  # file {config}' in lines
    assert f"failures = 5  # file {config}" in lines
    assert "max_uploads = 4  # default" in lines
    shown = tmp_path / "shown.toml"
    shown.write_text(result.output)
    again = load_agent_config({}, shown)
    assert (again.peer_port, again.server, again.health.failures) == (0, "https://env:7443", 5)
    assert again.engines == {"vllm": {"vllm": "/opt/vllm"}}


def test_agent_orphan_grace(tmp_path):
    """--orphan-grace: 300 s by default, from agent.toml or the flag (which wins), never negative."""
    from tests.agent.test_agent_config import FLAGS

    assert load_agent_config(FLAGS).orphan_grace == 300.0
    config = tmp_path / "agent.toml"
    config.write_text("orphan_grace = 60\n")
    assert load_agent_config(FLAGS, config).orphan_grace == 60.0
    assert load_agent_config({**FLAGS, "orphan_grace": 5.0}, config).orphan_grace == 5.0
    with pytest.raises(AgentConfigError, match=r"--orphan-grace: expected a number >= 0, got -1"):
        load_agent_config({**FLAGS, "orphan_grace": -1.0})
    result = CliRunner().invoke(cli, ["agent", "--config", str(config), *_flags(FLAGS), "--show-config"])
    assert f"orphan_grace = 60.0  # file {config}" in result.output.splitlines(), result.output


def _flags(settings: dict[str, str]) -> list[str]:
    return [arg for key, value in settings.items() for arg in ("--" + key.replace("_", "-"), value)]


def test_dev_reads_a_config_file(tmp_path):
    """`llmgw dev --config dev.toml` reads settings like the others; a bad value names the file and key."""
    config = tmp_path / "dev.toml"
    config.write_text('nodes = 2\nstate_dir = "dev-state"\n')
    shown = show("dev", "--config", str(config), "--gateway-port", "8099")
    assert shown["nodes"] == ("2", f"file {config}")
    assert shown["state_dir"] == (json.dumps(str(tmp_path / "dev-state")), f"file {config}")
    assert shown["gateway_port"] == ("8099", "flag")
    config.write_text("nodes = 0\n")
    result = CliRunner().invoke(cli, ["dev", "--config", str(config), "--show-config"])
    assert result.exit_code == 2
    assert f"{config}: nodes: expected an integer from 1 to 200, got 0" in result.output


def test_environment_variables_are_documented():
    """Every setting's environment variable is in docs/configuration.md's table, and nothing else is."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `(LLMGW_\w+)` \|", doc, flags=re.MULTILINE))
    declared = {
        spec.env
        for cls in (ServerSettings, GatewaySettings, AgentConfig, DevSettings)
        for field in settings_fields(cls)
        if (spec := field.metadata["llmgw.setting"]).env
    }
    assert documented == declared
