"""``llmgw dev``: the README's first command, a whole cluster on simulated nodes."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from llmgw.dev import runs
from llmgw.testing.processes import ManagedProcess, free_port, start, wait_until

pytestmark = pytest.mark.timeout(240)


def _llmgw_processes(marker: str) -> list[str]:
    """Command lines of running processes that mention ``marker`` (the test's state dir).

    Read from /proc, whole: ``ps`` cuts command lines to $COLUMNS, which pytest may set.
    """
    found = []
    for entry in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = entry.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry.parent / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if marker in args and state != "Z":
            found.append(args)
    return found


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


def _recorded(state: Path) -> list[str]:
    """Names of the processes the running llmgw dev recorded in its state dir."""
    try:
        return [e["name"] for e in json.loads((state / "processes.json").read_text())]
    except (OSError, ValueError):
        return []


class _Dev:
    """``llmgw dev`` runs on one state dir and one pair of ports, every process ended when the test ends."""

    def __init__(self, llmgw_exe: str, env: dict[str, str], tmp_path: Path) -> None:
        self.exe, self.env, self.tmp_path = llmgw_exe, env, tmp_path
        self.state = tmp_path / "dev"
        #: server, gateway, and metrics (not the default 9464: another test's cluster may hold it)
        self.ports = (free_port(), free_port(), free_port())
        self.started: list[ManagedProcess] = []

    def argv(self, *more: str) -> list[str]:
        server, gateway, metrics = self.ports
        return [
            self.exe, "dev", "--nodes", "3", "--server-port", str(server), "--gateway-port", str(gateway),
            "--metrics-port", str(metrics), "--state-dir", str(self.state),
            "--config-dir", str(self.tmp_path / "ctl"), *more,
        ]  # fmt: skip

    def start(self, *more: str, ignore_sigint: bool = False) -> ManagedProcess:
        """Start llmgw dev; ``ignore_sigint``: as a non-interactive shell starts a job with ``&``."""
        argv = self.argv(*more)
        if ignore_sigint:
            argv = ["bash", "-c", 'trap "" INT; exec "$@"', "bash", *argv]
        name = f"dev-{len(self.started) + 1}"
        process = start(argv, name=name, env=self.env, log_dir=self.tmp_path / "out")
        self.started.append(process)
        return process

    def end(self) -> None:
        for process in self.started:
            process.kill_group()
        runs.stop_leftovers(self.state, grace=5)

    def ports_free(self) -> bool:
        """Whether nothing listens on the ports (connections of the run before may still be in TIME_WAIT)."""
        return not any(runs.port_in_use("127.0.0.1", port) for port in self.ports)


@pytest.fixture
def local_dev(llmgw_exe, clean_env, tmp_path):
    dev = _Dev(llmgw_exe, clean_env, tmp_path)
    try:
        yield dev
    finally:
        dev.end()


def test_dev_stopped_at_any_moment_leaves_nothing_running(local_dev):
    """A killed llmgw dev's processes are ended by the next run; SIGTERM while agents start, or while
    engines start, stops everything and frees the ports."""
    first = local_dev.start()
    wait_until(lambda: "server" in _recorded(local_dev.state), 60, "the first run to start its server", first)
    first.signal(signal.SIGKILL)  # as `kill -9`: nothing of llmgw dev runs its stop
    first.wait_exit(10)
    left = _recorded(local_dev.state)
    assert left and _llmgw_processes(str(local_dev.state)), "a killed llmgw dev leaves its server running"

    second = local_dev.start()
    ended = "the second run to end the leftovers"
    wait_until(lambda: "stopped server (pid" in second.stdout(), 60, ended, second)
    wait_until(
        lambda: len([n for n in _recorded(local_dev.state) if n.startswith("agent-")]) >= 1,
        60,
        "the second run to start an agent",
        second,
    )
    second.signal(signal.SIGTERM)  # mid-startup: agents are not registered yet, nothing is ready
    assert second.wait_exit(60) == 128 + signal.SIGTERM, second.stdout() + second.stderr()
    assert "stopped by SIGTERM" in second.stdout()
    assert _llmgw_processes(str(local_dev.state)) == [], "llmgw dev left processes running"
    assert local_dev.ports_free(), "the next run would meet Address already in use"
    assert not (local_dev.state / "processes.json").exists()

    third = local_dev.start()  # and once engines are starting
    wait_until(lambda: "applied " in third.stdout(), 90, "the third run to apply the sample catalog", third)
    third.signal(signal.SIGTERM)
    assert third.wait_exit(60) == 128 + signal.SIGTERM, third.stdout() + third.stderr()
    assert _llmgw_processes(str(local_dev.state)) == [], "llmgw dev left processes (engines?) running"
    assert local_dev.ports_free()


def test_dev_restarts_after_a_drain_and_stops_on_sigint_from_a_script(local_dev):
    """Started in the background of a script (SIGINT ignored), `kill -INT` stops llmgw dev; after a drain
    a new run uncordons the node and gets every replica ready, with its own log folder."""
    first = local_dev.start(ignore_sigint=True)
    wait_until(lambda: "press Ctrl-C" in first.stdout(), 150, "the first run to serve", first)
    node = re.search(r"ctl --config-dir \S+ drain (node-\d+)", first.stdout())
    assert node, first.stdout()
    ctl = [local_dev.exe, "ctl", "--config-dir", str(local_dev.tmp_path / "ctl")]
    drained = subprocess.run([*ctl, "drain", node[1]], capture_output=True, text=True, timeout=120)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    first.signal(signal.SIGINT)
    assert first.wait_exit(60) == 0, first.stdout() + first.stderr()
    assert _llmgw_processes(str(local_dev.state)) == [], "llmgw dev left processes running"

    second = subprocess.run(
        local_dev.argv("--once"), capture_output=True, text=True, env=local_dev.env, timeout=200
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"{node[1]} was cordoned" in second.stdout and "llmgw dev: 3 replicas ready" in second.stdout
    logs = local_dev.state / "logs"
    folders = sorted(p for p in logs.iterdir() if p.is_dir() and not p.is_symlink())
    assert len(folders) == 2 and (logs / "latest").resolve() == folders[1]
    assert "server.log" in {p.name for p in folders[0].iterdir()} & {p.name for p in folders[1].iterdir()}
    assert _llmgw_processes(str(local_dev.state)) == [], "llmgw dev left processes running"
