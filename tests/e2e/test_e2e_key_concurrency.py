"""A key's --concurrency holds for the fleet: real gateway processes borrowing seats from a real server.

Streams are slow (sims at 400 tokens/s, 2,000 tokens: 5 s), so every request of a burst is in flight at
once; what is counted is the streams open at once as the clients see them (from the answer's headers to its
end): the gateway admits a request before its headers and frees its seat when its answer ends.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from llmgw.server.state.seats import SEAT_TTL
from llmgw.testing.catalogs import chat_catalog
from llmgw.testing.load import ready_cluster
from llmgw.testing.processes import free_port
from tests.e2e.test_e2e_key_limits import created, status_of
from tests.e2e.test_e2e_limits_survive import failover_pair, kill_leader, two_gateways

pytestmark = pytest.mark.timeout(300)


class Streams:
    """Slow streamed answers through a gateway, each on its own connection, with when each was open."""

    def __init__(self, url: str, secret: str, tokens: int) -> None:
        self.url, self.secret, self.tokens = url, secret, tokens
        #: one per request: (status, error code or "", opened, closed) (times on the monotonic clock)
        self.answers: list[tuple[int, str, float, float]] = []
        #: requests answered 200 whose stream has begun (set once ``opened`` reaches the number waited for)
        self.opened = 0
        self._lock = threading.Lock()
        self.all_opened = threading.Event()
        self.expected = 0

    def one(self) -> None:
        """One request, read to its end (or until its gateway dies)."""
        body = {
            "model": "chat",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": self.tokens,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {self.secret}"}
        code, opened = "", 0.0
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=60
            ) as answer:
                opened = time.monotonic()
                if answer.status_code == 200:
                    with self._lock:
                        self.opened += 1
                        if self.opened >= self.expected:
                            self.all_opened.set()
                    for _ in answer.iter_bytes():
                        pass
                else:
                    answer.read()
                    code = answer.json()["error"]["code"]
                    assert 1 <= int(answer.headers["retry-after"]) <= 60
                status = answer.status_code
        except httpx.HTTPError:
            status = 0  # its gateway was killed mid-stream
        with self._lock:
            self.answers.append((status, code, opened, time.monotonic()))

    def most_open_at_once(self) -> int:
        """The most answers of status 200 that were open at the same time."""
        served = [a for a in self.answers if a[0] == 200]
        # at one instant an end comes before a start: -1 sorts first
        events = sorted([(a[2], 1) for a in served] + [(a[3], -1) for a in served])
        most = now = 0
        for _, step in events:
            now += step
            most = max(most, now)
        return most


def test_concurrency_holds_for_the_fleet_across_gateway_workers(tmp_path: Path):
    """Through one gateway of 2 worker processes, a key with --concurrency 4 sent 12 slow streams at once
    never has more than 4 open at once (each worker counting alone admitted up to 8); the others are 429
    concurrency_limit with Retry-After."""
    with ready_cluster(tmp_path, chat_catalog(replicas=1), nodes=1) as cluster:
        limited = created(cluster, "team-streams", "--concurrency", "4")
        other = created(cluster, "team-web")
        cluster.start_gateway(free_port(), keys=True, extra=["--workers", "2"])
        url = cluster.gateway_url
        cluster.wait(lambda: all(status_of(url, other) == 200 for _ in range(6)), "both workers to serve", 60)
        cluster.wait(lambda: status_of(url, limited) == 200, "the gateway to serve team-streams", 60)
        streams = Streams(url, limited, 2000)
        streams.expected = 4
        with ThreadPoolExecutor(12) as pool:
            for _ in range(12):
                pool.submit(streams.one)
        statuses = sorted(a[0] for a in streams.answers)
        admitted = statuses.count(200)
        most = streams.most_open_at_once()
        print(f"concurrency 4, 2 workers, 12 streams at once: {admitted} admitted, {most} open at once")
        assert set(statuses) <= {200, 429}, streams.answers
        assert {a[1] for a in streams.answers if a[0] == 429} <= {"concurrency_limit"}
        assert 1 <= most <= 4, streams.answers
        cluster.check()


def test_a_killed_gateways_seats_come_back_after_the_ttl(tmp_path: Path):
    """Gateway A holds all 4 seats of a key with --concurrency 4 (4 slow streams); gateway B is refused
    (429 concurrency_limit). A is killed (SIGKILL): its seats are still the fleet's right after, and come
    back to B once the leader's TTL has passed without A reporting."""
    with ready_cluster(tmp_path, chat_catalog(replicas=1), nodes=1) as cluster:
        limited = created(cluster, "team-streams", "--concurrency", "4")
        gateway_a, url_a, url_b = two_gateways(cluster, created(cluster, "team-web"))
        streams = Streams(url_a, limited, 8000)  # 20 s: still open when A is killed
        streams.expected = 4
        with ThreadPoolExecutor(4) as pool:
            for _ in range(4):
                pool.submit(streams.one)
            assert streams.all_opened.wait(60), streams.answers
            assert status_of(url_b, limited) == 429
            cluster.stop(gateway_a, signal.SIGKILL)
            killed = time.monotonic()
            assert status_of(url_b, limited) == 429  # the leader still counts A's seats
            cluster.wait(lambda: status_of(url_b, limited) == 200, "A's seats to come back to gateway B", 60)
            back = time.monotonic() - killed
        print(f"a killed gateway's seats came back after {back:.1f} s (TTL {SEAT_TTL:g} s)")
        assert back <= SEAT_TTL + 15, back
        cluster.check()


def test_a_new_leader_counts_the_seats_gateways_hold(tmp_path: Path, pg_url: str):
    """Two servers on PostgreSQL; gateway A holds both seats of a key with --concurrency 2 (2 slow streams);
    the leader is killed (SIGKILL) and the standby leads: it learns from A's reports that A holds them, so
    gateway B is refused (429 concurrency_limit) while they run; A killed, they come back to B after the
    TTL."""
    with failover_pair(tmp_path, pg_url) as local:
        limited = created(local, "team-streams", "--concurrency", "2")
        gateway_a, url_a, url_b = two_gateways(local, created(local, "team-web"))
        streams = Streams(url_a, limited, 40000)  # 100 s: open until A is killed
        streams.expected = 2
        with ThreadPoolExecutor(2) as pool:
            for _ in range(2):
                pool.submit(streams.one)
            assert streams.all_opened.wait(60), streams.answers
            kill_leader(local)
            local.wait(lambda: status_of(url_b, limited) == 429, "gateway B to answer through server B", 60)
            # refused all along, also past the new leader's first TTL + period, when it lends what is free
            until = time.monotonic() + SEAT_TTL + 2
            while time.monotonic() < until:
                assert status_of(url_b, limited) == 429
                time.sleep(0.2)  # sampling, not waiting for a condition
            local.stop(gateway_a, signal.SIGKILL)
            killed = time.monotonic()
            local.wait(lambda: status_of(url_b, limited) == 200, "A's seats to come back to B", 60)
            back = time.monotonic() - killed
        print(f"after a failover, a killed gateway's seats came back after {back:.1f} s")
