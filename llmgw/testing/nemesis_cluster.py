"""The nemesis's cluster: servers on a throwaway PostgreSQL, agents, a gateway, and what it samples of them.

:class:`NemesisCluster` builds the cluster a run hits (``servers`` ``llmgw
server`` on one PostgreSQL database, ``agents`` nodes with sim engines on
``$LLMGW_DEV_NET`` addresses, a gateway) and is the injector's
:class:`~llmgw.testing.nemesis.Target`: :meth:`NemesisCluster.apply` applies
one fault (kill -9, SIGSTOP, a revocation, a catalog, a drain, an emptied
seed folder) and returns what heals it. Its :meth:`sample` records what the
invariants need while the run goes (which replicas were ready when, the
files each new replica runs on). :meth:`stop` ends every process group,
engines an agent left included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import TypeVar

import httpx

from llmgw.dev.cluster import LocalCluster, LocalNode
from llmgw.pki import client_ssl_context
from llmgw.serverlist import STANDBY_HEADER
from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.nemesis_checks import ReplicaRun
from llmgw.testing.postgres import SUPERUSER, PostgresCluster
from llmgw.testing.processes import free_port
from llmgw.weights._manifest import compute_manifest
from llmgw.wire import NodeList, ReplicaList, from_json

__all__ = ["MODELS", "NemesisCluster", "SEED", "engine_processes", "signal_group"]

#: the models the clients load: two single-GPU models (one from a seed folder) and one on two nodes
MODELS = ("chat", "seeded", "big")
#: the distributable source of ``seeded``: its files are put in every node's seed folder
SEED = "seed:///data/seeded"


T = TypeVar("T")


class NemesisCluster:
    """A real cluster under ``root`` for one nemesis run; a fault :class:`~llmgw.testing.nemesis.Target`."""

    def __init__(
        self, root: Path, postgres: PostgresCluster, *, servers: int, agents: int, lost_after: float
    ) -> None:
        self.root = root
        self.postgres = postgres
        self.database = postgres.create_database()
        self.local = LocalCluster(
            root / "cluster", server_port=free_port(), lost_after=lost_after, poll_timeout=1
        )
        self.ports = [self.local.server_port] + [free_port() for _ in range(servers - 1)]
        self.local.server_url = ",".join(f"https://127.0.0.1:{p}" for p in self.ports)
        self.servers: dict[str, object] = {}
        self.agents = agents
        #: the catalog's moving parts: tokens per second, replicas of chat, whether ``spare`` is in it
        self.tps, self.chat, self.spare = 400, 2, False
        self.lock = threading.Lock()
        #: (time, model -> ready replica ids), as sampled
        self.ready: list[tuple[float, dict[str, frozenset[str]]]] = []
        #: shards seen ready for the first time, with the digest of the files they run on
        self.runs: list[ReplicaRun] = []
        self.last: ReplicaList | None = None
        self._seen_runs: set[tuple[str, int, str]] = set()
        #: (replica, attempt, node) -> when a shard of it was first sampled, in any state
        self._first_seen: dict[tuple[str, int, str], float] = {}
        self.seed_truth = ""
        self._http = self._sampler_client()

    # -- building ------------------------------------------------------------------------------

    def start(self, *, together: bool = True, timeout: float = 300) -> None:
        """Start the servers, agents and gateway; apply the catalog; wait until every replica is ready.

        :param together: start every server at once (the moment two can take a new database's first
            lease); False: the first leads before the others start.
        :raises ClusterError: a part did not start, or the replicas were not ready within ``timeout``.
        """
        models = self.root / "models"
        for name in ("chat", "big", "spare"):
            (models / name).mkdir(parents=True, exist_ok=True)
        pristine = self.root / "seed-files"
        pristine.mkdir(parents=True, exist_ok=True)
        (pristine / "config.json").write_text('{"model_type": "sim"}\n')
        (pristine / "weights.bin").write_bytes(bytes(range(256)) * 256)
        self.seed_truth = compute_manifest(pristine, SEED).digest
        leads = lambda: self.local.client.request("GET", "/v1/admin/nodes", NodeList)  # noqa: E731
        for index in range(1, len(self.ports) + 1):  # roles made now: a server restarted later finds its own
            self.postgres.sql(f"CREATE ROLE {self.server_name(index).replace('-', '_')} SUPERUSER LOGIN")
        for index in range(1, len(self.ports) + 1):
            self.start_server(index)
            if not together:
                self.local.wait(leads, "a leader", timeout)
        self.local.wait(leads, "a leader", timeout)
        for index in range(1, self.agents + 1):
            node = self.local.add_node(index)
            self.fill_seed(node)
            self.local.start_agent(node)
        self.local.start_gateway(free_port())
        self.apply_catalog()
        self.local.wait(self.local.all_ready, "every replica to be ready", timeout)

    def start_server(self, index: int) -> None:
        """Start server ``index`` (1-based) on its port, as its own PostgreSQL role (which the log names)."""
        name = self.server_name(index)
        role = name.replace("-", "_")
        self.local.store = self.postgres.url(self.database).replace(f"{SUPERUSER}@", f"{role}@")
        self.servers[name] = self.local.start_server(port=self.ports[index - 1], name=name)

    @staticmethod
    def server_name(index: int) -> str:
        """``server-a``, ``server-b``..."""
        return f"server-{chr(ord('a') + index - 1)}"

    def catalog_text(self) -> str:
        """The catalog as the moving parts stand now."""
        models = {
            "chat": model("{models}/chat", replicas=self.chat),
            "seeded": model(SEED, replicas=2),
            "big": model("{models}/big", "two", replicas=1),
        }
        if self.spare:
            models["spare"] = model("{models}/spare", replicas=1)
        fast = sim_profile(1, "--time-to-first-token", "0.02", "--tokens-per-second", str(self.tps))
        return catalog_yaml(models, one=fast, two=sim_profile(2, nodes=2)).format(models=self.root / "models")

    def wanted(self) -> dict[str, int]:
        """model -> replicas the catalog in force asks for."""
        return {"chat": self.chat, "seeded": 2, "big": 1} | ({"spare": 1} if self.spare else {})

    def apply_catalog(self, *, prune: bool = False) -> None:
        """Apply :meth:`catalog_text` (``prune``: a model may go)."""
        self.local.apply(self.catalog_text(), prune=prune)

    def fill_seed(self, node: LocalNode) -> None:
        """Put the seed's files in ``node``'s seed folder (again)."""
        folder = self.seed_folder(node)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(self.root / "seed-files", folder)

    def seed_folder(self, node: LocalNode) -> Path:
        """Where ``node`` keeps the files of :data:`SEED`."""
        return node.seed_root / SEED.removeprefix("seed:///")

    def _sampler_client(self) -> httpx.Client:
        tls = self.local.admin_tls
        context = client_ssl_context(tls.cert_path, tls.key_path, self.local.ca.cert_path)
        return httpx.Client(verify=context, timeout=3.0)  # a paused server must not stall the samples long

    # -- sampling ------------------------------------------------------------------------------

    def sample(self) -> None:
        """Record the ready replicas of each model, and the files every shard newly ready runs on.

        Called every second by the run's sampler thread; a control plane that does not answer is skipped.
        """
        replicas = self.leader_replicas()
        if replicas is None:
            return
        now = time.time()
        ready: dict[str, set[str]] = {}
        for replica in replicas.replicas:
            if replica.state == "ready":
                ready.setdefault(replica.model, set()).add(replica.id)
            if replica.model != "seeded":
                continue
            for shard in replica.shards:
                key = (replica.id, replica.attempt, shard.node)
                self._first_seen.setdefault(key, now)
                if shard.state != "ready" or key in self._seen_runs:
                    continue
                self._seen_runs.add(key)
                folder = _model_arg(shard.argv)
                if folder is None:
                    continue
                try:
                    digest = compute_manifest(Path(folder), SEED).digest
                except (OSError, ValueError) as exc:
                    digest = f"unreadable ({exc})"
                with self.lock:
                    self.runs.append(
                        ReplicaRun(replica.id, shard.node, SEED, folder, digest, now, self._first_seen[key])
                    )
        with self.lock:
            self.last = replicas
            self.ready.append((now, {m: frozenset(ids) for m, ids in ready.items()}))

    def leader_replicas(self) -> ReplicaList | None:
        """``GET /v1/admin/replicas`` of the leader (a standby's has no pids); None when none answers."""
        return self.leader_read("/v1/admin/replicas", ReplicaList)

    def leader_read(self, path: str, kind: type[T]) -> T | None:
        """``GET path`` of the leader, as ``kind``: never a standby's view (it has no pids, and it may
        be behind); None when no leader answers."""
        for port in self.ports:
            try:
                response = self._http.get(f"https://127.0.0.1:{port}{path}")
            except httpx.HTTPError:
                continue
            if response.status_code == 200 and STANDBY_HEADER not in response.headers:
                return from_json(response.json(), kind)
        return None

    def on_node(self, node_id: str) -> frozenset[str]:
        last = self.last
        if last is None:
            return frozenset()
        return frozenset(r.id for r in last.replicas if any(s.node == node_id for s in r.shards))

    def agents_up(self, busy: set[str]) -> frozenset[str]:
        """The nodes whose agent process runs, but those under a fault (``busy``: paused, revoked...)."""
        return frozenset(
            n.node_id for n in self.local.nodes.values()
            if n.process is not None and n.process.poll() is None and n.node_id not in busy
        )  # fmt: skip

    def stop(self) -> None:
        """End every process group: cluster, engines left by killed agents, PostgreSQL's database."""
        for pid in (
            list(self.servers.values())
            + [n.process for n in self.local.nodes.values()]
            + [self.local.gateway]
        ):
            if pid is not None and pid.poll() is None:
                signal_group(pid.pid, signal.SIGCONT)
        with contextlib.suppress(Exception):
            self.local.stop_all()
        for pid in engine_processes(self.root):
            signal_group(os.getpgid(pid) if _exists(pid) else pid, signal.SIGKILL)
        self._http.close()


def engine_processes(root: Path) -> set[int]:
    """Pids of the ``llmgw-sim`` processes logging under ``root``: the run's engines, whoever started them."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if not any(a.endswith(b"llmgw-sim") for a in argv[:2]):
                continue
            log = os.readlink(f"/proc/{entry}/fd/2")
        except OSError:
            continue
        if log.startswith(str(root)):
            found.add(int(entry))
    return found


def _exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _model_arg(argv: tuple[str, ...]) -> str | None:
    """The value of ``--model`` in an engine's argv (the folder it runs on)."""
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == "--model":
            return value
    return None


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; nothing when it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
