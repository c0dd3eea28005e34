"""Helpers shared by the ``test_agent_*`` modules (no tests here).

Fake engines are tiny Python HTTP servers started through a real
:class:`~llmgw.engine.Engine`, so the agent runs them exactly as it runs the
sim: under its launcher, in their own process group.
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import httpx
import trio
from llmgw_engine_sim import SimEngine

from llmgw.agent.config import AgentConfig, HealthSettings, SyncSettings
from llmgw.dev.cluster import NODE_NET, program
from llmgw.engine import Engine
from llmgw.models import Command, LaunchSpec, Sidecar
from llmgw.server.main import ServerConfig, serve_server
from llmgw.server.state.cluster import Settings
from llmgw.testing import make_gpus, write_fake_nvidia_smi
from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.processes import free_port, group_alive, pid_alive, wait_for
from llmgw.wire import DesiredShard

SIM = program("llmgw-sim")
#: the address agents of the server tests report (engines bind it): .2 of the run's (or worker's) node net
ADDRESS = f"{NODE_NET}.2"

#: a fake engine: ``script.py --host H --port P [--healthy N] [--status S] [--need-port Q]
#: [--ignore-sigterm]``; answers S (200) on /health N times (forever by default), then accepts
#: connections and never answers; with --need-port it first checks that Q accepts connections
#: on H and exits 1 if not.
FAKE_ENGINE = textwrap.dedent(
    """
    import argparse, http.server, socket, sys, time, threading

    parser = argparse.ArgumentParser()
    parser.add_argument("--host"); parser.add_argument("--port", type=int)
    parser.add_argument("--healthy", type=int, default=-1)
    parser.add_argument("--status", type=int, default=200)
    parser.add_argument("--need-port", type=int)
    parser.add_argument("--ignore-sigterm", action="store_true")
    args = parser.parse_args()
    if args.ignore_sigterm:
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.need_port:
        try:
            socket.create_connection((args.host, args.need_port), timeout=1).close()
        except OSError as exc:
            print(f"sidecar port {args.need_port} not listening: {exc}", flush=True)
            sys.exit(1)
        print(f"sidecar port {args.need_port} is listening", flush=True)
    answered = 0

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            global answered
            if args.healthy >= 0 and answered >= args.healthy:
                time.sleep(3600)
            answered += 1
            self.send_response(args.status); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"fake engine serving on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    """
)

#: a sidecar: waits ``--delay`` seconds, then listens on ``--port`` (accepting, never answering); with
#: ``--exit-when FILE`` it exits with code 3 once FILE exists
FAKE_SIDECAR = textwrap.dedent(
    """
    import argparse, os, socket, time
    parser = argparse.ArgumentParser()
    parser.add_argument("--host"); parser.add_argument("--port", type=int)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--exit-when")
    args = parser.parse_args()
    print(f"sidecar starting, listening in {args.delay} s", flush=True)
    time.sleep(args.delay)
    sock = socket.socket(); sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port)); sock.listen(16)
    print("sidecar listening", flush=True)
    if args.exit_when is not None:
        while not os.path.exists(args.exit_when):
            time.sleep(0.05)
        print("sidecar giving up", flush=True)
        raise SystemExit(3)
    while True:
        conn, _ = sock.accept(); conn.close()
    """
)


class ScriptEngine(Engine):
    """Runs the fake engine script with ``spec.extra_args``."""

    name = "script"
    checked_versions = ("1",)
    multi_node = False
    health_path = "/health"
    programs = ("python",)
    #: the fake answers GET only: its tests are about the health path
    liveness_probe = None

    def __init__(self, script: Path) -> None:
        self.script = script

    def build_command(self, spec: LaunchSpec) -> Command:
        """``python script --host H --port P EXTRA...``."""
        python = self.program_path(spec, "python")
        argv = [python, str(self.script), "--host", spec.host, "--port", str(spec.port), *spec.extra_args]
        return Command(argv=argv, env={"FAKE_ENGINE_RANK": str(spec.rank)})

    def widest_spec(self) -> LaunchSpec:
        """Not used by these tests."""
        return LaunchSpec(model_source="m", served_name="m", host="127.0.0.1", port=1)


def write_scripts(directory: Path) -> tuple[Path, Path]:
    """Write the fake engine and sidecar scripts; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    engine, sidecar = directory / "fake_engine.py", directory / "fake_sidecar.py"
    engine.write_text(FAKE_ENGINE)
    sidecar.write_text(FAKE_SIDECAR)
    return engine, sidecar


def agent_config(tmp_path: Path, **changes) -> AgentConfig:
    """An agent config for supervisor tests: fast probes, short grace, sim and python paths."""
    values = dict(
        node="node-1",
        server="https://127.0.0.1:1",
        address="127.0.0.1",
        cert=tmp_path / "none.pem",
        key=tmp_path / "none.key",
        ca=tmp_path / "ca.pem",
        state_dir=tmp_path / "agent",
        models_dir=tmp_path / "models",
        peer_port=0,
        engines={"sim": {"llmgw-sim": SIM}, "script": {"python": sys.executable}},
        stop_grace=2.0,
        sidecar_timeout=5.0,
        health=HealthSettings(interval=0.1, timeout=0.5, failures=3),
        sync=SyncSettings(timeout=10.0, backoff_initial=0.05, backoff_max=0.5, refused_retry=0.5),
    )
    values.update(changes)
    return AgentConfig(**values)


def desired(
    engine: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    source: str = "tiny/model",
    extra_args: Sequence[str] = (),
    sidecars: Sequence[Sidecar] = (),
    ready_timeout: float = 20.0,
    replica: str = "m-0",
    attempt: int = 1,
    rank: int = 0,
    nnodes: int = 1,
    dist_init_addr: str | None = None,
) -> DesiredShard:
    """A shard of ``engine`` on ``host:port`` (single-node unless ``nnodes`` says otherwise)."""
    spec = LaunchSpec(
        model_source=source,
        served_name="m",
        host=host,
        port=port,
        extra_args=extra_args,
        rank=rank,
        nnodes=nnodes,
        dist_init_addr=dist_init_addr,
    )
    return DesiredShard(
        replica_id=replica,
        attempt=attempt,
        rank=rank,
        model="m",
        engine=engine,
        spec=spec,
        sidecars=sidecars,
        ready_timeout=ready_timeout,
    )


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` right now: no process holds it.

    Binds with ``SO_REUSEADDR``, as every engine's server does: a connection
    the engine closed first lingers in TIME_WAIT for a minute without
    holding the port for a new listener.
    """
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def kill_group(pgid: int | None) -> None:
    """SIGKILL a process group if it exists: cleanup when a test fails midway."""
    import contextlib
    import signal

    if pgid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


async def wait_state(states: list, wanted: set[str], what: str = ""):
    """Wait, by the caller's deadline (``trio.fail_after``), until the last reported state is in ``wanted``.

    :returns: that ObservedShard; at the deadline, fails naming the states wanted and those seen.
    """

    def last():
        return states[-1] if states and states[-1].state in wanted else None

    return await wait_for(last, what or f"shard state in {sorted(wanted)} (seen {states})")


class Server:
    """A real ``llmgw server`` in the test's nursery that can be stopped and started again on its port."""

    def __init__(self, nursery: trio.Nursery, test_pki, state_dir: Path) -> None:
        self.nursery = nursery
        self.pki = test_pki
        self.state_dir = state_dir
        self.port = 0
        self.scope: trio.CancelScope | None = None
        self.done = trio.Event()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def start(self) -> None:
        config = ServerConfig(
            state_dir=self.state_dir,
            cert=self.pki.server.cert_path,
            key=self.pki.server.key_path,
            ca=self.pki.ca.cert_path,
            host="127.0.0.1",
            port=self.port,
            crl=self.pki.ca.crl_path,
            settings=Settings(lost_after=30, backoff_base=0.2, ready_timeout=30),
            poll_timeout=1.0,
            tick=0.2,
        )
        self.scope, self.done = trio.CancelScope(), trio.Event()
        scope, done, loaded = self.scope, self.done, trio.Event()

        async def run(task_status: trio.TaskStatus) -> None:
            try:
                with scope:
                    await serve_server(config, {"sim": SimEngine()}, loaded=loaded, task_status=task_status)
            finally:
                done.set()

        _, self.port = await self.nursery.start(run)
        with trio.fail_after(10):
            await loaded.wait()

    async def stop(self) -> None:
        assert self.scope is not None
        self.scope.cancel()
        await self.done.wait()

    def admin(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, verify=self.pki.context("admin", "ops"), timeout=10)

    async def apply(self, replicas: int) -> None:
        async with self.admin() as admin:
            text = catalog_yaml({"small": model("tiny/model", replicas=replicas)}, one=sim_profile(2))
            response = await admin.post("/v1/admin/catalog", json={"text": text})
            assert response.status_code == 200, response.text

    async def get(self, path: str) -> dict:
        async with self.admin() as admin:
            response = await admin.get(path)
            response.raise_for_status()
            return response.json()


def make_config(
    tmp_path: Path, test_pki, server: Server, *, node: str = "node-1", cert_for: str | None = None
) -> AgentConfig:
    """The config of an agent for ``node`` with 8 fake GPUs, no fabric, the sim engine."""
    issued = test_pki.client("node", cert_for or node)
    smi = write_fake_nvidia_smi(tmp_path / f"nvidia-smi-{node}", make_gpus(8, seed=node))
    low = free_port(ADDRESS)
    return AgentConfig(
        node=node,
        server=server.url,
        address=ADDRESS,
        cert=issued.cert_path,
        key=issued.key_path,
        ca=test_pki.ca.cert_path,
        state_dir=tmp_path / f"agent-{node}",
        models_dir=tmp_path / f"models-{node}",
        peer_port=0,
        nvidia_smi=str(smi),
        ib_root=str(tmp_path / "no-ib"),
        port_range=(low, min(low + 50, 65535)),
        engines={"sim": {"llmgw-sim": SIM}},
        stop_grace=3.0,
        health=HealthSettings(interval=0.1, timeout=1.0),
        sync=SyncSettings(timeout=10.0, backoff_initial=0.05, backoff_max=0.5, refused_retry=0.5),
    )


async def replica_ready(server: Server) -> dict | None:
    """The first replica, once it is ready and its agent reported its shard ready (None before)."""
    replicas = (await server.get("/v1/admin/replicas"))["replicas"]
    if not replicas or replicas[0]["state"] != "ready":
        return None
    return replicas[0] if replicas[0]["shards"][0]["state"] == "ready" else None


__all__ = [
    "ADDRESS",
    "SIM",
    "Server",
    "make_config",
    "replica_ready",
    "ScriptEngine",
    "agent_config",
    "desired",
    "group_alive",
    "kill_group",
    "pid_alive",
    "port_free",
    "wait_state",
    "write_scripts",
]
