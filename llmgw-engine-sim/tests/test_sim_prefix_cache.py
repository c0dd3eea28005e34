"""The sim's prefix cache: whole blocks of a prompt seen before skip prefill; least recently used go first.

The cache is checked directly, and its effect on time to first token through
the HTTP API: a long prompt's first token waits its prefill, the same prompt
again does not (lower bounds only: the sim may be late, never early).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import trio
import trio.testing
from llmgw_engine_sim.prefix_cache import Prefill, PrefillOptions, PrefixCache


def words(n: int, tag: str = "w") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


class TestPrefixCache:
    def test_a_prompt_seen_before_hits_its_whole_blocks(self):
        cache = PrefixCache(capacity_tokens=1024, block_tokens=4)
        assert cache.admit(words(10)) == 0
        assert cache.admit(words(10)) == 8  # two whole blocks; the last two tokens are never cached
        assert cache.admit([*words(8), "other", "tail", "x", "y"]) == 8

    def test_a_block_hits_only_after_the_same_prefix(self):
        cache = PrefixCache(capacity_tokens=1024, block_tokens=4)
        cache.admit(words(8))
        assert cache.admit(["changed", *words(8)[1:]]) == 0

    def test_least_recently_used_blocks_leave_first(self):
        cache = PrefixCache(capacity_tokens=8, block_tokens=4)
        cache.admit(words(8, "a"))
        cache.admit(words(4, "b"))  # the cache is full: a's second block leaves
        assert len(cache) == 8
        assert cache.admit(words(8, "a")) == 4

    def test_capacity_zero_caches_nothing(self):
        cache = PrefixCache(capacity_tokens=0, block_tokens=4)
        cache.admit(words(8))
        assert cache.admit(words(8)) == 0


async def test_prefill_costs_the_uncached_tokens_one_prefill_at_a_time(autojump_clock):
    prefill = Prefill(PrefillOptions(cache_tokens=1024, block_tokens=4, seconds_per_token=0.01))
    started = trio.current_time()
    assert await prefill.run(" ".join(words(100))) == 0
    assert trio.current_time() - started == pytest.approx(1.0)
    started = trio.current_time()
    assert await prefill.run(" ".join(words(100))) == 100
    assert trio.current_time() - started == 0
    finished = []
    async with trio.open_nursery() as nursery:
        for tag in ("x", "y"):

            async def one(tag=tag) -> None:
                await prefill.run(" ".join(words(100, tag)))
                finished.append(trio.current_time() - started)

            nursery.start_soon(one)
    assert finished == pytest.approx([1.0, 2.0])  # the second waited for the first


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


PER_TOKEN = 0.002


@pytest.fixture(scope="module")
def prefill_sim(start_module_sim):
    sim = start_module_sim("--prefill-seconds-per-token", str(PER_TOKEN), "--prefix-block-tokens", "16")
    sim.wait_ready()
    return sim


def first_token_after(sim, prompt: str) -> float:
    body = {"model": "test/model", "prompt": prompt, "max_tokens": 1, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=10) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                return time.monotonic() - start
    raise AssertionError("no token arrived")


def test_a_repeated_prompt_skips_its_prefill(prefill_sim):
    prompt = " ".join(words(320, "p"))
    assert first_token_after(prefill_sim, prompt) >= 320 * PER_TOKEN
    again = first_token_after(prefill_sim, prompt)
    assert again < 320 * PER_TOKEN  # all 20 blocks hit: no prefill at all
