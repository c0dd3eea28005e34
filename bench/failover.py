"""Leader kills under load, and what they cost: ``python bench/failover.py``.

It starts a throwaway PostgreSQL (``initdb``, as the tests do; or uses
``--store URL``), ``--servers`` ``llmgw server`` processes on it, ``--nodes``
agents running the sim engine, ``llmgw gateway``, a model of ``--replicas``
single-node replicas, and ``--clients`` clients (half streaming) sending chat
completions through the gateway without pause; every client of the control
plane knows every server. Then ``--kills`` times: ``kill -9`` the leader,
wait until another server leads (its admin API answers and the events say
so) and every shard is reported to it again, restart the killed server (a
standby now). It prints:

- takeover time (kill to a new leader answering) p50 and max, and within it the time to the new
  leader's event (written as soon as it took the lease);
- requests served and failed during the whole run (failed must be 0);
- shards whose engine PID changed (must be 0).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import chat_catalog
from llmgw.testing.load import GatewayLoad
from llmgw.testing.postgres import PostgresCluster, find_postgres_bin
from llmgw.testing.processes import free_port
from llmgw.wire import EventList


def pids(local: LocalCluster) -> dict[tuple[str, int], int | None]:
    """(replica, rank) -> engine PID as the leader reports it."""
    return {(r.id, s.rank): s.pid for r in local.replicas().replicas for s in r.shards}


def last_leader(local: LocalCluster) -> tuple[int, str, float]:
    """The newest 'leader' event: its id, its subject (the server that leads) and when (time.time())."""
    events = local.client.request("GET", "/v1/admin/events", EventList).events
    return max((e.id, e.subject, e.at) for e in events if e.kind == "leader")


def run(args: argparse.Namespace, store: str, root: Path) -> None:
    ports = [free_port() for _ in range(args.servers)]
    urls = [f"https://127.0.0.1:{port}" for port in ports]
    local = LocalCluster(root / "cluster", server_port=ports[0], lost_after=10, poll_timeout=1, store=store)
    local.server_url = ",".join(urls)
    processes = {}
    try:
        (root / "models" / "chat").mkdir(parents=True)
        processes[urls[0]] = local.start_server()
        local.wait(lambda: local.client.request("GET", "/v1/admin/nodes") is not None, "a server to lead")
        for index, port in enumerate(ports[1:], start=2):
            processes[urls[index - 1]] = local.start_server(port=port, name=f"server-{index}")
        for index in range(1, args.nodes + 1):
            local.start_agent(local.add_node(index))
        local.start_gateway(free_port())
        local.apply(chat_catalog(args.replicas).format(models=root / "models"))
        local.wait(local.all_ready, "every replica to be ready")
        before = pids(local)
        takeovers: list[float] = []
        #: kill to the new leader's event (written right after it took the lease)
        elections: list[float] = []
        with GatewayLoad(local.gateway_url, args.clients) as load:
            local.wait(lambda: load.ok >= 50, "the load to get going", 60)
            for kill in range(1, args.kills + 1):
                event, leader, _ = last_leader(local)
                killed, killed_at = time.monotonic(), time.time()
                local.stop(processes[leader], signal.SIGKILL)
                local.wait(lambda e=event: last_leader(local)[0] > e, "another server to lead", 60)
                takeovers.append(time.monotonic() - killed)
                _, new, elected_at = last_leader(local)
                elections.append(elected_at - killed_at)

                def adopted() -> bool:
                    now = pids(local)
                    return local.all_ready() and all(now.get(key) for key in before)

                local.wait(adopted, "every shard to be reported to the new leader", 60)
                print(
                    f"kill {kill}: {leader} -> {new} in {takeovers[-1]:.1f} s "
                    f"(took the lease after {elections[-1]:.1f} s)",
                    flush=True,
                )
                index = urls.index(leader)
                processes[leader] = local.start_server(port=ports[index], name=f"server-{index + 1}-{kill}")
            served = load.ok
            local.wait(lambda: load.ok >= served + 50, "more requests after the last kill", 60)
        after = pids(local)
        restarted = sum(1 for key, pid in before.items() if after.get(key) != pid)
        print(
            f"{args.kills} leader kills, {args.servers} servers, lease 6 s: takeover p50 "
            f"{statistics.median(takeovers):.1f} s, max {max(takeovers):.1f} s (lease taken after p50 "
            f"{statistics.median(elections):.1f} s, max {max(elections):.1f} s); "
            f"requests {load.ok} served, {len(load.failures)} failed; "
            f"shards restarted {restarted} of {len(before)}"
        )
        if load.failures:
            print("first failures:", load.failures[:5])
    finally:
        local.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="a postgresql:// URL to use instead of a throwaway cluster")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--kills", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-failover-") as tmp:
        if args.store:
            run(args, args.store, Path(tmp))
            return
        bindir = find_postgres_bin()
        if bindir is None:
            sys.exit("PostgreSQL is not installed (apt-get install postgresql), or pass --store URL")
        postgres = PostgresCluster(Path(tempfile.mkdtemp(prefix="llmgw-pg-")), bindir)
        try:
            postgres.start()
            run(args, postgres.url(postgres.create_database()), Path(tmp))
        finally:
            postgres.stop()


if __name__ == "__main__":
    main()
