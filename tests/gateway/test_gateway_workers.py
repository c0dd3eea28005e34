"""``llmgw gateway --workers N``: worker processes sharing the port, metrics that add up, one lifetime."""

from __future__ import annotations

import os
import signal
import sys

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from llmgw.agent.launcher import group_members, pid_alive
from llmgw.testing.gateway import FakeRoutesFeed, start_sim, wait_healthy
from llmgw.testing.metrics import promtool_check_metrics
from llmgw.testing.processes import free_port, processes, wait_for  # noqa: F401

MESSAGES = [{"role": "user", "content": "hello workers"}]


async def start_workers(nursery, processes, workers: int):  # noqa: F811
    """A sim, a feed and ``llmgw gateway --workers N``; returns (gateway process, its URL) once it serves."""
    sim = start_sim(processes)
    feed = FakeRoutesFeed()
    feed_url = await nursery.start(feed.serve)
    feed.set(routes={"m": [("m-0", sim.url)]})
    port = free_port()
    argv = [sys.executable, "-m", "llmgw.gateway", "--server", feed_url, "--no-keys"]
    gateway = processes.start([*argv, "--listen", f"127.0.0.1:{port}", "--workers", str(workers)], name="gw")
    url = f"http://127.0.0.1:{port}"
    with trio.fail_after(20):
        await wait_healthy([sim.url, url])
        await wait_for(lambda: len(workers_of(gateway.pid)) == workers, f"{workers} workers", gateway)
    return gateway, url


def workers_of(parent: int) -> list[int]:
    """The live processes whose parent is ``parent``."""
    found = []
    for pid in group_members(parent):
        try:
            fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.append(pid)
    return found


def requests_total(text: str) -> float:
    families = {family.name: family for family in text_string_to_metric_families(text)}
    return sum(
        sample.value
        for sample in families["llmgw_gateway_requests"].samples
        if sample.name.endswith("_total")
    )


class TestWorkers:
    async def test_workers_share_the_port_and_metrics_add_up(self, nursery, processes):  # noqa: F811
        gateway, url = await start_workers(nursery, processes, 2)
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for _ in range(20):
                # a new connection each time, so that the kernel spreads them over the workers
                async with httpx.AsyncClient(base_url=url, timeout=10) as fresh:
                    response = await fresh.post(
                        "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}
                    )
                assert response.status_code == 200
            for _ in range(10):
                metrics = await http.get("/metrics", headers={"connection": "close"})
                assert requests_total(metrics.text) == 20  # whichever worker answers, it counts all
        assert len(workers_of(gateway.pid)) == 2
        # process_* covers the parent and both workers, one pid each, whichever worker answered
        memory = {
            sample.labels["pid"]
            for family in text_string_to_metric_families(metrics.text)
            for sample in family.samples
            if sample.name == "process_resident_memory_bytes"
        }
        assert memory == {str(pid) for pid in [gateway.pid, *workers_of(gateway.pid)]}
        assert promtool_check_metrics(metrics.text) == []

    async def test_workers_stop_with_the_parent_on_sigterm(self, nursery, processes):  # noqa: F811
        gateway, url = await start_workers(nursery, processes, 2)
        children = workers_of(gateway.pid)
        gateway.signal(signal.SIGTERM)
        with trio.fail_after(15):
            assert await gateway.wait_exit_trio() == 0
            await wait_for(lambda: not any(pid_alive(pid) for pid in children), "the workers to exit")

    async def test_workers_die_when_the_parent_is_killed(self, nursery, processes):  # noqa: F811
        gateway, url = await start_workers(nursery, processes, 2)
        children = workers_of(gateway.pid)
        os.kill(gateway.pid, signal.SIGKILL)  # the parent alone: no chance to pass anything on
        with trio.fail_after(15):
            await wait_for(lambda: not any(pid_alive(pid) for pid in children), "the workers to exit")
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(base_url=url, timeout=5) as http:
                await http.get("/health")

    async def test_workers_need_a_fixed_port(self, processes):  # noqa: F811
        argv = [sys.executable, "-m", "llmgw.gateway", "--server", "http://127.0.0.1:9", "--no-keys"]
        gateway = processes.start([*argv, "--listen", "127.0.0.1:0", "--workers", "2"], name="gw")
        with trio.fail_after(15):
            assert await gateway.wait_exit_trio() != 0
        assert "--workers 2 needs a fixed port in --listen" in gateway.stderr()

    async def test_a_dying_worker_stops_the_others_and_the_parent_fails(self, nursery, processes):  # noqa: F811
        gateway, url = await start_workers(nursery, processes, 2)
        first, second = workers_of(gateway.pid)
        os.kill(first, signal.SIGKILL)
        with trio.fail_after(15):
            assert await gateway.wait_exit_trio() == 1
            await wait_for(lambda: not pid_alive(second), "the other worker to exit")
        assert "exited with -9: stopping the others" in gateway.stderr()
