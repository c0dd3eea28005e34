"""``llmgw dev``: the README's first command, a whole cluster on simulated nodes."""

from __future__ import annotations

import socket
import subprocess

import pytest

from llmgw.testing.processes import free_port

pytestmark = pytest.mark.timeout(240)


def _llmgw_processes(marker: str) -> list[str]:
    """Command lines of running processes that mention ``marker`` (the test's state dir)."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_dev_once_brings_every_replica_up_and_leaves_nothing_running(llmgw_exe, clean_env, tmp_path):
    """`llmgw dev --once` starts server and agents, gets every sample replica ready, then stops them all."""
    state = tmp_path / "dev"
    result = subprocess.run(
        [
            llmgw_exe,
            "dev",
            "--once",
            "--nodes",
            "2",
            "--server-port",
            str(free_port()),
            "--gateway-port",
            str(free_port()),
            "--metrics-port",
            str(free_port()),
            "--state-dir",
            str(state),
            "--config-dir",
            str(tmp_path / "ctl"),
        ],
        capture_output=True,
        text=True,
        env=clean_env,
        timeout=200,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "llmgw dev: 3 replicas ready" in result.stdout
    assert "llama-sim-8b answered: '" in result.stdout
    assert "llmgw ctl --config-dir" in result.stdout
    assert (tmp_path / "ctl" / "config.toml").read_text().count("server =") == 1
    assert oct((tmp_path / "ctl" / "admin.key").stat().st_mode & 0o777) == "0o600"
    assert _llmgw_processes(str(state)) == [], "llmgw dev left processes running"


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_dev_on_postgresql_runs_two_servers_one_leading(llmgw_exe, clean_env, tmp_path, pg_url):
    """`llmgw dev --store URL --once`: two servers on the database, every replica ready, ctl knows both."""
    state = tmp_path / "dev"
    port = next(p for p in iter(free_port, None) if _free(p + 1))  # the standby listens on the next port
    argv = [llmgw_exe, "dev", "--once", "--nodes", "2", "--server-port", str(port), "--store", pg_url]
    argv += ["--gateway-port", str(free_port()), "--state-dir", str(state)]
    argv += ["--metrics-port", str(free_port()), "--config-dir", str(tmp_path / "ctl")]
    result = subprocess.run(argv, capture_output=True, text=True, env=clean_env, timeout=200)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "llmgw dev: 3 replicas ready" in result.stdout
    assert f"started a standby server on https://127.0.0.1:{port + 1}" in result.stdout
    config = (tmp_path / "ctl" / "config.toml").read_text()
    assert f'server = "https://127.0.0.1:{port},https://127.0.0.1:{port + 1}"' in config
    assert _llmgw_processes(str(state)) == [], "llmgw dev left processes running"
