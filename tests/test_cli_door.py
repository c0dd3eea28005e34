"""The one error door and the one way long-running commands stop.

Every console script shows an llmgw error as ``error: message`` (one line per
leaf of an exception group) with its exit code; ``llmgw server``, ``agent`` and
``gateway`` stop cleanly and exit 0 on SIGTERM and on SIGINT (Ctrl-C), the
server with its database closed.
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import click
import httpx
import pytest
import trio
from click.testing import CliRunner

from llmgw.cli import Command, serve_until_signalled
from llmgw.dev.cluster import LocalCluster, program
from llmgw.errors import LlmgwError
from llmgw.onboard.cli import onboard_node
from llmgw.provision.cli import provision_node
from llmgw.testing.processes import free_port, taken_port


class _Refused(LlmgwError):
    exit_code = 3


@click.command(cls=Command)
@click.argument("how")
def _failing(how: str) -> None:
    if how == "one":
        raise _Refused("the id is taken")
    if how == "group":
        raise ExceptionGroup("two", [_Refused("first problem"), LlmgwError("second problem")])
    raise ValueError("a bug")


class TestCommand:
    """A command with the door shows the operator's errors as lines, and lets bugs be bugs."""

    def test_one_error(self):
        """An llmgw error is one ``error:`` line on stderr and its exit code; no traceback."""
        result = CliRunner().invoke(_failing, ["one"])
        assert (result.exit_code, result.output) == (3, "error: the id is taken\n")

    def test_exception_group(self):
        """An exception group of llmgw errors shows each leaf; the first one's exit code."""
        result = CliRunner().invoke(_failing, ["group"])
        assert (result.exit_code, result.output) == (3, "error: first problem\nerror: second problem\n")

    def test_bug_is_not_hidden(self):
        """Anything else is raised as it is."""
        result = CliRunner().invoke(_failing, ["bug"])
        assert isinstance(result.exception, ValueError)

    def test_console_scripts_use_it(self):
        """``llmgw-provision-node`` and ``llmgw-onboard-node`` go through the same door."""
        assert isinstance(provision_node, Command) and isinstance(onboard_node, Command)


class TestServeUntilSignalled:
    """The stop logic shared by server, agent and gateway, run in this process."""

    def test_graceful_stop_then_second_signal(self, caplog):
        """The first signal asks for a graceful stop; a second one is logged and cuts it short; exit 0."""
        asked = trio.Event()
        cut_short = []

        async def serve() -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            await asked.wait()
            try:
                os.kill(os.getpid(), signal.SIGINT)
                await trio.sleep_forever()
            except trio.Cancelled:
                cut_short.append(True)
                raise

        log = logging.getLogger("llmgw.test-door")
        with caplog.at_level(logging.INFO, logger=log.name):
            serve_until_signalled(serve, log=log, stop=asked.set, stopping="draining")
        assert cut_short == [True]
        assert [r.getMessage() for r in caplog.records] == [
            "SIGTERM: draining",
            "SIGINT while stopping: stopping now",
        ]

    def test_serve_returning_ends_it(self):
        """A serve that returns by itself ends the run; no signal needed."""
        served = []

        async def serve() -> None:
            served.append(True)

        serve_until_signalled(serve, log=logging.getLogger("llmgw.test-door"))
        assert served == [True]

    def test_llmgw_error_goes_through_the_door(self, capsys):
        """An llmgw error inside (here in an exception group) is shown and becomes the exit code."""

        async def serve() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_raise, _Refused("cannot listen on 127.0.0.1:1"))

        with pytest.raises(SystemExit) as exit_:
            serve_until_signalled(serve, log=logging.getLogger("llmgw.test-door"))
        assert exit_.value.code == 3
        assert capsys.readouterr().err == "error: cannot listen on 127.0.0.1:1\n"


async def _raise(error: BaseException) -> None:
    raise error


@pytest.fixture
def cluster(tmp_path: Path):
    """A server and one agent, running as processes; every process is ended afterwards."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    try:
        local.start(1)
        yield local
    finally:
        local.stop_all()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_processes_stop_cleanly_on_signal(cluster, signum):
    """Gateway, agent and server each exit 0 soon after the signal; the server's state survives a restart."""
    cluster.start_gateway(free_port())
    cluster.wait(lambda: _healthy(cluster.gateway_url), "the gateway to answer /health")
    name = signal.Signals(signum).name

    # cluster.stop SIGKILLs after the grace: an exit code of 0 means the process stopped by itself in time
    assert cluster.stop(cluster.gateway, signum, grace=10) == 0, cluster.tail("gateway")
    agent = cluster.nodes["node-1"]
    assert cluster.stop(agent.process, signum, grace=10) == 0, cluster.tail("agent-node-1")
    assert f"{name}: leaving every shard running for the next agent" in cluster.tail("agent-node-1")
    assert cluster.stop(cluster.server, signum, grace=10) == 0, cluster.tail("server")
    assert f"{name}: stopping, then closing the state database" in cluster.tail("server")

    database = cluster.state_dir / "server" / "state.db"
    wal = database.with_name("state.db-wal")
    assert not wal.exists() or wal.stat().st_size == 0, "the server left its write-ahead log unmerged"
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)

    cluster.start_server()
    nodes = cluster.wait(lambda: cluster.client.request("GET", "/v1/admin/nodes")["nodes"], "the node list")
    assert [n["node_id"] for n in nodes] == ["node-1"]


def test_server_on_a_taken_port_says_so(test_pki, tmp_path):
    """``llmgw server`` on a port in use exits 1 with one ``error:`` line naming the address; no traceback."""
    with taken_port() as port:
        tls = test_pki.server
        argv = [program("llmgw"), "server", "--state-dir", str(tmp_path / "state"), "--listen",
                f"127.0.0.1:{port}", "--cert", str(tls.cert_path), "--key", str(tls.key_path),
                "--ca", str(test_pki.ca.cert_path)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert "Traceback" not in done.stderr
