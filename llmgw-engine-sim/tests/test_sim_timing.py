"""--time-to-first-token and --tokens-per-second shape when tokens arrive.

Only lower bounds and ordering are asserted: the sim may be late, never early.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

TTFT = 0.3
TPS = 20.0


@pytest.fixture(scope="module")
def slow_sim(start_module_sim):
    sim = start_module_sim("--time-to-first-token", str(TTFT), "--tokens-per-second", str(TPS))
    sim.wait_ready()
    return sim


def stream_arrivals(sim, max_tokens: int) -> list[float]:
    """Seconds from sending a streamed completion to each token's arrival."""
    body = {"model": "test/model", "prompt": "timing", "max_tokens": max_tokens, "stream": True}
    arrivals = []
    start = time.monotonic()
    with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=10) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                if json.loads(line[6:])["choices"][0]["text"]:
                    arrivals.append(time.monotonic() - start)
    return arrivals


def test_first_token_waits_for_time_to_first_token(slow_sim):
    """The first token arrives no sooner than --time-to-first-token."""
    arrivals = stream_arrivals(slow_sim, 2)
    assert arrivals[0] >= TTFT


def test_tokens_are_spread_by_tokens_per_second(slow_sim):
    """Tokens arrive one by one, the n-th no sooner than TTFT + (n - 1) / tokens-per-second."""
    arrivals = stream_arrivals(slow_sim, 4)
    assert len(arrivals) == 4
    assert arrivals == sorted(set(arrivals))
    for position, arrival in enumerate(arrivals):
        assert arrival >= TTFT + position / TPS


def test_non_streamed_response_waits_for_the_whole_generation(slow_sim):
    """A non-streamed completion takes at least TTFT plus the generation time."""
    body = {"model": "test/model", "prompt": "timing", "max_tokens": 4}
    start = time.monotonic()
    response = httpx.post(f"{slow_sim.url}/v1/completions", json=body, timeout=10)
    elapsed = time.monotonic() - start
    tokens = response.json()["usage"]["completion_tokens"]
    assert elapsed >= TTFT + (tokens - 1) / TPS


def test_chat_stream_starts_after_time_to_first_token(slow_sim):
    """A chat stream's first event (the role) comes with the first token, not before."""
    body = {"model": "test/model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", f"{slow_sim.url}/v1/chat/completions", json=body, timeout=10) as response:
        first = next(line for line in response.iter_lines() if line)
        elapsed = time.monotonic() - start
    assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    assert elapsed >= TTFT
