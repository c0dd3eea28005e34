"""How fast a model reaches every node: ``python bench/weights.py [--size-mb 1024 --nodes 8 --source hf]``.

It starts a real local cluster (``llmgw server`` and ``--nodes`` agents, each
simulated node with its own models directory and seed disk), writes a model of
``--size-mb`` random bytes in ``--files`` files on node-1's disk only, and
applies a catalog asking for one single-node replica per node. It prints:

- the time of one local ``cp -r`` of the same files (the baseline, this run,
  this machine), and the wall time from apply until every node's copy is
  verified (and until every replica is ready), as a ratio of that ``cp``;
- bytes each node served to the others (from the agents' logs): the seed
  node serving less than ``(nodes - 1) x`` the model is the fan-out at work;
- a CPU floor measured in this run: sha256 once plus TLS encrypt + decrypt of
  the copied bytes (the cipher the agents negotiate), divided by the cores;
  the wall time as a ratio of it, and the agents' CPU per GB against its own;
- per-node copy throughput, and CPU seconds (every agent, user + system) per
  GB copied.

With ``--source hf`` the model is on a Hub stand-in (:mod:`llmgw.testing.hub`,
serving the files from disk) instead of node-1's disk, the catalog says
``hf://bench/model``, and the clock starts at the apply: one node downloads
it, every other copies from peers. It also prints the bytes the Hub served
(target: exactly 1x the model) and its content requests per file.

All nodes share one machine's disk and cores here, so the ratio is an upper
bound of what separate machines would see.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

from llmgw.agent.peer_files import peer_client_context
from llmgw.dev.cluster import LocalCluster
from llmgw.pki import init_ca, issue_node, server_ssl_context
from llmgw.testing.catalogs import catalog_yaml, model
from llmgw.testing.hub import HubStandIn
from llmgw.testing.processes import free_port


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its waited-for children, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks


def cpu_floor(scratch: Path, size: int = 128_000_000) -> tuple[float, float, str]:
    """CPU seconds per GB this process needs for the work no copy can skip: (sha256, TLS), and the cipher.

    sha256 of the bytes once, and TLS encrypt + decrypt of them between two
    memory BIOs with the contexts the agents use (node certificates, so the
    same cipher is negotiated): what this machine's cores cost per GB copied,
    measured in this run.
    """
    ca = init_ca(scratch / "ca")
    tls = {n: issue_node(ca, n, out=scratch / n) for n in ("node-a", "node-b")}
    server_ctx = server_ssl_context(tls["node-a"].cert_path, tls["node-a"].key_path, tls["node-a"].ca_path)
    client_ctx = peer_client_context(tls["node-b"].cert_path, tls["node-b"].key_path)
    bios = [ssl.MemoryBIO() for _ in range(4)]
    server = server_ctx.wrap_bio(bios[0], bios[1], server_side=True)
    client = client_ctx.wrap_bio(bios[2], bios[3], server_side=False)
    for _ in range(10):  # the handshake: move each side's output to the other until both are done
        for side in (client, server):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        bios[2].write(bios[1].read())
        bios[0].write(bios[3].read())
    block = os.urandom(1 << 20)
    started = time.process_time()
    digest = hashlib.sha256()
    for _ in range(size >> 20):
        digest.update(block)
    sha_cpu = time.process_time() - started
    started = time.process_time()
    for _ in range(size >> 20):
        server.write(block)
        bios[2].write(bios[1].read())
        while bios[2].pending:
            client.read(1 << 20)
    tls_cpu = time.process_time() - started
    gb = (size >> 20 << 20) / 1e9
    return sha_cpu / gb, tls_cpu / gb, str(client.cipher()[0])


def verified_copies(cluster: LocalCluster, files: int) -> set[str]:
    """Nodes whose models dir holds a copy with every file verified."""
    done = set()
    for node_id, node in cluster.nodes.items():
        for state in (
            (node.models_dir / ".llmgw").glob("*.json") if (node.models_dir / ".llmgw").is_dir() else ()
        ):
            if state.name.startswith("seed-"):
                continue
            try:
                if len(json.loads(state.read_text()).get("verified", {})) == files:
                    done.add(node_id)
            except ValueError:
                pass
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--source", choices=("seed", "hf"), default="seed", help="seed on node-1, or a Hub")
    args = parser.parse_args()
    hub = HubStandIn().start() if args.source == "hf" else None
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-weights-") as tmp:
        root = Path(tmp)
        cluster = LocalCluster(root / "cluster", server_port=free_port(), lost_after=30, poll_timeout=1)
        try:
            seed = (root / "hub-files") if hub else cluster.add_node(1).seed_root / "data" / "model"
            seed.mkdir(parents=True)
            size = args.size_mb * 1_000_000 // args.files
            for index in range(args.files):
                with open(seed / f"model-{index:05d}.safetensors", "wb") as handle:
                    for _ in range(0, size, 8_000_000):
                        handle.write(os.urandom(min(8_000_000, size - handle.tell())))
            total = size * args.files
            sha_per_gb, tls_per_gb, cipher = cpu_floor(root / "floor")
            started = time.monotonic()
            subprocess.run(["cp", "-r", str(seed), str(root / "cp-baseline")], check=True)
            cp_seconds = time.monotonic() - started
            shutil.rmtree(root / "cp-baseline")
            source = "seed:///data/model"
            if hub is not None:
                source = "hf://bench/model"
                hub.add_model("bench/model", {p.name: p for p in sorted(seed.iterdir())})
                cluster.agent_args = ["--hub-endpoint", hub.endpoint]
            cluster.start(args.nodes)
            agents = {n: node.process.pid for n, node in cluster.nodes.items() if node.process}
            cpu_before = sum(cpu_seconds(pid) for pid in agents.values())
            if hub is None:
                # the seed's manifest (hashing the model once) is made before the clock starts
                cluster.apply(catalog_yaml({"seeded": model(source, replicas=1)}))
                cluster.wait(cluster.all_ready, "the seed node's replica", 600)
            cpu_at_clock = sum(cpu_seconds(pid) for pid in agents.values())
            started = time.monotonic()
            cluster.apply(catalog_yaml({"seeded": model(source, replicas=args.nodes)}))
            done_at: dict[str, float] = {}
            copies = args.nodes if hub else args.nodes - 1
            while len(done_at) < copies:
                cluster.check()
                for node_id in verified_copies(cluster, args.files) - set(done_at):
                    done_at[node_id] = time.monotonic() - started
                if time.monotonic() - started > 1800:
                    raise SystemExit(f"timed out: {len(done_at)} of {copies} copies verified")
                time.sleep(0.05)
            copies_seconds = max(done_at.values())
            cluster.wait(
                lambda: len(cluster.replicas().replicas) == args.nodes and cluster.all_ready(), "ready", 600
            )
            ready_seconds = time.monotonic() - started
            cpu = sum(cpu_seconds(pid) for pid in agents.values()) - cpu_before
            served: dict[str, int] = {}
            for node_id in cluster.nodes:
                log = (cluster.logs / f"agent-{node_id}.log").read_text()
                served[node_id] = sum(int(m) for m in re.findall(r"served \S+ to \S+: (\d+) bytes", log))
        finally:
            cluster.stop_all()
            if hub is not None:
                hub.stop()
    copied = total * copies
    where = "on a Hub stand-in" if hub else "seeded on node-1"
    print(f"model: {total / 1e6:.0f} MB in {args.files} files, {where}; {args.nodes} nodes")
    print(f"baseline: one local cp -r of the files: {cp_seconds:.2f} s ({total / 1e6 / cp_seconds:.0f} MB/s)")
    print(
        f"all {copies} copies verified: {copies_seconds:.2f} s "
        f"= {copies_seconds / cp_seconds:.1f}x the cp; "
        f"every replica ready: {ready_seconds:.2f} s"
    )
    floor_per_gb = sha_per_gb + tls_per_gb
    cores = os.cpu_count() or 1
    floor_seconds = floor_per_gb * copied / 1e9 / cores
    print(
        f"CPU floor (sha256 once + {cipher} encrypt and decrypt, this run): {floor_per_gb:.2f} s per GB "
        f"(sha256 {sha_per_gb:.2f}, TLS {tls_per_gb:.2f}); for {copied / 1e6:.0f} MB on {cores} cores: "
        f"{floor_seconds:.2f} s"
    )
    print(
        f"  all copies verified = {copies_seconds / floor_seconds:.1f}x the CPU floor; "
        f"the floor itself = {floor_seconds / cp_seconds:.1f}x the cp"
    )
    for node_id in sorted(done_at, key=lambda n: int(n.split("-")[1])):
        print(
            f"  {node_id}: verified at {done_at[node_id]:.2f} s ({total / 1e6 / done_at[node_id]:.0f} MB/s)"
        )
    print(
        "bytes served to peers: " + ", ".join(f"{n} {b / 1e6:.0f} MB" for n, b in sorted(served.items()) if b)
    )
    print(f"  in all {sum(served.values()) / 1e6:.0f} MB for {copied / 1e6:.0f} MB of copies")
    print(
        f"CPU (every agent, user + system): {cpu:.1f} s, {cpu / (copied / 1e9):.1f} s per GB copied "
        f"= {cpu / (copied / 1e9) / floor_per_gb:.1f}x the floor's {floor_per_gb:.2f}"
    )
    print(f"  of which before the clock (the seed's manifest, start-up): {cpu_at_clock - cpu_before:.1f} s")
    if hub is not None:
        served_by_hub = hub.total_bytes_served()
        print(
            f"bytes served by the hub: {served_by_hub / 1e6:.0f} MB = {served_by_hub / total:.2f}x the model "
            f"(target 1x); content requests per file: {sorted(set(hub.downloads.values()))}"
        )


if __name__ == "__main__":
    main()
