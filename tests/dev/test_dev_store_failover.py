"""``llmgw dev --store``: a server killed with -9 does not stop the cluster; it comes back as a standby."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from llmgw.dev import runs
from llmgw.dev.cluster import program
from llmgw.testing.load import GatewayLoad
from llmgw.testing.processes import free_port, start, wait_until

pytestmark = pytest.mark.timeout(300)


def _pid_of(state: Path, name: str) -> int | None:
    """The pid the running llmgw dev recorded last for process ``name``."""
    try:
        entries = json.loads((state / "processes.json").read_text())
    except (OSError, ValueError):
        return None
    pids = [e["pid"] for e in entries if e["name"] == name]
    return pids[-1] if pids else None


def _roles(ctl_dir: Path) -> dict[str, str]:
    """``ctl servers -o json`` through llmgw dev's ctl config: address -> role ({} while it cannot answer)."""
    done = subprocess.run(
        [program("llmgw"), "ctl", "--config-dir", str(ctl_dir), "servers", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        return {}
    return {s["address"]: s["role"] for s in json.loads(done.stdout)["servers"]}


def test_dev_on_postgresql_serves_on_when_a_server_is_killed(llmgw_exe, clean_env, tmp_path, pg_url):
    """kill -9 of the leading server of `llmgw dev --store`: dev says so and keeps running, the gateway
    serves on (0 failed), the killed one is started again at its address, and one of the two leads."""
    state, ctl_dir = tmp_path / "dev", tmp_path / "ctl"
    # the standby listens on the next port
    port = next(p for p in iter(free_port, None) if not runs.port_in_use("127.0.0.1", p + 1))
    gateway = free_port()
    argv = [llmgw_exe, "dev", "--nodes", "2", "--server-port", str(port), "--store", pg_url]
    argv += ["--gateway-port", str(gateway), "--state-dir", str(state)]
    argv += ["--metrics-port", str(free_port()), "--config-dir", str(ctl_dir)]
    dev = start(argv, name="dev", env=clean_env, log_dir=tmp_path / "out")
    url_a, url_b = f"https://127.0.0.1:{port}", f"https://127.0.0.1:{port + 1}"
    try:
        wait_until(lambda: "serving; press Ctrl-C" in dev.stdout(), 240, "llmgw dev to serve", dev)
        assert _roles(ctl_dir) == {url_a: "leader", url_b: "standby"}
        killed = _pid_of(state, "server")
        with GatewayLoad(f"http://127.0.0.1:{gateway}", 4, models=("llama-sim-8b",)) as load:
            wait_until(lambda: load.ok >= 8, 60, "the load to get going", dev)
            os.kill(killed, signal.SIGKILL)
            said = "server exited with code -9"
            wait_until(lambda: said in dev.stdout(), 30, "llmgw dev to say the server died", dev)
            # whichever takes the lease once the killed one's runs out leads: the other server, or the killed
            # one started again at its address; the other stands by
            def one_leads_one_stands_by() -> bool:
                roles = _roles(ctl_dir)
                back = _pid_of(state, "server") not in (None, killed)
                both = set(roles) == {url_a, url_b}
                return back and both and sorted(roles.values()) == ["leader", "standby"]

            wait_until(one_leads_one_stands_by, 90, "one server to lead and the other to stand by", dev)
            served = load.ok
            wait_until(lambda: load.ok >= served + 8, 60, "the gateway to serve on", dev)
        assert dev.returncode is None, "llmgw dev kept running"
        assert f"starting server again on {url_a} (as a standby)" in dev.stdout()
        assert _pid_of(state, "server") not in (None, killed)
        assert load.failures == [], f"{len(load.failures)} failed of {load.ok + len(load.failures)}"
        dev.signal(signal.SIGTERM)
        assert dev.wait_exit(60) == 0, dev.stdout() + dev.stderr()  # stopped while serving: a clean stop
    finally:
        dev.kill_group()
        runs.stop_leftovers(state, grace=5)
