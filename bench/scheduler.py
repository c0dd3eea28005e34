"""How long the scheduler takes, and how that grows with the cluster.

Run with ``python bench/scheduler.py`` (``--quick`` for a smaller, faster run).
It builds synthetic clusters of 8-GPU nodes on several fabrics (64 nodes per
fabric, 1 node in 20 an island, 1 in 25 missing one model's weights) and a
catalog with two replicas per node (single-node profiles of 1, 2, 4 and 8 GPUs
and a two-node 8-GPU one). For each size it measures:

- ``place``: scheduling everything from no placements;
- ``re-run``: the same call with its own result as input (nothing changes);
- ``lost``: the result again with one node declared lost (its replicas move);

each the median of several runs, with the growth relative to the 100-node
baseline measured in the same run. It asserts nothing about time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import attrs

from llmgw.models import GPU, Catalog, Fabric, Model, NodeFacts, Profile
from llmgw.scheduler import NodeView, ScheduleResult, schedule

SIZES = (100, 250, 500, 1000)
NODES_PER_FABRIC = 64
REPLICAS_PER_NODE = 2
#: profile -> share of the replicas; about 80% of the GPUs end up used
MIX = {"tp1": 0.40, "tp2": 0.25, "tp4": 0.20, "tp8": 0.10, "tp8x2": 0.05}
MODELS_PER_PROFILE = 4


def make_nodes(count: int) -> list[NodeView]:
    """``count`` ready nodes with 8 GPUs of 80 GiB each, on fabrics of 64 nodes, some of them islands."""
    nodes = []
    for number in range(count):
        node_id = f"node-{number:04}"
        fabrics = (
            ()
            if number % 20 == 19
            else (Fabric(f"ib-{number // NODES_PER_FABRIC:02}", ("mlx5_0", "mlx5_1")),)
        )
        sources = tuple(
            f"/models/{name}" for name in model_names() if not (number % 25 == 0 and name == "m-tp1-0")
        )
        facts = NodeFacts(
            node_id=node_id,
            agent_version="0.1.0",
            gpus=tuple(
                GPU(i, f"GPU-{number}-{i}", "H100", 81559, 81000, f"0000:{i:02x}:00.0", "550")
                for i in range(8)
            ),
            fabrics=fabrics,
            engines={"vllm": "0.8.5"},
            model_sources=sources,
        )
        nodes.append(
            NodeView(facts=facts, address=f"10.{number // 256}.{number % 256}.1", port_range=(20000, 20999))
        )
    return nodes


def model_names() -> list[str]:
    """The catalog's model names, ``MODELS_PER_PROFILE`` per profile."""
    return [f"m-{profile}-{n}" for profile in MIX for n in range(MODELS_PER_PROFILE)]


def make_catalog(node_count: int) -> Catalog:
    """A catalog asking for ``REPLICAS_PER_NODE`` replicas per node, split over profiles as in ``MIX``."""
    profiles = {
        "tp1": Profile("vllm", gpus_per_node=1),
        "tp2": Profile("vllm", gpus_per_node=2),
        "tp4": Profile("vllm", gpus_per_node=4, min_gpu_memory_mib=40000),
        "tp8": Profile("vllm", gpus_per_node=8),
        "tp8x2": Profile("vllm", nodes=2, gpus_per_node=8),
    }
    total = node_count * REPLICAS_PER_NODE
    models = {}
    for profile, share in MIX.items():
        per_model = round(total * share / MODELS_PER_PROFILE)
        for n in range(MODELS_PER_PROFILE):
            name = f"m-{profile}-{n}"
            models[name] = Model(source=f"/models/{name}", profile=profile, replicas=per_model)
    return Catalog(profiles=profiles, models=models)


def median_seconds(call: Callable[[], object], repeat: int) -> float:
    """The median wall time of ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@attrs.frozen
class Row:
    nodes: int
    replicas: int
    placed: int
    unplaced: int
    gpus_used: float
    place: float
    rerun: float
    lost: float


def measure(node_count: int, repeat: int) -> Row:
    """Schedule one synthetic cluster and time the three runs."""
    nodes = make_nodes(node_count)
    catalog = make_catalog(node_count)
    result: ScheduleResult = schedule(nodes, catalog, [])
    again = schedule(nodes, catalog, result.placements)
    assert again == result, "a re-run with its own output must change nothing"
    victim = result.placements[0].node_ids[0]
    lost_nodes = [attrs.evolve(view, state="lost") if view.node_id == victim else view for view in nodes]
    used = sum(len(shard.gpus) for replica in result.placements for shard in replica.shards)
    return Row(
        nodes=node_count,
        replicas=sum(model.replicas for model in catalog.models.values()),
        placed=len(result.placements),
        unplaced=len(result.unplaced),
        gpus_used=used / (8 * node_count),
        place=median_seconds(lambda: schedule(nodes, catalog, []), repeat),
        rerun=median_seconds(lambda: schedule(nodes, catalog, result.placements), repeat),
        lost=median_seconds(lambda: schedule(lost_nodes, catalog, result.placements), repeat),
    )


def many_models(node_count: int, repeat: int) -> tuple[int, int, float]:
    """Time the worst catalog shape for this scheduler: one replica each of two models per node.

    The work per model is a pass over the nodes, so many small models cost more than a
    few large ones with the same number of replicas.
    """
    nodes = make_nodes(node_count)
    catalog = Catalog(
        profiles={"tp2": Profile("vllm", gpus_per_node=2)},
        models={f"x-{n}": Model("/models/m-tp2-0", "tp2") for n in range(node_count * REPLICAS_PER_NODE)},
    )
    result = schedule(nodes, catalog, [])
    return (
        len(catalog.models),
        len(result.placements),
        median_seconds(lambda: schedule(nodes, catalog, []), repeat),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--quick", action="store_true", help="sizes 100 and 250 only, 3 runs each")
    args = parser.parse_args(argv)
    sizes = SIZES[:2] if args.quick else SIZES
    repeat = 3 if args.quick else args.repeat

    print(f"scheduler benchmark: Python {sys.version.split()[0]}, median of {repeat} runs per figure")
    print(
        f"nodes: 8 GPUs each, {NODES_PER_FABRIC} per fabric, 1 in 20 an island; "
        f"replicas: {REPLICAS_PER_NODE} per node, mix {', '.join(f'{k} {v:.0%}' for k, v in MIX.items())}"
    )
    print()
    header = (
        f"{'nodes':>6} {'replicas':>8} {'placed':>7} {'unplaced':>8} {'GPUs used':>9} "
        f"{'place ms':>9} {'re-run ms':>9} {'lost ms':>8} "
        f"{'size x':>6} {'place x':>7} {'re-run x':>8} {'lost x':>6}"
    )
    print(header)
    print("-" * len(header))
    base: Row | None = None
    for size in sizes:
        row = measure(size, repeat)
        base = base or row
        print(
            f"{row.nodes:>6} {row.replicas:>8} {row.placed:>7} {row.unplaced:>8} {row.gpus_used:>9.0%} "
            f"{row.place * 1000:>9.1f} {row.rerun * 1000:>9.1f} {row.lost * 1000:>8.1f} "
            f"{row.nodes / base.nodes:>6.1f} {row.place / base.place:>7.1f} {row.rerun / base.rerun:>8.1f} "
            f"{row.lost / base.lost:>6.1f}"
        )
    print()
    print("place: from no placements; re-run: with its own result (no change); lost: one node lost.")
    print("x columns: growth relative to the first row (size x is how much the cluster grew).")
    print()
    models, placed, seconds = many_models(sizes[-1], max(1, repeat // 2))
    print(
        f"many small models: {models} models x 1 replica (2 GPUs) on {sizes[-1]} nodes: "
        f"{placed} placed in {seconds * 1000:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
