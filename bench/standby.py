"""What a standby's view of the store costs: ``python bench/standby.py``.

For each fleet size it fills a throwaway PostgreSQL (``initdb``, as the tests
do) with a cluster of N nodes (8 GPUs each) and two single-GPU replicas per
node, placed by the real scheduler and stored by the real flush, then runs a
standby's view (:class:`llmgw.server.ha.standby.StandbyView`) on it and prints:

- the time one view takes to read (the cluster and API keys, in one
  REPEATABLE READ transaction) and to build (a server app over it);
- the lag from a write of the leader (an API key) committing to the view
  holding it, p50 and max over ``--writes`` writes, each after the last
  was seen: NOTIFY wakes the view, which reads the whole cluster again.

Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import trio

from llmgw.catalog import parse_catalog
from llmgw.server.ha.standby import StandbyView
from llmgw.server.persist.cluster import add_api_key, flush
from llmgw.server.persist.postgres import open_pg_store
from llmgw.server.reconciler import reconcile
from llmgw.server.state.cluster import ClusterState, Settings
from llmgw.testing.catalogs import catalog_yaml, model
from llmgw.testing.nodes import sim_node_sync
from llmgw.testing.postgres import PostgresCluster, find_postgres_bin


def fleet(size: int, engines: dict) -> ClusterState:
    """A cluster of ``size`` nodes with two replicas per node, placed."""
    cluster = ClusterState(Settings())
    now = time.time()
    for index in range(size):
        node_id = f"node-{index:05d}"
        address = f"10.{index // 65536}.{index // 256 % 256}.{index % 256}"
        request = sim_node_sync(node_id, gpus=8, address=address, revision=0, wait=False)
        cluster.sync(request, now)
    text = catalog_yaml({"chat": model("tiny/model", replicas=2 * size)})
    cluster.apply_catalog(parse_catalog(text, engines), text, now, "bench")
    reconcile(cluster, now)
    return cluster


async def changed(view: StandbyView, check) -> None:
    """Wait until ``check()`` holds, looking each time the view changes."""
    while not check():
        await view._changed.wait()


async def measure(url: str, size: int, writes: int) -> dict:
    from llmgw_engine_sim import SimEngine

    engines = {"sim": SimEngine()}
    leader, reader = open_pg_store(url), open_pg_store(url)
    try:
        cluster = fleet(size, engines)
        await leader.write(lambda conn: flush(conn, cluster, time.time()))
        view = StandbyView(reader, engines, Settings())
        async with trio.open_nursery() as nursery:
            following = await nursery.start(view.follow)
            with trio.fail_after(120):
                await changed(view, lambda: view.view is not None)
            reads = []
            for _ in range(3):
                started = time.perf_counter()
                await view._reload(view.view.revision)
                reads.append(time.perf_counter() - started)
            lags = []
            for number in range(writes):
                name = f"key-{number}"
                digest = f"{number:064x}"
                await leader.write(lambda conn, n=name, d=digest: add_api_key(conn, n, d, 1.0, "bench"))
                committed = time.perf_counter()
                with trio.fail_after(120):
                    await changed(view, lambda n=name: n in view.view.app.keys)
                lags.append(time.perf_counter() - committed)
            following.cancel()
        replicas = len(view.view.app.cluster.replicas)
        return {"size": size, "replicas": replicas, "read": statistics.median(reads), "lags": lags}
    finally:
        leader.close()
        reader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000", help="fleet sizes (nodes), comma-separated")
    parser.add_argument("--writes", type=int, default=20)
    args = parser.parse_args()
    bindir = find_postgres_bin()
    if bindir is None:
        raise SystemExit("PostgreSQL is not installed (apt-get install postgresql)")
    postgres = PostgresCluster(Path(tempfile.mkdtemp(prefix="llmgw-pg-")), bindir)
    try:
        postgres.start()
        print(f"{'nodes':>6} {'replicas':>9} {'view read':>10} {'lag p50':>8} {'lag max':>8}")
        for size in (int(s) for s in args.sizes.split(",")):
            row = trio.run(measure, postgres.url(postgres.create_database()), size, args.writes)
            print(
                f"{row['size']:>6} {row['replicas']:>9} {row['read'] * 1000:>8.0f}ms "
                f"{statistics.median(row['lags']) * 1000:>6.0f}ms {max(row['lags']) * 1000:>6.0f}ms",
                flush=True,
            )
    finally:
        postgres.stop()


if __name__ == "__main__":
    main()
