"""End to end: a Hub download whose node dies is resumed from the bytes the fleet already has.

Issue 24: the next downloader fetched the dead node's file again from byte 0
(1.07x the model's bytes from the Hub). Now the other nodes follow a file
while it is downloaded (its partial bytes, by Range, verified once whole),
and the node taking over the lease resumes from them. Real server, agents,
``huggingface_hub`` in the agents, and the Hub stand-in counting its bytes.
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest

from llmgw.testing.catalogs import catalog_yaml, model
from llmgw.testing.hub import HubStandIn, hub_cluster, hub_downloader

pytestmark = pytest.mark.timeout(300)

CATALOG = catalog_yaml({"tiny": model("hf://acme/tiny-sim@main", replicas=2)})


def test_the_next_downloader_resumes_from_the_bytes_the_fleet_has(tmp_path: Path):
    """The downloader dies with b.safetensors 12 MB down: the Hub serves the model's bytes about once
    (1.61x on main at 8203028, where the next downloader fetched b.safetensors from byte 0)."""
    files = {
        "a.safetensors": os.urandom(4_000_000),
        "b.safetensors": os.urandom(32_000_000),
        "config.json": b"{}",
    }
    total = sum(len(data) for data in files.values())
    with HubStandIn() as hub:
        hub.add_model("acme/tiny-sim", files)
        hub.rate = 4_000_000
        cluster = hub_cluster(tmp_path, hub, 2, lost_after=6)
        try:
            cluster.apply(CATALOG)

            log = cluster.logs / "server.log"
            downloader = lambda: hub_downloader(log, "hf://acme/tiny-sim@main")  # noqa: E731
            holder = cluster.wait(downloader, "a node downloading from the hub", 60)
            other = next(n for n in cluster.nodes if n != holder)

            def downloaded(node: str) -> int:
                found = list(cluster.nodes[node].models_dir.glob("*/b.safetensors.llmgw-partial"))
                return found[0].stat().st_size if found else 0

            cluster.wait(lambda: downloaded(holder) >= 12_000_000, f"{holder} 12 MB into b.safetensors", 60)
            cluster.stop(cluster.nodes[holder].process, signal.SIGKILL)
            had = downloaded(other)
            cluster.wait(cluster.all_ready, f"both replicas ready on {other}", 120)
            served = hub.total_bytes_served()
            print(
                f"{other} had {had / 1e6:.1f} MB of b.safetensors; hub served {served / total:.3f}x the model"
            )
            assert had >= 10_000_000, f"{other} should have followed the download ({had} bytes)"
            # beyond the model's bytes, only what was in flight to the dying node (a MiB written at a time)
            assert served <= total + 3_000_000, f"the hub served {served} bytes for a {total}-byte model"
            [copy] = [p for p in cluster.nodes[other].models_dir.iterdir() if not p.name.startswith(".")]
            want = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
            assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in copy.iterdir()} == want
        finally:
            cluster.stop_all()
