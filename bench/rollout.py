"""How long a rollout takes under load, and what it costs the clients: ``python bench/rollout.py``.

It starts a real local cluster (``llmgw server``, ``--nodes`` agents running
the sim engine, ``llmgw gateway``), a model of ``--replicas`` single-node
replicas, and ``--clients`` clients (half streaming) sending chat
completions through the gateway without pause. After a steady window of
``--seconds`` it applies a catalog that changes the profile's args, and
waits until every replica was replaced (the rollout is ``done``, every
replica ready and running the new args). It does that once per
``--max-surge`` value given. It prints, per run:

- the time from apply to the rollout being done, and per replica;
- requests served and failed during the rollout (failed must be 0);
- throughput during the rollout as a fraction of the steady window before it
  (the same clients, the same cluster, measured in the same run).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.load import GatewayLoad
from llmgw.testing.processes import free_port
from llmgw.wire import RolloutList

CATALOG = """
profiles:
  one:
    engine: sim
    gpus_per_node: 1
    args: ["--time-to-first-token", "0.02", "--tokens-per-second", "400"{extra}]
models:
  chat:
    source: {models}/chat
    profile: one
    replicas: {replicas}
    rollout: {{max_surge: {surge}, max_unavailable: 0}}
"""


def rolled(cluster: LocalCluster, marker: str) -> bool:
    """Every replica of the model ready, not outdated, with ``marker`` in its command; the rollout done."""
    rollout = cluster.client.request("GET", "/v1/admin/rollouts", RolloutList).rollouts[0]
    replicas = cluster.replicas().replicas
    return rollout.state == "done" and all(
        r.state == "ready" and not r.outdated and not r.replaces and marker in r.shards[0].argv
        for r in replicas
    )


def run(args: argparse.Namespace, surge: int, root: Path) -> None:
    models = root / "models"
    (models / "chat").mkdir(parents=True)
    cluster = LocalCluster(root / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    try:
        cluster.start(args.nodes)
        cluster.start_gateway(free_port())
        text = CATALOG.format(models=models, replicas=args.replicas, surge=surge, extra="")
        cluster.apply(text)
        cluster.wait(cluster.all_ready, "every replica to be ready", 180)
        with GatewayLoad(cluster.gateway_url, args.clients) as load:
            cluster.wait(lambda: load.counts()[0] >= args.clients * 2, "the load to get going", 60)
            ok0, _ = load.counts()
            start = time.monotonic()
            time.sleep(args.seconds)
            steady_rate = (load.counts()[0] - ok0) / (time.monotonic() - start)
            ok1, failed1 = load.counts()
            start = time.monotonic()
            new = CATALOG.format(
                models=models, replicas=args.replicas, surge=surge, extra=', "--max-model-len", "8192"'
            )
            cluster.apply(new, "new.yaml")
            cluster.wait(lambda: rolled(cluster, "8192"), "the rollout to be done", args.timeout)
            took = time.monotonic() - start
            ok2, failed2 = load.counts()
        served, failed = ok2 - ok1, failed2 - failed1
        print(
            f"max_surge {surge}: rolled {args.replicas} replicas in {took:.1f} s "
            f"({took / args.replicas:.1f} s per replica); during the rollout {served} requests served, "
            f"{failed} failed; throughput {served / took / steady_rate:.2f} x the steady "
            f"{steady_rate:.0f} req/s"
        )
        for error in load.failures[:5]:
            print(f"  failed: {error}")
    finally:
        cluster.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, help="agents (each 8 fake GPUs; default 3)")
    parser.add_argument("--replicas", type=int, default=4, help="replicas of the model (default 4)")
    parser.add_argument("--clients", type=int, default=16, help="clients, half streaming (default 16)")
    parser.add_argument("--seconds", type=float, default=5, help="steady window before the apply (default 5)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a rollout may take (default 300)")
    parser.add_argument(
        "--max-surge",
        type=int,
        nargs="+",
        default=[1, 2],
        help="max_surge values, one run each (default 1 2)",
    )
    args = parser.parse_args()
    for surge in args.max_surge:
        with tempfile.TemporaryDirectory(prefix="llmgw-bench-rollout-") as root:
            run(args, surge, Path(root))


if __name__ == "__main__":
    main()
