"""A whole llmgw cluster on this machine: a CA, ``llmgw server`` and simulated nodes.

Used by ``llmgw dev`` and by the end-to-end tests. Every process is real
(``llmgw server``, ``llmgw agent``, the engines they start) and runs in its
own process group; :meth:`LocalCluster.stop_all` ends them all. Nodes sit on
127.0.0.x addresses, each with a fake ``nvidia-smi`` (8 GPUs) and a fake
InfiniBand tree: nodes 1-2 on fabric ``ib-a``, node 3 on ``ib-b``, node 4 an
island, and so on.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import attrs

from llmgw import pki
from llmgw.agent.records import ProcessRecords, end_groups
from llmgw.ctl.client import AdminClient, ClientConfig, write_client_config
from llmgw.dev import runs, signals
from llmgw.dev.netclaim import NetClaim, claim_net
from llmgw.errors import LlmgwError
from llmgw.testing.fakes import make_adapters, make_gpus, write_fake_nvidia_smi, write_ib_sysfs
from llmgw.wire import ApplyCatalog, CatalogApplied, NodeList, ReplicaList

__all__ = ["LocalCluster", "LocalNode", "ClusterError", "fabric_of", "program"]

T = TypeVar("T")

#: how long each process has to exit after SIGTERM before SIGKILL
STOP_GRACE = 15.0
#: a server on a PostgreSQL store that dies is started again; one that exits with an error after running
#: less than this (seconds) cannot start, which is an error, not a loop (one killed by a signal is restarted)
RESTART_AFTER = 10.0

#: the first three parts of the simulated nodes' addresses (node N is PREFIX.{10+N}); tests run side by
#: side (one per worktree) set ``LLMGW_DEV_NET`` to keep their engines' ports apart
NODE_NET = os.environ.get("LLMGW_DEV_NET", "127.0.0")

#: node states in which a node's agent runs and syncs (``cordoned`` and ``draining`` take no new replicas)
UP_STATES = ("ready", "cordoned", "draining")


class ClusterError(LlmgwError):
    """The local cluster could not be started, or a process in it died."""


def fabric_of(index: int) -> str | None:
    """The fabric of node ``index`` (1-based): 1-2 ib-a, 3 ib-b, 4 an island, then again."""
    return {1: "ib-a", 2: "ib-a", 3: "ib-b", 0: None}[index % 4]


def program(name: str) -> str:
    """The path of console script ``name`` installed beside this Python, or on PATH."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise ClusterError(f"{name} is not installed in this environment; run ./run dev")
    return found


@attrs.define
class LocalNode:
    """One simulated node: its identity, its fake hardware, and its agent process."""

    index: int
    node_id: str
    address: str
    fabric: str | None
    root: Path
    tls: pki.Issued
    nvidia_smi: Path
    ib_root: Path
    process: subprocess.Popen | None = None

    @property
    def state_dir(self) -> Path:
        """The agent's state directory (its shards' logs are under ``logs/``)."""
        return self.root / "agent"

    @property
    def models_dir(self) -> Path:
        """The node's own models directory (``--models-dir``): copies of distributable models."""
        return self.root / "models"

    @property
    def seed_root(self) -> Path:
        """What stands for this node's ``/`` when it looks for ``seed:///PATH`` sources (its own disk)."""
        return self.root / "fs"

    def seed(self, path: str, files: Mapping[str, int]) -> Path:
        """Write ``files`` (name: size) of random bytes under ``seed:///PATH``; returns that folder."""
        folder = self.seed_root / path
        folder.mkdir(parents=True)
        for name, size in files.items():
            (folder / name).write_bytes(os.urandom(size))
        return folder


class LocalCluster:
    """A CA, a server and nodes under ``state_dir``; start and stop its parts one by one."""

    def __init__(
        self,
        state_dir: Path,
        *,
        server_port: int = 7443,
        lost_after: float = 15.0,
        poll_timeout: float = 5.0,
        store: str | None = None,
        sim: str | None = None,
    ) -> None:
        #: more ``llmgw agent`` flags for every node (``--bandwidth-limit 20``...)
        self.agent_args: list[str] = []
        #: serve the server's metrics on 127.0.0.1:PORT and each agent's on its address:PORT + 1
        #: (``--metrics-listen``); None: not served
        self.metrics_port: int | None = None
        self.state_dir = state_dir.resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        #: ``name (pid N)`` of each process an earlier run on this state dir left running, ended here
        self.leftovers = runs.stop_leftovers(self.state_dir, STOP_GRACE)
        #: a ``postgresql://`` URL the server keeps its state in; None: sqlite under the state dir
        self.store = store
        #: the program agents start as the sim engine (a wrapper injecting faults); ``llmgw-sim`` by default
        self.sim = sim
        #: this run's log folder (``<state dir>/logs/<UTC time>``; ``logs/latest`` points at it)
        self.logs = runs.new_log_dir(self.state_dir)
        self.server_port = server_port
        self.lost_after = lost_after
        self.poll_timeout = poll_timeout
        ca_dir = self.state_dir / "ca"
        self.ca = (
            pki.load_ca(ca_dir) if (ca_dir / "ca.pem").exists() else pki.init_ca(ca_dir, name="llmgw dev CA")
        )
        self.server_tls = pki.issue_server(
            self.ca, ["127.0.0.1", "localhost"], out=self.state_dir / "server-tls", overwrite=True
        )
        self.admin_tls = pki.issue_admin(
            self.ca, "dev-admin", out=self.state_dir / "admin-tls", overwrite=True
        )
        self.server_url = f"https://127.0.0.1:{server_port}"
        self.nodes: dict[str, LocalNode] = {}
        self.server: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None
        self.gateway_url: str | None = None
        self._processes: list[tuple[str, subprocess.Popen]] = []
        self._client: AdminClient | None = None
        self._started_at = time.time()
        #: what the last check of a wait saw, for its timeout message
        self._seen = ""
        #: says what the cluster does by itself (a server started again); a line each, on stdout by default
        self.say: Callable[[str], None] = lambda line: print(line, flush=True)
        #: the port each server (by name) listens on, to start it again there
        self._server_ports: dict[str, int] = {}
        #: this cluster's hold on its nodes' network, from its first agent until it stops
        self._net: NetClaim | None = None

    # -- parts -------------------------------------------------------------

    @property
    def client(self) -> AdminClient:
        """An admin client of this cluster's server."""
        if self._client is None:
            config = ClientConfig(
                self.server_url, self.ca.cert_path, self.admin_tls.cert_path, self.admin_tls.key_path
            )
            self._client = AdminClient(config)
        return self._client

    def start_server(self, *, port: int | None = None, name: str = "server") -> subprocess.Popen:
        """Start ``llmgw server`` on 127.0.0.1:``port`` (``server_port``) with its state under the state dir.

        Another ``name`` (and port) starts one more server on the same ``store``: it is not :attr:`server`.
        """
        process = self._start(
            name,
            [
                program("llmgw"),
                "server",
                *(["--store", self.store] if self.store else ["--state-dir", str(self.state_dir / "server")]),
                "--listen",
                f"127.0.0.1:{port or self.server_port}",
                *self._tls_flags(self.server_tls),
                "--crl",
                str(self.ca.crl_path),
                "--lost-after",
                str(self.lost_after),
                "--poll-timeout",
                str(self.poll_timeout),
                *self._metrics_listen("127.0.0.1", 0 if name == "server" else None),
            ],
        )
        if name == "server":
            self.server = process
        self._server_ports[name] = port or self.server_port
        return process

    def _tls_flags(self, tls: pki.Issued) -> list[str]:
        """``--cert``, ``--key`` and ``--ca`` of a process of this cluster holding the certificate ``tls``."""
        return ["--cert", str(tls.cert_path), "--key", str(tls.key_path), "--ca", str(self.ca.cert_path)]

    def start_gateway(self, port: int, *, keys: bool = False, extra: Sequence[str] = ()) -> subprocess.Popen:
        """Start ``llmgw gateway`` on 127.0.0.1:``port`` with a gateway certificate; no keys by default.

        ``extra`` are more ``llmgw gateway`` options (``["--stall-timeout", "4"]``).
        """
        tls = pki.issue_gateway(self.ca, "dev-gateway", out=self.state_dir / "gateway-tls", overwrite=True)
        argv = [
            program("llmgw"),
            "gateway",
            "--server",
            self.server_url,
            *self._tls_flags(tls),
            "--listen",
            f"127.0.0.1:{port}",
        ]
        if not keys:
            argv.append("--no-keys")
        argv.extend(extra)
        self.gateway = self._start("gateway", argv)
        self.gateway_url = f"http://127.0.0.1:{port}"
        return self.gateway

    def add_node(self, index: int, *, fabric: str | None | object = ..., gpus: int = 8) -> LocalNode:
        """Make node ``index``'s identity and fake hardware (once); the agent is not started."""
        node_id = f"node-{index}"
        if node_id in self.nodes:
            return self.nodes[node_id]
        root = self.state_dir / "nodes" / node_id
        root.mkdir(parents=True, exist_ok=True)
        chosen = fabric_of(index) if fabric is ... else fabric
        adapters = make_adapters({"mlx5_0": "ACTIVE", "mlx5_1": "ACTIVE"}) if chosen else []
        node = LocalNode(
            index=index,
            node_id=node_id,
            address=f"{NODE_NET}.{10 + index}",
            fabric=chosen,
            root=root,
            tls=pki.issue_node(self.ca, node_id, out=root / "tls", overwrite=True),
            nvidia_smi=write_fake_nvidia_smi(root / "nvidia-smi", make_gpus(gpus, seed=node_id)),
            ib_root=write_ib_sysfs(root / "infiniband", adapters),
        )
        self.nodes[node_id] = node
        return node

    def start_agent(self, node: LocalNode) -> subprocess.Popen:
        """Start ``llmgw agent`` for ``node``, with the sim engine installed.

        :raises NetTaken: the first time, when another local cluster runs its nodes on :data:`NODE_NET`.
        """
        if self._net is None:
            self._net = claim_net(NODE_NET, self.state_dir)
        argv = [
            program("llmgw"),
            "agent",
            "--node",
            node.node_id,
            "--server",
            self.server_url,
            "--address",
            node.address,
            *self._tls_flags(node.tls),
            "--state-dir",
            str(node.state_dir),
            "--nvidia-smi",
            str(node.nvidia_smi),
            "--ib-root",
            str(node.ib_root),
            "--engine",
            f"sim:llmgw-sim={self.sim or program('llmgw-sim')}",
            "--models-dir",
            str(node.models_dir),
            "--peer-port",
            "0",
            "--seed-root",
            str(node.seed_root),
        ]
        if node.fabric:
            argv += ["--fabric", node.fabric]
        argv += self._metrics_listen(node.address, 1)
        argv += self.agent_args
        node.process = self._start(f"agent-{node.node_id}", argv)
        return node.process

    def _metrics_listen(self, host: str, offset: int | None) -> list[str]:
        """``--metrics-listen HOST:PORT`` at :attr:`metrics_port` + ``offset`` (none when either is None)."""
        if self.metrics_port is None or offset is None:
            return []
        return ["--metrics-listen", f"{host}:{self.metrics_port + offset}"]

    def start(self, node_count: int, *, fabric: str | None | object = ...) -> None:
        """Start the server and ``node_count`` agents, and wait until every node registered.

        :param fabric: every node's fabric (None: islands); by default as :func:`fabric_of` says.
        """
        self.start_server()
        for index in range(1, node_count + 1):
            self.start_agent(self.add_node(index, fabric=fabric))
        self.wait(lambda: self._nodes_up(node_count), f"all {node_count} agents to register with the server")

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        # a stop signal waits until the process is recorded, so that the stop finds it
        with signals.deferred():
            with (self.logs / f"{name}.log").open("ab") as log:
                process = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            process._llmgw_started = time.monotonic()  # type: ignore[attr-defined]
            self._processes.append((name, process))
            runs.record_process(self.state_dir, name, process.pid)
        return process

    # -- waiting -----------------------------------------------------------

    def wait(self, done: Callable[[], T], what: str, timeout: float = 120.0) -> T:
        """Poll ``done()`` until it is truthy; raise with the logs' ends if ``timeout`` passes first.

        A process of the cluster exiting on its own fails the wait at once.
        """
        deadline = time.monotonic() + timeout
        last_error = None
        self._seen = ""
        while True:
            self.check()
            try:
                result = done()
                if result:
                    return result
                last_error = None  # an error from before the server listened is no reason now
            except LlmgwError as exc:
                last_error = exc
            if time.monotonic() > deadline:
                detail = f" (last error: {last_error})" if last_error else ""
                detail += f" (last seen: {self._seen})" if self._seen else ""
                raise ClusterError(
                    f"timed out after {timeout:.0f} s waiting for {what}{detail}; logs in "
                    f"{self.logs}. Server log ends with:\n{self.tail('server')}"
                )
            time.sleep(0.2)

    def check(self) -> None:
        """Raise if a process this cluster started exited without being told to.

        On a PostgreSQL store, a server that exits while another one runs is started again at its
        address instead (it comes back as a standby), and :attr:`say` says so: the cluster serves on.
        """
        for name, process in list(self._processes):
            if process.poll() is not None and not getattr(process, "_llmgw_stopped", False):
                if self._start_again(name, process):
                    continue
                raise ClusterError(
                    f"{name} exited with code {process.returncode}; its log "
                    f"({self.logs / (name + '.log')}) ends with:\n{self.tail(name)}"
                )

    def _start_again(self, name: str, process: subprocess.Popen) -> bool:
        """Start server ``name`` again when another server serves meanwhile (PostgreSQL); whether it did."""
        others = [
            p for n, p in self._processes if n in self._server_ports and p is not process and p.poll() is None
        ]
        ran = time.monotonic() - getattr(process, "_llmgw_started", 0.0)
        cannot_start = ran < RESTART_AFTER and process.returncode >= 0  # killed (kill -9): < 0
        if self.store is None or name not in self._server_ports or not others or cannot_start:
            return False
        process._llmgw_stopped = True  # type: ignore[attr-defined]
        port = self._server_ports[name]
        self.say(
            f"llmgw dev: {name} exited with code {process.returncode} (log: {self.logs / (name + '.log')}); "
            f"the other server serves on; starting {name} again on https://127.0.0.1:{port} (as a standby)"
        )
        self.start_server(port=port, name=name)
        return True

    def tail(self, name: str, lines: int = 20) -> str:
        """The last lines of process ``name``'s log."""
        try:
            text = (self.logs / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _nodes_up(self, count: int) -> bool:
        """Whether ``count`` of this cluster's nodes synced since it started (cordoned or draining count)."""
        since = time.time() - self._started_at
        nodes = [
            n
            for n in self.client.request("GET", "/v1/admin/nodes", NodeList).nodes
            if n.node_id in self.nodes
        ]
        up = [n for n in nodes if n.state in UP_STATES and n.engines and n.last_sync_ago <= since]
        waiting = sorted({*self.nodes} - {n.node_id for n in up})
        self._seen = f"{len(up)} of {count} nodes synced; waiting for {', '.join(waiting) or '-'}"
        return len(up) >= count

    def replicas(self) -> ReplicaList:
        """``GET /v1/admin/replicas``: the replicas with their shards, and the unplaced ones."""
        return self.client.request("GET", "/v1/admin/replicas", ReplicaList)

    def all_ready(self) -> bool:
        """Whether there are replicas, none unplaced, and all of them ready."""
        data = self.replicas()
        return bool(data.replicas) and not data.unplaced and all(r.state == "ready" for r in data.replicas)

    def all_adopted(self) -> bool:
        """Whether every replica is ready and each of its shards is reported running, with its engine's PID.

        Called by tests after a server restarted or another took over: the agents have reported again.
        """
        shards = [s for r in self.replicas().replicas for s in r.shards]
        return self.all_ready() and all(s.pid and s.state in ("ready", "running") for s in shards)

    def apply(self, text: str, name: str = "catalog", *, prune: bool = False) -> CatalogApplied:
        """Apply a catalog through the admin API (``prune``: it may remove models); returns its revision."""
        body = ApplyCatalog(text, name, prune=prune)
        return self.client.request("POST", "/v1/admin/catalog", CatalogApplied, body=body)

    def ctl(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
        """Run ``llmgw ctl ARGS...`` against this cluster as its admin, in a process of its own.

        The credentials go to ``<state dir>/ctl`` the first time; ``timeout`` bounds the process.
        """
        config = self.state_dir / "ctl"
        if not (config / "config.toml").exists():
            tls = self.admin_tls
            write_client_config(config, self.server_url, tls.ca_path, tls.cert_path, tls.key_path)
        argv = [program("llmgw"), "ctl", "--config-dir", str(config), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    # -- stopping ----------------------------------------------------------

    def stop(self, process: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = STOP_GRACE) -> int:
        """Send ``sig`` to ``process``'s group; SIGKILL the group after ``grace``. Returns its exit code."""
        process._llmgw_stopped = True  # type: ignore[attr-defined]
        _signal_group(process, sig)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()
        return process.returncode

    def stop_all(self) -> None:
        """Stop every agent, their engines, then the server; leave no process behind."""
        with signals.stopping():
            self._stop_all()
        runs.forget_processes(self.state_dir)
        if self._net is not None:
            self._net.release()
            self._net = None

    def _stop_all(self) -> None:
        agents = [p for name, p in self._processes if not name.startswith(("server", "gateway"))]
        gateways = [p for name, p in self._processes if name == "gateway"]
        servers = [p for name, p in self._processes if name.startswith("server")]
        for group in (gateways, agents, servers):
            for process in group:
                process._llmgw_stopped = True  # type: ignore[attr-defined]
                _signal_group(process, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE
            for process in group:
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                _signal_group(process, signal.SIGKILL)
                process.wait()
        # stopped agents leave their engines for the next agent to adopt: this stop is for good; every
        # node's engines at once (each waits out its own SIGTERM grace), not one node after another
        with ThreadPoolExecutor(max_workers=max(1, len(self.nodes))) as pool:
            for ended in [pool.submit(_end_engines, node) for node in self.nodes.values()]:
                ended.result()
        if self._client is not None:
            self._client.close()


def _end_engines(node: LocalNode) -> None:
    """End the engine groups ``node``'s agents recorded (SIGTERM, grace, SIGKILL)."""
    records = ProcessRecords(node.state_dir / "run")
    end_groups(records, records.group_records(), STOP_GRACE)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
