"""Key limits outlive the processes that enforce them: a gateway restarted, a leading server killed.

Real processes: servers (sqlite, or two on PostgreSQL), an agent with a sim, gateways, ``ctl``. What is
stated and checked here:

- rpm: the fleet's bucket is the leading server's; a new gateway is lent only what is left of it, and a
  new leader starts the buckets of the keys it found empty (refilling at the key's rate). So across either,
  a key is admitted at most ``rpm * (1 + T / 60)`` in T seconds, plus what the gateways held (a period's).
- usage (budgets): a gateway that stops reports its last answers before it exits; a leader writes what
  it was reported every 5 s, so a leader killed loses at most what it was reported since its last write
  (here: at most the requests sent after ``ctl keys usage`` last showed the key's tokens).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import chat_catalog
from llmgw.testing.load import ready_cluster
from llmgw.testing.processes import free_port
from llmgw.wire import EventList
from tests.e2e.test_e2e_key_limits import chat, created, status_of

pytestmark = pytest.mark.timeout(300)


def tokens_of(answers: list[httpx.Response]) -> int:
    """The tokens the answers served (their ``usage``), of those admitted."""
    return sum(a.json()["usage"]["total_tokens"] for a in answers if a.status_code == 200)


def admitted(answers: list[httpx.Response]) -> int:
    """How many were served; every other one must be a 429 naming the rpm limit."""
    refused = [a for a in answers if a.status_code != 200]
    assert all(a.status_code == 429 and a.json()["error"]["code"] == "rpm_limit" for a in refused), [
        (a.status_code, a.text[:200]) for a in refused
    ]
    assert all(1 <= int(a.headers["retry-after"]) <= 60 for a in refused)
    return len(answers) - len(refused)


def usage_tokens(cluster: LocalCluster, name: str) -> int:
    """The key's tokens this period as ``ctl keys usage NAME -o json`` shows them."""
    result = cluster.ctl("keys", "usage", name, "-o", "json")
    assert result.returncode == 0, result.stderr
    (key,) = json.loads(result.stdout)
    return key["tokens"]


def test_a_restarted_gateway_lends_no_fresh_minute_and_loses_no_usage(tmp_path: Path):
    """A key with --rpm 30 spends 20 through a gateway stopped right after its last answer: `ctl keys
    usage` shows every token at once; a new gateway admits what the fleet's bucket has left (30 in all,
    plus one refilled every 2 s), never a fresh 30; its tokens are counted too."""
    with ready_cluster(tmp_path, chat_catalog(replicas=1), nodes=1) as cluster:
        secret = created(cluster, "team-a", "--rpm", "30", "--budget", "1000000")
        other = created(cluster, "team-web")
        cluster.start_gateway(free_port(), keys=True)
        url = cluster.gateway_url
        cluster.wait(lambda: status_of(url, other) == 200, "the gateway to serve team-web", 60)

        began = time.monotonic()
        first = [chat(url, secret) for _ in range(20)]
        assert admitted(first) == 20
        cluster.stop(cluster.gateway)  # SIGTERM: its last exchange reports the usage, gives back its leases
        assert usage_tokens(cluster, "team-a") == tokens_of(first)

        cluster.start_gateway(free_port(), keys=True)
        url = cluster.gateway_url
        cluster.wait(lambda: status_of(url, other) == 200, "the restarted gateway to serve team-web", 60)
        second = [chat(url, secret) for _ in range(30)]
        elapsed = time.monotonic() - began
        total = 20 + admitted(second)
        assert total <= 30 + elapsed / 2 + 1, f"{total} admitted in {elapsed:.1f} s"
        assert total >= 30 - 1, f"only {total} admitted: the stopped gateway's leases were not given back"
        served = tokens_of(first) + tokens_of(second)
        cluster.wait(lambda: usage_tokens(cluster, "team-a") == served, "every token to be counted", 30)
        cluster.check()


def test_limits_and_usage_survive_a_server_failover(tmp_path: Path, pg_url: str):
    """Two servers on PostgreSQL; a key with --rpm 60 spends 50 through a gateway; the leader is killed
    (SIGKILL) and the standby leads: it lends the key, through another gateway, what refilled since it
    began, not a fresh 60 (in all at most 60 plus one a second, plus a period's leases); the usage `ctl keys
    usage` showed before the kill is still counted, at most the requests sent since are lost, and the new
    leader counts what follows."""
    with failover_pair(tmp_path, pg_url) as local:
        secret = created(local, "team-a", "--rpm", "60", "--budget", "1000000")
        other = created(local, "team-web")
        # two gateways: each process also counts its own requests, so only another one shows the fleet's word
        _, url, url_2 = two_gateways(local, other)

        began = time.monotonic()
        stored = [chat(url, secret) for _ in range(30)]
        assert admitted(stored) == 30
        local.wait(lambda: usage_tokens(local, "team-a") == tokens_of(stored), "server A to count them", 30)
        late = [chat(url, secret) for _ in range(20)]  # reported to A, perhaps never written
        assert admitted(late) == 20

        kill_leader(local)
        local.wait(lambda: status_of(url_2, other) == 200, "the second gateway to serve through server B", 60)
        after = [chat(url_2, secret) for _ in range(60)]
        elapsed = time.monotonic() - began
        total = 50 + admitted(after)
        assert 50 < total <= 60 + elapsed + 2, f"{total} admitted in {elapsed:.1f} s"

        before_kill = tokens_of(stored) + tokens_of(late)
        counted = local.wait(
            lambda: (n := usage_tokens(local, "team-a")) >= tokens_of(stored) + tokens_of(after) and n,
            "server B to count the key's usage since it leads",
            30,
        )
        assert counted <= before_kill + tokens_of(after)
        lost = before_kill + tokens_of(after) - counted
        assert lost <= tokens_of(late), f"{lost} tokens lost, more than the {tokens_of(late)} since the write"


@contextlib.contextmanager
def failover_pair(tmp_path: Path, pg_url: str) -> Iterator[LocalCluster]:
    """Two servers on PostgreSQL (A leads, B stands by; every client knows both), an agent and a ready
    ``chat`` replica; every process is stopped at the end, even on failure."""
    port_a, port_b = free_port(), free_port()
    local = LocalCluster(tmp_path / "cluster", server_port=port_a, lost_after=4, poll_timeout=1, store=pg_url)
    url_b = f"https://127.0.0.1:{port_b}"
    local.server_url = f"https://127.0.0.1:{port_a},{url_b}"  # every client knows both servers
    try:
        (tmp_path / "models" / "chat").mkdir(parents=True)
        local.start_server()
        local.wait(lambda: local.client.request("GET", "/v1/admin/nodes") is not None, "server A to lead")
        local.start_server(port=port_b, name="server-b")
        local.start_agent(local.add_node(1))
        local.apply(chat_catalog(replicas=1).format(models=tmp_path / "models"))
        local.wait(local.all_ready, "the chat replica to be ready")
        yield local
    finally:
        local.stop_all()


def kill_leader(local: LocalCluster) -> None:
    """SIGKILL the leading server A of :func:`failover_pair`; returns once server B says it leads."""
    url_b = local.server_url.split(",")[1]
    local.stop(local.server, signal.SIGKILL)
    local.wait(
        lambda: [e for e in local.client.request("GET", "/v1/admin/events", EventList).events
                 if e.kind == "leader" and e.subject == url_b],
        "server B to lead",
        60,
    )  # fmt: skip


def two_gateways(cluster: LocalCluster, secret: str) -> tuple[subprocess.Popen, str, str]:
    """Start two gateways with API keys and wait until both serve key ``secret``: (the first's process, its
    URL, the second's URL)."""
    first = cluster.start_gateway(free_port(), keys=True)
    url = cluster.gateway_url
    cluster.start_gateway(free_port(), keys=True)
    for each in (url, cluster.gateway_url):
        cluster.wait(lambda u=each: status_of(u, secret) == 200, f"gateway {each} to serve", 60)
    return first, url, cluster.gateway_url
