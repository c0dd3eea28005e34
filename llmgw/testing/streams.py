"""Clients streaming long greedy answers through a gateway, each answer checked against the unbroken one.

Used by the end-to-end test and the benchmark of mid-stream migration
(``tests/e2e/test_e2e_migration.py``, ``bench/migration.py``)::

    with StreamingClients(cluster.gateway_url, 16, tokens=240) as clients:
        clients.wait_events(16 * 60, cluster.wait)   # every client mid-stream
        ...                                          # kill, stop, drain
    assert clients.broken() == []

Every answer is asked with ``ignore_eos`` up to ``tokens`` and the usage,
and compared with what the sim answers the same prompt unbroken
(:func:`reference`): the text, ``finish_reason`` ``length`` and the usage
of one answer.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import httpx
from llmgw_engine_sim.generate import count_tokens, generate

from llmgw.testing.chat import chat_body

__all__ = ["Streamed", "StreamingClients", "reference"]


def reference(content: str, tokens: int) -> str:
    """What an unbroken sim answers a chat of one user message ``content`` (greedy, ``tokens`` long)."""
    return generate(f"user: {content}\nassistant: ", tokens, answer="", ignore_eos=True).text


@attrs.frozen
class Streamed:
    """One stream as its client read it."""

    content: str
    text: str
    finish: str | None
    usage: dict | None
    error: str | None
    #: the longest wait between two events, seconds
    gap: float
    #: events read
    events: int

    def problem(self, tokens: int) -> str | None:
        """What is wrong with it against the unbroken answer of ``tokens`` tokens; None: nothing."""
        if self.error:
            return self.error
        if self.text != reference(self.content, tokens):
            return "the text differs from the unbroken answer"
        if self.finish != "length":
            return f"finish_reason {self.finish}"
        prompt = count_tokens(self.content)
        if self.usage != {
            "prompt_tokens": prompt,
            "completion_tokens": tokens,
            "total_tokens": prompt + tokens,
        }:
            return f"usage {self.usage}"
        return None


def stream_once(http: httpx.Client, content: str, tokens: int, tick: Callable[[], None]) -> Streamed:
    """Stream one answer to ``content``; ``tick()`` at every event read."""
    body = chat_body("chat", content, tokens, stream=True, usage=True, ignore_eos=True)
    text: list[str] = []
    finish, usage, error, gap, events = None, None, None, 0.0, 0
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return Streamed(content, "", None, None, f"status {response.status_code}", 0.0, 0)
            last = time.monotonic()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                gap, last, events = max(gap, now - last), now, events + 1
                tick()
                event: dict[str, Any] = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                    continue
                for choice in event.get("choices") or ():
                    text.append(choice["delta"].get("content") or "")
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return Streamed(content, "".join(text), finish, usage, error, gap, events)


class StreamingClients:
    """``clients`` threads streaming answers of ``tokens`` tokens from ``url`` one after another until
    stopped (a context manager: stopped, and every stream in flight read to its end, on exit)."""

    def __init__(
        self, url: str, clients: int, *, tokens: int, prompt: str = "tell me about the fleet"
    ) -> None:
        self.url = url
        self.tokens = tokens
        self.prompt = prompt
        #: every stream that ended, in the order they ended
        self.results: list[Streamed] = []
        #: events read so far, every client together
        self.events = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> StreamingClients:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self, timeout: float = 120.0) -> None:
        """Send no new request and wait for the streams in flight to end."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = sum(thread.is_alive() for thread in self._threads)
        if alive:
            raise AssertionError(f"{alive} clients still streaming {timeout:g} s after the stop")

    def wait_events(self, more: int, wait: Callable[[Callable[[], bool], str, float], object]) -> None:
        """Return once the clients read ``more`` events after this call, waiting with ``wait(done, what,
        timeout)`` (a cluster's, which fails when a process of it died)."""
        mark = self.events
        wait(lambda: self.events >= mark + more, f"{more} events more from the streams", 60)

    def wait_streams(self, more: int, wait: Callable[[Callable[[], bool], str, float], object]) -> None:
        """Return once ``more`` streams ended after this call (see :meth:`wait_events`)."""
        mark = len(self.results)
        wait(lambda: len(self.results) >= mark + more, f"{more} streams more to end", 120)

    def broken(self) -> list[tuple[Streamed, str]]:
        """The streams that differ from the unbroken answer, each with what is wrong."""
        problems = [(r, r.problem(self.tokens)) for r in self.results]
        return [(r, p) for r, p in problems if p is not None]

    def _tick(self) -> None:
        with self._lock:
            self.events += 1

    def _run(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as http:
            turn = 0
            while not self._stop.is_set():
                answer = stream_once(
                    http, f"client {index} turn {turn}: {self.prompt}", self.tokens, self._tick
                )
                turn += 1
                with self._lock:
                    self.results.append(answer)
