"""The gateway when an engine stops under load, across real processes: server, agents, sims, gateway.

A SIGSTOPped engine answers nothing, not even its health check. The gateway
sees its requests stall, takes it out, tells the server, and retries its
requests elsewhere: no client waits much past the stall timeout.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from llmgw.testing.catalogs import CHAT_CATALOG
from llmgw.testing.load import routed_cluster
from llmgw.testing.processes import resume
from llmgw.wire import EventList

pytestmark = pytest.mark.timeout(240)

#: seconds (the default is 10; shorter keeps the test short)
STALL = 4.0


def test_sigstopped_engine_under_load_its_requests_go_elsewhere(tmp_path: Path):
    """SIGSTOP one of two engines under 8 clients: every request succeeds, none waits over stall + 2 s."""
    stopped: list[int] = []
    with routed_cluster(tmp_path, CHAT_CATALOG, gateway=["--stall-timeout", str(STALL)]) as cluster:
        try:
            victim = cluster.replicas().replicas[0]
            results: list[tuple[int, float, str]] = []
            lock = threading.Lock()
            stop = threading.Event()

            def client() -> None:
                body = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
                with httpx.Client(base_url=cluster.gateway_url, timeout=30) as http:
                    while not stop.is_set():
                        began = time.monotonic()
                        try:
                            response = http.post("/v1/chat/completions", json=body)
                            outcome = (response.status_code, response.headers.get("x-llmgw-replica", ""))
                        except httpx.HTTPError as exc:
                            outcome = (0, str(exc))
                        with lock:
                            results.append((outcome[0], time.monotonic() - began, outcome[1]))

            threads = [threading.Thread(target=client, daemon=True) for _ in range(8)]
            for thread in threads:
                thread.start()
            cluster.wait(lambda: len(results) > 200, "requests to flow through the gateway", 30)
            stopped.append(victim.shards[0].pid)
            os.kill(stopped[0], signal.SIGSTOP)
            stopped_at = len(results)

            def reports() -> list[str]:
                events = cluster.client.request("GET", "/v1/admin/events", EventList).events
                return [e.message for e in events if e.kind == "gateway" and e.subject == victim.id]

            # load goes on through the stall, its detection (reported to the server) and the retries
            cluster.wait(reports, "the gateway to report the stalled replica", STALL + 30)
            reported_at = len(results)
            cluster.wait(lambda: len(results) >= reported_at + 100, "100 more requests after the report", 30)
            stop.set()
            for thread in threads:
                thread.join(40)  # every request in flight ends, the ones sent to the stopped engine too
            after = results[stopped_at:]
            failed = [r for r in after if r[0] != 200]
            assert not failed, failed[:5]
            slowest = max(seconds for _, seconds, _ in after)
            print(f"{len(after)} requests after SIGSTOP, slowest {slowest:.2f} s (stall timeout {STALL:g} s)")
            assert slowest <= STALL + 2, f"a request waited {slowest:.1f} s"
            found = "gateway dev-gateway found it stalled: nothing arrived"
            assert reports()[0].startswith(found), reports()
        finally:
            resume(stopped)
