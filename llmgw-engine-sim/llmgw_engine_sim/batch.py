"""The sim's batch: seats for running generations (``--max-num-seqs``) and the metrics of ``/metrics``.

Named and labelled as vLLM's own (``vllm:`` prefix, ``model_name`` label), so
dashboards and alerts built for vLLM read the sim, and the agent's liveness
probe reads the sim as it reads vLLM: tokens produced, requests running.
Served: the gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (the share of ``--max-num-seqs`` seats taken: each running
sequence holds an equal share of the cache; 0 without a limit);
the counters ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total`` and
``vllm:request_success_total{finished_reason}``; the histograms
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds``,
``vllm:request_queue_time_seconds``, ``vllm:request_prompt_tokens`` and
``vllm:request_generation_tokens``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

__all__ = ["Batch", "Timing"]

# vLLM's buckets for these histograms
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class Timing:
    """One request's clock, on trio's: arrival, seat, first and last token."""

    __slots__ = ("arrived", "seated", "first", "last", "tokens")

    def __init__(self, arrived: float) -> None:
        self.arrived = arrived
        self.seated: float | None = None
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0


class Batch:
    """What rank 0 runs at once, and what it produced so far.

    :param seats: generations that may run at once; None: no limit.
    :param model: the ``model_name`` label of every metric (the first served name).
    """

    def __init__(self, seats: int | None = None, model: str = "") -> None:
        self.running = 0
        self.waiting = 0
        self._seats = trio.Semaphore(seats) if seats else None
        self.seats = seats
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=_TTFT,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=_ITL,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            labels,
            buckets=_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            labels,
            buckets=_LATENCY,
            registry=r,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            buckets=_LATENCY,
            registry=r,
        )
        self.request_prompt = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            buckets=_TOKENS,
            registry=r,
        )
        self.request_generation = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            labels,
            buckets=_TOKENS,
            registry=r,
        )
        self.registry.register(_Gauges(self))
        self.model = model
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
            metric.labels(model)  # every series from the start: 0 before the first request
        for reason in ("stop", "length"):
            self.success.labels(model, reason)

    @contextlib.asynccontextmanager
    async def seat(self, timing: Timing | None = None) -> AsyncIterator[None]:
        """Hold a seat while a generation runs (waiting for one first, counted as waiting)."""
        if self._seats is not None:
            self.waiting += 1
            try:
                await self._seats.acquire()
            finally:
                self.waiting -= 1
        self.running += 1
        if timing is not None:
            timing.seated = trio.current_time()
        try:
            yield
        finally:
            self.running -= 1
            if self._seats is not None:
                self._seats.release()

    @property
    def kv_cache_usage(self) -> float:
        """The share of the KV cache the running sequences hold: the share of seats taken (0: no limit)."""
        return min(1.0, self.running / self.seats) if self.seats else 0.0

    async def hang(self) -> None:
        """Never return, counted as running, as a hung engine's gauge shows its stuck requests."""
        self.running += 1
        try:
            await trio.sleep_forever()
        finally:
            self.running -= 1

    def prompt(self, tokens: int) -> None:
        """A request's prompt was processed (prefill)."""
        self.prompt_tokens.labels(self.model).inc(tokens)
        self.request_prompt.labels(self.model).observe(tokens)

    def token(self, timing: Timing) -> None:
        """One generation token was produced now for the request timed by ``timing``."""
        now = trio.current_time()
        self.generation_tokens.labels(self.model).inc()
        if timing.first is None:
            timing.first = now
            self.ttft.labels(self.model).observe(now - timing.arrived)
        elif timing.last is not None:
            self.itl.labels(self.model).observe(now - timing.last)
        timing.last = now
        timing.tokens += 1

    def finished(self, timing: Timing, reason: str | None) -> None:
        """A request ended with every token produced (``reason``: its last choice's finish reason)."""
        now = trio.current_time()
        self.success.labels(self.model, reason or "stop").inc()
        self.e2e.labels(self.model).observe(now - timing.arrived)
        self.queue.labels(self.model).observe((timing.seated or timing.arrived) - timing.arrived)
        self.request_generation.labels(self.model).observe(timing.tokens)
        if timing.first is not None and timing.last is not None and timing.tokens > 1:
            self.tpot.labels(self.model).observe((timing.last - timing.first) / (timing.tokens - 1))

    def prometheus(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry)


class _Gauges:
    """The running and waiting requests, read when scraped."""

    def __init__(self, batch: Batch) -> None:
        self._batch = batch

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        batch = self._batch
        for name, help_text, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", batch.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", batch.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", batch.kv_cache_usage),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([batch.model], value)
            yield family
