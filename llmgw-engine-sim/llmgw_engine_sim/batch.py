"""The sim's batch: seats for running generations (``--max-num-seqs``) and the counters of ``/metrics``.

Named as vLLM names its own (``sim:`` for ``vllm:``), so the agent's liveness
probe reads the sim as it reads vLLM: tokens produced, requests running.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import trio

__all__ = ["Batch"]


class Batch:
    """What rank 0 runs at once, and what it produced so far.

    :param seats: generations that may run at once; None: no limit.
    """

    def __init__(self, seats: int | None = None) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.running = 0
        self.waiting = 0
        self._seats = trio.Semaphore(seats) if seats else None

    @contextlib.asynccontextmanager
    async def seat(self) -> AsyncIterator[None]:
        """Hold a seat while a generation runs (waiting for one first, counted as waiting)."""
        if self._seats is not None:
            self.waiting += 1
            try:
                await self._seats.acquire()
            finally:
                self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            if self._seats is not None:
                self._seats.release()

    async def hang(self) -> None:
        """Never return, counted as running, as a hung engine's gauge shows its stuck requests."""
        self.running += 1
        try:
            await trio.sleep_forever()
        finally:
            self.running -= 1

    def prometheus(self, model: str) -> str:
        """The counters and gauges in Prometheus' text format, labelled with ``model``."""
        label = f'{{model_name="{model}"}}'
        lines = []
        for name, kind, value in (
            ("sim:prompt_tokens_total", "counter", self.prompt_tokens),
            ("sim:generation_tokens_total", "counter", self.generation_tokens),
            ("sim:num_requests_running", "gauge", self.running),
            ("sim:num_requests_waiting", "gauge", self.waiting),
        ):
            lines += [f"# TYPE {name.removesuffix('_total')} {kind}", f"{name}{label} {float(value)}"]
        return "\n".join(lines) + "\n"
