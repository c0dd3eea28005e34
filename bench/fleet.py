"""How the control plane holds a fleet: N agents against a real ``llmgw server``.

Run with ``python bench/fleet.py`` (``--sizes 100,250`` and ``--steady 30``
for a shorter run). For each size it starts a real ``llmgw server`` (sqlite
state, mutual TLS, default heartbeat and lost-after) and N light agents that
speak the real sync protocol over real mutual TLS, each with its own node
certificate, many per process: they report 8 fake GPUs and report every shard
the server gives them as ready at once (no engines run). Then:

- waits for every node to register, applies a catalog of two replicas per
  node, and times ``apply`` → every replica reported ready;
- holds the fleet steady for ``--steady`` seconds: server CPU (cores),
  syncs/s, sync round trip beyond the long-poll wait (p50/p99, syncs whose
  answer did not change), nodes wrongly declared lost;
- stops one agent and times its replicas ready elsewhere (lost-after included);
- kills the server (SIGKILL), restarts it, and times its first answer to
  ``ctl replicas`` and the first full one;
- throughout, times ``ctl replicas`` (the admin API) every two seconds.

The CPU growth column is relative to the first size, measured in the same
run. It asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = (100, 250, 500, 1000)
AGENTS_PER_PROCESS = 250
GPUS_PER_NODE = 8
MODELS = 10
POLL_TIMEOUT = 5.0


# -- the light agents (run in child processes: ``fleet.py agents ...``) -------------------------


def run_agents(args: argparse.Namespace) -> None:
    """Run agents ``first`` .. ``first + count - 1`` until SIGTERM; then write their figures to ``--out``."""
    import trio

    from llmgw.net.client import ConnectionPool
    from llmgw.pki import client_ssl_context
    from llmgw.testing.nodes import sim_node_sync
    from llmgw.wire import ObservedShard, to_json

    certs = Path(args.certs)
    url = f"{args.server}/v1/agent/sync"
    beyond: list[tuple[float, float]] = []
    syncs: list[float] = []
    connections = [0]
    errors: list[tuple[float, str]] = []

    async def agent(number: int) -> None:
        node_id = f"node-{number:04}"
        tls = certs / node_id
        context = client_ssl_context(tls / "node.pem", tls / "node.key", certs / "ca.pem")
        sources = tuple(f"/models/m{m}" for m in range(MODELS))
        revision = 0
        observed: tuple[ObservedShard, ...] = ()
        body = b""
        built_for: tuple[int, int] | None = None
        failures = 0
        await trio.sleep(random.uniform(0, args.stagger))
        async with ConnectionPool(ssl_context=context, read_timeout=POLL_TIMEOUT + 30) as pool:
            try:
                while True:
                    if built_for != (revision, len(observed)):
                        request = sim_node_sync(
                            node_id,
                            gpus=GPUS_PER_NODE,
                            address=f"10.{number // 250}.{number % 250}.1",
                            port_range=(20000, 20999),
                            sources=sources,
                            observed=observed,
                            revision=revision,
                            wait=True,
                        )
                        body = json.dumps(to_json(request)).encode()
                        built_for = (revision, len(observed))
                    started = trio.current_time()
                    try:
                        response = await pool.request(
                            "POST", url, headers=[("content-type", "application/json")], body=body
                        )
                    except Exception as exc:  # noqa: BLE001 - counted and retried, as an agent does
                        errors.append((time.time(), type(exc).__name__))
                        failures += 1
                        await trio.sleep(_backoff(failures))
                        continue
                    elapsed = trio.current_time() - started
                    syncs.append(time.time())
                    if response.status != 200:
                        errors.append((time.time(), f"HTTP {response.status}"))
                        failures += 1
                        await trio.sleep(_backoff(failures))
                        continue
                    failures = 0
                    reply = response.json()
                    if reply["revision"] == revision:
                        beyond.append((time.time(), max(0.0, elapsed - POLL_TIMEOUT)))
                        continue
                    revision = reply["revision"]
                    observed = tuple(
                        ObservedShard(s["replica_id"], s["attempt"], s["rank"], "ready", pid=1, port=20000)
                        for s in reply["shards"]
                    )
            finally:
                connections[0] += pool.connections_opened

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                for number in range(args.first, args.first + args.count):
                    nursery.start_soon(agent, number)
                async for _ in signals:
                    break
                nursery.cancel_scope.cancel()

    trio.run(main)
    figures = {"beyond": beyond, "syncs": syncs, "errors": errors, "connections": connections[0]}
    Path(args.out).write_text(json.dumps(figures))


def _backoff(failures: int) -> float:
    """The agent's retry delay (llmgw.agent.config defaults): 0.25 s doubling to 5 s, with jitter."""
    delay = min(5.0, 0.25 * 2 ** min(failures - 1, 30))
    return random.uniform(delay / 2, delay)


# -- the coordinator --------------------------------------------------------------------------------


class Fleet:
    """One size's server, agents and admin client, all under ``root``."""

    def __init__(self, root: Path, certs: Path, size: int, port: int) -> None:
        from llmgw.ctl.client import AdminClient, ClientConfig

        self.root, self.certs, self.size, self.port = root, certs, size, port
        root.mkdir(parents=True, exist_ok=True)
        self.url = f"https://127.0.0.1:{port}"
        self.admin = AdminClient(
            ClientConfig(
                self.url, certs / "ca.pem", certs / "admin" / "admin.pem", certs / "admin" / "admin.key"
            )
        )
        self.server: subprocess.Popen | None = None
        self.agents: list[tuple[subprocess.Popen, Path]] = []
        self.admin_latency: list[float] = []

    def start_server(self) -> None:
        """Start ``llmgw server`` on this size's state dir (again after a kill: same state)."""
        llmgw = Path(sys.executable).parent / "llmgw"
        log = (self.root / "server.log").open("ab")
        self.server = subprocess.Popen(
            [
                str(llmgw),
                "server",
                "--state-dir",
                str(self.root / "state"),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--cert",
                str(self.certs / "server" / "server.pem"),
                "--key",
                str(self.certs / "server" / "server.key"),
                "--ca",
                str(self.certs / "ca.pem"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start_agents(self, first: int, count: int, stagger: float) -> subprocess.Popen:
        """Start one process running agents ``first`` .. ``first + count - 1``."""
        out = self.root / f"agents-{first}.json"
        process = subprocess.Popen(
            [sys.executable, __file__, "agents", "--certs", str(self.certs), "--server", self.url]
            + ["--first", str(first), "--count", str(count), "--out", str(out), "--stagger", str(stagger)],
            start_new_session=True,
        )
        self.agents.append((process, out))
        return process

    def stop(self) -> None:
        """End every process of this size (whole groups), agents first so they write their figures."""
        for process, _ in self.agents:
            _signal(process, signal.SIGTERM)
        for process, _ in self.agents:
            _wait(process, 20)
        if self.server is not None:
            _signal(self.server, signal.SIGKILL)
            _wait(self.server, 10)

    def get(self, path: str, record: type) -> object:
        """An admin GET, timed into :attr:`admin_latency` when it is ``/v1/admin/replicas``."""
        started = time.perf_counter()
        result = self.admin.request("GET", path, record)
        if path == "/v1/admin/replicas":
            self.admin_latency.append(time.perf_counter() - started)
        return result

    def wait(self, done, what: str, timeout: float, every: float = 1.0) -> float:
        """Poll ``done()`` (admin calls) until true; returns the seconds it took."""
        started = time.monotonic()
        while not done():
            if time.monotonic() - started > timeout:
                raise SystemExit(f"size {self.size}: timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(every)
        return time.monotonic() - started


def _signal(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _wait(process: subprocess.Popen, seconds: float) -> None:
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        _signal(process, signal.SIGKILL)
        process.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def catalog(size: int) -> str:
    """Two one-GPU replicas per node, spread over ``MODELS`` models."""
    lines = ["profiles:", "  one:", "    engine: sim", "    gpus_per_node: 1", "models:"]
    per_model, extra = divmod(2 * size, MODELS)
    for m in range(MODELS):
        replicas = per_model + (m < extra)
        lines += [f"  m{m}:", f"    source: /models/m{m}", "    profile: one", f"    replicas: {replicas}"]
    return "\n".join(lines) + "\n"


def make_certs(directory: Path, count: int) -> None:
    """A CA, the server's, an admin's and ``count`` node certificates under ``directory``."""
    from llmgw import pki

    ca = pki.init_ca(directory / "ca", name="bench CA")
    (directory / "ca.pem").write_bytes(ca.cert_path.read_bytes())
    pki.issue_server(ca, ["127.0.0.1"], out=directory / "server")
    pki.issue_admin(ca, "bench-admin", out=directory / "admin")
    for number in range(count):
        pki.issue_node(ca, f"node-{number:04}", out=directory / f"node-{number:04}")


def run_size(root: Path, certs: Path, size: int, args: argparse.Namespace) -> dict:
    """Every figure for one fleet size."""
    from llmgw.testing.processes import free_port
    from llmgw.wire import ApplyCatalog, CatalogApplied, EventList, NodeList, ReplicaList

    fleet = Fleet(root, certs, size, free_port())
    figures: dict = {"nodes": size}
    try:
        fleet.start_server()
        # the last node runs alone, so it can be stopped without the others
        for first in range(0, size - 1, args.agents_per_process):
            fleet.start_agents(first, min(args.agents_per_process, size - 1 - first), args.stagger)
        lone = fleet.start_agents(size - 1, 1, 0)

        def registered() -> bool:
            try:
                return len(fleet.get("/v1/admin/nodes", NodeList).nodes) == size
            except Exception:  # noqa: BLE001 - the server is starting
                return False

        fleet.wait(registered, f"{size} nodes to register", 120 + size / 5)
        applied_at = time.monotonic()
        fleet.admin.request(
            "POST", "/v1/admin/catalog", CatalogApplied, body=ApplyCatalog(catalog(size), "bench")
        )

        def all_ready() -> bool:
            replicas = fleet.get("/v1/admin/replicas", ReplicaList).replicas
            return len(replicas) == 2 * size and all(r.state == "ready" for r in replicas)

        fleet.wait(all_ready, f"{2 * size} replicas ready", 300, every=0.5)
        figures["apply_to_ready_s"] = time.monotonic() - applied_at

        steady_from = time.time()
        cpu_from, wall_from = cpu_seconds(fleet.server.pid), time.monotonic()
        while time.monotonic() - wall_from < args.steady:
            fleet.get("/v1/admin/replicas", ReplicaList)
            time.sleep(2)
        figures["server_cores"] = (cpu_seconds(fleet.server.pid) - cpu_from) / (time.monotonic() - wall_from)
        steady_to = time.time()
        nodes = fleet.get("/v1/admin/nodes", NodeList).nodes
        events = fleet.admin.request("GET", "/v1/admin/events?limit=10000", EventList).events
        lost_events = {e.subject for e in events if e.kind == "node" and e.message.startswith("lost")}
        figures["wrongly_lost"] = len(lost_events | {n.node_id for n in nodes if n.state == "lost"})

        lone_node = f"node-{size - 1:04}"
        moved = [
            r.id
            for r in fleet.get("/v1/admin/replicas", ReplicaList).replicas
            if any(s.node == lone_node for s in r.shards)
        ]
        _signal(lone, signal.SIGKILL)
        stopped_at = time.monotonic()

        def moved_elsewhere() -> bool:
            replicas = {r.id: r for r in fleet.get("/v1/admin/replicas", ReplicaList).replicas}
            return all(
                r in replicas
                and replicas[r].state == "ready"
                and all(s.node != lone_node for s in replicas[r].shards)
                for r in moved
            )

        fleet.wait(moved_elsewhere, f"{lone_node}'s replicas ready elsewhere", 180)
        figures["failover_s"] = time.monotonic() - stopped_at

        _signal(fleet.server, signal.SIGKILL)
        _wait(fleet.server, 10)
        fleet.start_server()
        restarted_at = time.monotonic()
        first_answer = full_answer = None
        while full_answer is None and time.monotonic() - restarted_at < 120:
            try:
                count = len(fleet.admin.request("GET", "/v1/admin/replicas", ReplicaList).replicas)
                first_answer = first_answer or time.monotonic() - restarted_at
                if count >= 2 * size - 2:
                    full_answer = time.monotonic() - restarted_at
            except Exception as exc:  # noqa: BLE001 - a 503 "starting" is an answer; refused is not
                if "starting" in str(exc):
                    first_answer = first_answer or time.monotonic() - restarted_at
            time.sleep(0.05)
        figures["restart_first_answer_s"] = first_answer
        figures["restart_full_answer_s"] = full_answer
    finally:
        fleet.stop()
    beyond: list[float] = []
    syncs = errors = connections = 0
    for _, out in fleet.agents:
        if not out.exists():
            continue
        data = json.loads(out.read_text())
        beyond += [b for at, b in data["beyond"] if steady_from <= at <= steady_to]
        syncs += sum(1 for at in data["syncs"] if steady_from <= at <= steady_to)
        errors += sum(1 for at, _ in data["errors"] if steady_from <= at <= steady_to)
        connections += data["connections"]
    figures["syncs_per_s"] = syncs / max(1e-9, steady_to - steady_from)
    figures["rtt_p50_ms"] = 1000 * statistics.median(beyond) if beyond else None
    figures["rtt_p99_ms"] = 1000 * _quantile(beyond, 0.99) if beyond else None
    figures["agent_errors"] = errors
    figures["connections"] = connections
    latency = fleet.admin_latency
    figures["admin_p50_ms"] = 1000 * statistics.median(latency)
    figures["admin_max_ms"] = 1000 * max(latency)
    return figures


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    """Parse the command line and run the agents (child) or the whole benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    agents = sub.add_parser("agents", help="(internal) run light agents until SIGTERM")
    for name in ("--certs", "--server", "--out"):
        agents.add_argument(name, required=True)
    agents.add_argument("--first", type=int, required=True)
    agents.add_argument("--count", type=int, required=True)
    agents.add_argument("--stagger", type=float, default=5.0)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--steady", type=float, default=60.0, help="seconds of steady state per size")
    parser.add_argument("--agents-per-process", type=int, default=AGENTS_PER_PROCESS)
    parser.add_argument("--stagger", type=float, default=10.0, help="agents start over this many seconds")
    args = parser.parse_args()
    if args.command == "agents":
        run_agents(args)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="llmgw-fleet-") as tmp:
        root = Path(tmp)
        print(f"issuing {max(sizes)} node certificates ...", flush=True)
        make_certs(root / "certs", max(sizes))
        rows = []
        for size in sizes:
            print(f"fleet of {size} nodes ...", flush=True)
            rows.append(run_size(root / f"size-{size}", root / "certs", size, args))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows, args.steady)


def print_table(rows: list[dict], steady: float) -> None:
    """The figures, one row per size, with CPU growth against the first size."""
    print(
        f"\nfleet benchmark: Python {sys.version.split()[0]}, {os.cpu_count()} cores, steady {steady:.0f} s,"
        f" heartbeat = long-poll {POLL_TIMEOUT:.0f} s"
    )
    header = (
        f"{'nodes':>6} {'cores':>6} {'cpu x':>6} {'syncs/s':>8} {'rtt p50':>8} {'rtt p99':>8}"
        f" {'lost':>5} {'ready s':>8} {'failover':>9} {'restart':>8} {'full':>6} {'ctl p50':>8}"
        f" {'ctl max':>8} {'errors':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        growth = r["server_cores"] / rows[0]["server_cores"]
        print(
            f"{r['nodes']:>6} {r['server_cores']:>6.3f} {growth:>6.2f} {r['syncs_per_s']:>8.1f}"
            f" {_ms(r['rtt_p50_ms']):>8} {_ms(r['rtt_p99_ms']):>8} {r['wrongly_lost']:>5}"
            f" {r['apply_to_ready_s']:>8.1f} {r['failover_s']:>8.1f}s {_s(r['restart_first_answer_s']):>8}"
            f" {_s(r['restart_full_answer_s']):>6} {r['admin_p50_ms']:>6.0f}ms {r['admin_max_ms']:>6.0f}ms"
            f" {r['agent_errors']:>7}"
        )
    print(
        "\ncores: server CPU at steady state; cpu x: its growth relative to the first size (compare nodes);"
        "\nrtt: sync round trip beyond the long-poll wait;\nlost: nodes wrongly declared lost;"
        " ready s: apply -> every replica ready;"
        "\nfailover: an agent stopped -> its replicas ready elsewhere (lost-after 30 s included);"
        "\nrestart: server SIGKILLed and restarted -> first answer to ctl replicas (503 'starting' counts),"
        " full: -> the full list; ctl: ctl replicas latency throughout."
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}ms"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


if __name__ == "__main__":
    main()
