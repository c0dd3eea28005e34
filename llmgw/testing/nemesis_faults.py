"""The nemesis's faults as applied to a :class:`~llmgw.testing.nemesis_cluster.NemesisCluster`.

:class:`ClusterFaults` is the injector's :class:`~llmgw.testing.nemesis.Target`:
one method per :class:`~llmgw.testing.nemesis.FaultKind`, each choosing its
target among the processes, nodes and engines free of another fault, applying
it (kill -9 of a process group, SIGSTOP, a revoked certificate, a catalog, a
drain, an emptied seed folder) and returning the :class:`~llmgw.testing.nemesis.Fault`
and what heals it (a start, SIGCONT, a new certificate, uncordon, the files
back). It keeps which targets are under a fault (:attr:`ClusterFaults.busy`),
so that no two faults fight over one process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

import httpx

from llmgw import pki
from llmgw.dev.cluster import LocalNode
from llmgw.testing.nemesis import Fault, FaultKind
from llmgw.testing.nemesis_cluster import NemesisCluster, signal_group
from llmgw.wire import DrainStatus

__all__ = ["RESTART_SEC", "ClusterFaults"]

#: seconds before a server that exited is started again (deploy/systemd/llmgw-server.service's RestartSec)
RESTART_SEC = 2.0


class ClusterFaults:
    """Applies faults to ``cluster`` and heals them; a :class:`~llmgw.testing.nemesis.Target`."""

    def __init__(self, cluster: NemesisCluster) -> None:
        self.cluster = cluster
        # a paused leader must not hold the injector (and every fault due meanwhile) for the client's 30 s
        cluster.local.client._http.timeout = httpx.Timeout(10.0)
        #: what is under a fault now: server names, node ids, ``gateway``, ``postgres``
        self.busy: set[str] = set()
        #: server name -> when :meth:`supervise` first saw it exited
        self._exited: dict[str, float] = {}
        #: held while a server is killed, started again or judged by :meth:`supervise` (another thread)
        self._servers = threading.Lock()

    def supervise(self, now: float | None = None) -> list[str]:
        """Start again, :data:`RESTART_SEC` after it exited, a server no fault holds down, as the systemd
        unit's ``Restart=on-failure`` does (a server started while PostgreSQL is down exits at once, naming
        it). Returns a line for each server started.
        """
        now = time.time() if now is None else now
        said = []
        with self._servers:
            for name, process in list(self.cluster.servers.items()):
                if name in self.busy or process.poll() is None:
                    self._exited.pop(name, None)
                    continue
                exited = self._exited.setdefault(name, now)
                if now - exited >= RESTART_SEC:
                    del self._exited[name]
                    self.cluster.start_server(ord(name[-1]) - ord("a") + 1)
                    said.append(
                        f"supervisor: {name} had exited with code {process.returncode}; started again"
                    )
        return said

    def run_supervisor(self, stop: threading.Event, say: Callable[[str], None]) -> None:
        """:meth:`supervise` every half second until ``stop`` is set; runs in a thread of its own, so a
        slow admin-API fault (an apply while no server answers) does not hold a dead server down."""
        while not stop.wait(0.5):
            for line in self.supervise():
                say(line)

    def apply(self, kind: FaultKind, pick: float) -> tuple[Fault, Callable[[], None] | None]:
        """Apply one fault of ``kind`` (the target chosen by ``pick``); return it and what heals it."""
        return getattr(self, "_" + kind.name.lower())(kind, pick)

    def _choose(self, items: list, pick: float):
        return items[int(pick * len(items)) % len(items)] if items else None

    def _free_node(self, pick: float) -> LocalNode | None:
        nodes = [n for n in self.cluster.local.nodes.values() if n.node_id not in self.busy]
        return self._choose(nodes, pick)

    def _take_node(self, pick: float) -> LocalNode | None:
        """A free node (:meth:`_free_node`), marked busy until the fault's heal frees it; None: none free."""
        node = self._free_node(pick)
        if node is not None:
            self.busy.add(node.node_id)
        return node

    def _nothing(self, kind: FaultKind, why: str) -> tuple[Fault, None]:
        now = time.time()
        return Fault(kind, "-", now, now, note=f"not applied: {why}"), None

    def _kill_server(self, kind: FaultKind, pick: float):
        running = [n for n, p in self.cluster.servers.items() if p.poll() is None and n not in self.busy]
        name = self._choose(running, pick)
        if name is None:
            return self._nothing(kind, "no server runs")
        with self._servers:
            self.busy.add(name)
            start = time.time()
            self.cluster.local.stop(self.cluster.servers[name], signal.SIGKILL)

        def heal() -> None:
            with self._servers:
                self.busy.discard(name)
                self.cluster.start_server(ord(name[-1]) - ord("a") + 1)

        return Fault(kind, name, start), heal

    def _stop_server(self, kind: FaultKind, pick: float):
        running = [n for n, p in self.cluster.servers.items() if p.poll() is None and n not in self.busy]
        name = self._choose(running, pick)
        if name is None:
            return self._nothing(kind, "no server runs")
        return self._pause(kind, name, self.cluster.servers[name].pid, name)

    def _pause(
        self, kind: FaultKind, target: str, pgid: int, busy: str, **what
    ) -> tuple[Fault, Callable[[], None]]:
        self.busy.add(busy)
        start = time.time()
        signal_group(pgid, signal.SIGSTOP)

        def heal() -> None:
            signal_group(pgid, signal.SIGCONT)
            self.busy.discard(busy)

        return Fault(kind, target, start, **what), heal

    def _kill_agent(self, kind: FaultKind, pick: float):
        node = self._free_node(pick)
        if node is None or node.process is None:
            return self._nothing(kind, "every node is under another fault")
        self.busy.add(node.node_id)
        start = time.time()
        self.cluster.local.stop(node.process, signal.SIGKILL)

        def heal() -> None:
            self.busy.discard(node.node_id)
            self.cluster.local.start_agent(node)

        return Fault(
            kind,
            node.node_id,
            start,
            nodes=frozenset({node.node_id}),
            replicas=self.cluster.on_node(node.node_id),
        ), heal

    def _stop_agent(self, kind: FaultKind, pick: float):
        node = self._free_node(pick)
        if node is None or node.process is None:
            return self._nothing(kind, "every node is under another fault")
        what = {"nodes": frozenset({node.node_id}), "replicas": self.cluster.on_node(node.node_id)}
        return self._pause(kind, node.node_id, node.process.pid, node.node_id, **what)

    def _engine(self, pick: float):
        last = self.cluster.last
        shards = [
            (r.id, s) for r in (last.replicas if last else ()) if r.state == "ready"
            for s in r.shards if s.pid and s.node not in self.busy
        ]  # fmt: skip
        return self._choose(shards, pick)

    def _kill_engine(self, kind: FaultKind, pick: float):
        return self._signal_engine(kind, pick, signal.SIGKILL)

    def _stop_engine(self, kind: FaultKind, pick: float):
        return self._signal_engine(kind, pick, signal.SIGSTOP, heal_with=signal.SIGCONT)

    def _signal_engine(self, kind: FaultKind, pick: float, sig: int, heal_with: int | None = None):
        """Send ``sig`` to a ready engine's own process (not its launcher); ``heal_with`` heals it."""
        chosen = self._engine(pick)
        if chosen is None:
            return self._nothing(kind, "no ready engine on a free node")
        replica, shard = chosen
        start = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(shard.pid, sig)

        def heal() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(shard.pid, heal_with)

        target = f"{replica} r{shard.rank} on {shard.node} pid {shard.pid}"
        fault = Fault(kind, target, start, nodes=frozenset({shard.node}), replicas=frozenset({replica}))
        return fault, (heal if heal_with is not None else None)

    def _kill_gateway(self, kind: FaultKind, pick: float):
        gateway = self.cluster.local.gateway
        if gateway is None or gateway.poll() is not None or "gateway" in self.busy:
            return self._nothing(kind, "the gateway is under another fault")
        self.busy.add("gateway")
        start = time.time()
        self.cluster.local.stop(gateway, signal.SIGKILL)
        port = int(self.cluster.local.gateway_url.rsplit(":", 1)[1])

        def heal() -> None:
            self.busy.discard("gateway")
            self.cluster.local.start_gateway(port)

        return Fault(kind, "gateway", start), heal

    def _stop_gateway(self, kind: FaultKind, pick: float):
        gateway = self.cluster.local.gateway
        if gateway is None or gateway.poll() is not None or "gateway" in self.busy:
            return self._nothing(kind, "the gateway is under another fault")
        return self._pause(kind, "gateway", gateway.pid, "gateway")

    def _kill_postgres(self, kind: FaultKind, pick: float):
        if "postgres" in self.busy:
            return self._nothing(kind, "PostgreSQL is under another fault")
        self.busy.add("postgres")
        start = time.time()
        self.cluster.postgres.crash()

        def heal() -> None:
            self.cluster.postgres.restart()
            self.busy.discard("postgres")

        return Fault(kind, "postgres", start), heal

    def _stop_postgres(self, kind: FaultKind, pick: float):
        if "postgres" in self.busy or self.cluster.postgres.process is None:
            return self._nothing(kind, "PostgreSQL is under another fault")
        return self._pause(kind, "postgres", self.cluster.postgres.process.pid, "postgres")

    def _revoke_node(self, kind: FaultKind, pick: float):
        node = self._take_node(pick)
        if node is None:
            return self._nothing(kind, "every node is under another fault")
        start = time.time()
        pki.revoke(self.cluster.local.ca, node.node_id)

        def heal() -> None:
            node.tls = pki.issue_node(
                self.cluster.local.ca, node.node_id, out=node.root / "tls", overwrite=True
            )
            self.busy.discard(node.node_id)

        what = {"nodes": frozenset({node.node_id}), "replicas": self.cluster.on_node(node.node_id)}
        return Fault(
            kind, node.node_id, start, note="its certificate revoked, a new one issued at healing", **what
        ), heal

    def _apply(self, kind: FaultKind, change: Callable[[], str], *, prune: bool = False):
        before = (self.cluster.tps, self.cluster.chat, self.cluster.spare)
        start = time.time()
        note = change()
        try:
            self.cluster.apply_catalog(prune=prune)
        except Exception as exc:
            self.cluster.tps, self.cluster.chat, self.cluster.spare = before
            return self._nothing(kind, f"{note}: the apply failed: {exc}")
        return Fault(kind, "catalog", start, note=note), None

    def _apply_args(self, kind: FaultKind, pick: float):
        def change() -> str:
            self.cluster.tps = 300 if self.cluster.tps == 400 else 400
            return f"--tokens-per-second {self.cluster.tps}"

        return self._apply(kind, change)

    def _apply_scale(self, kind: FaultKind, pick: float):
        def change() -> str:
            self.cluster.chat = 3 if self.cluster.chat == 2 else 2
            return f"chat: {self.cluster.chat} replicas"

        return self._apply(kind, change)

    def _apply_prune(self, kind: FaultKind, pick: float):
        def change() -> str:
            self.cluster.spare = not self.cluster.spare
            return "spare added" if self.cluster.spare else "spare removed (--prune)"

        return self._apply(kind, change, prune=True)

    def _drain(self, kind: FaultKind, pick: float):
        node = self._free_node(pick)
        if node is None:
            return self._nothing(kind, "every node is under another fault")
        start = time.time()
        self.cluster.local.client.request("POST", f"/v1/admin/nodes/{node.node_id}/drain", DrainStatus)

        def heal() -> None:
            self.cluster.local.client.request("POST", f"/v1/admin/nodes/{node.node_id}/uncordon", DrainStatus)

        what = {"nodes": frozenset({node.node_id}), "replicas": self.cluster.on_node(node.node_id)}
        return Fault(kind, node.node_id, start, **what), heal

    def _empty_seed(self, kind: FaultKind, pick: float):
        node = self._take_node(pick)
        if node is None:
            return self._nothing(kind, "every node is under another fault")
        start = time.time()
        folder = self.cluster.seed_folder(node)
        for path in folder.iterdir():
            path.unlink()

        def heal() -> None:
            self.cluster.fill_seed(node)
            self.busy.discard(node.node_id)

        return Fault(
            kind, node.node_id, start, nodes=frozenset({node.node_id}), note=f"{folder} emptied"
        ), heal
