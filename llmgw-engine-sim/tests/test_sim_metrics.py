"""The sim's /metrics (vLLM's names and labels) and --max-num-seqs' waiting seats."""

from __future__ import annotations

import threading
import time

import httpx
import trio
from llmgw_engine_sim import LOAD, PROGRESS

from llmgw.agent.liveness import parse_samples
from llmgw.agent.load import read_load
from llmgw.testing.processes import wait_until
from llmgw.wire import ShardLoad

NAMES = (
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


def metrics(sim) -> dict[str, float]:
    response = httpx.get(f"{sim.url}/metrics", timeout=5)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return parse_samples(response.text, NAMES)


async def read_sim_load(sim) -> ShardLoad:
    """The load the agent reads from ``sim`` with the plugin's gauge names."""
    async with httpx.AsyncClient() as client:
        reading = await read_load(client, sim.url, LOAD, "r-0", 1, 5)
    assert isinstance(reading, ShardLoad), reading
    return reading


def complete(sim, max_tokens: int, results: list | None = None) -> None:
    body = {"model": "test/model", "prompt": "count these", "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(f"{sim.url}/v1/completions", json=body, timeout=30)
    if results is not None:
        results.append(response.json()["usage"])


def test_counters_count_every_token_and_the_plugin_reads_them(start_sim):
    """After two completions, the token counters hold their usage; the plugin's names are the sim's."""
    sim = start_sim()
    sim.wait_ready()
    assert metrics(sim) == dict.fromkeys(NAMES, 0.0)
    usages: list = []
    complete(sim, 3, usages)
    complete(sim, 5, usages)
    after = metrics(sim)
    assert after["vllm:generation_tokens_total"] == sum(u["completion_tokens"] for u in usages) == 8
    assert after["vllm:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert set(PROGRESS.tokens) | set(PROGRESS.running) <= set(NAMES)
    assert {*LOAD.waiting, *LOAD.running} <= set(NAMES) and LOAD.kv_cache_usage[0] in NAMES


def test_max_num_seqs_makes_requests_wait_while_tokens_keep_coming(start_sim):
    """With one seat, a second request waits (counted as waiting) while the first produces tokens."""
    sim = start_sim("--max-num-seqs", "1", "--tokens-per-second", "5")  # a wait of 1 s or more
    sim.wait_ready()
    usages: list = []
    # 15 tokens each: the first holds the seat 3 s, ample for the checks below (each a few ms)
    threads = [threading.Thread(target=complete, args=(sim, 15, usages)) for _ in range(2)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        wait_until(
            lambda: metrics(sim)["vllm:num_requests_waiting"] == 1, 5, "a request to wait", sim.process
        )
        first = metrics(sim)
        assert first["vllm:num_requests_running"] == 1
        assert first["vllm:kv_cache_usage_perc"] == 1.0  # its one seat is taken
        reading = trio.run(read_sim_load, sim)
        assert (reading.waiting, reading.running, reading.kv_cache_usage) == (1, 1, 1.0)
        wait_until(
            lambda: metrics(sim)["vllm:generation_tokens_total"] > first["vllm:generation_tokens_total"],
            5,
            "tokens to be produced while a request waits",
            sim.process,
        )
    finally:
        for thread in threads:
            thread.join(30)
    # two generations at 5 tokens/s, one after the other
    tokens = [u["completion_tokens"] for u in usages]
    assert time.monotonic() - started >= (sum(tokens) - 2) / 5
    done = metrics(sim)
    assert done["vllm:generation_tokens_total"] == sum(tokens)
    assert (done["vllm:num_requests_waiting"], done["vllm:kv_cache_usage_perc"]) == (0, 0)


def test_a_hung_sim_counts_its_hung_requests_as_running_and_its_counters_stop(start_sim):
    """--hang-after-requests: /health stays 200, the hung request shows as running, tokens stop."""
    sim = start_sim("--hang-after-requests", "1")
    sim.wait_ready()
    complete(sim, 4)
    hung = threading.Thread(target=_hang, args=(sim,))
    hung.start()
    try:
        wait_until(lambda: metrics(sim)["vllm:num_requests_running"] == 1, 5, "the hung request", sim.process)
        assert sim.health() == 200
        assert metrics(sim)["vllm:generation_tokens_total"] == 4
    finally:
        hung.join(10)


def _hang(sim) -> None:
    """A completion the hung sim never answers; given up after 3 s."""
    body = {"model": "test/model", "prompt": "hang", "max_tokens": 4}
    try:
        httpx.post(f"{sim.url}/v1/completions", json=body, timeout=3)
    except httpx.TimeoutException:
        pass
