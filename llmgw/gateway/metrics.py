"""The gateway's Prometheus metrics, in a registry of its own (never prometheus-client's global one).

Counted as requests go: ``llmgw_gateway_requests_total{model,endpoint,status}``
(status ``499`` when the client left first), the histograms
``llmgw_gateway_request_duration_seconds{model,endpoint}`` (until the last
byte of the response) and ``llmgw_gateway_time_to_first_token_seconds{model}``
(streamed responses: until the first event from the engine),
``llmgw_gateway_upstream_errors_total{replica,kind}``,
``llmgw_gateway_retries_total{model}``,
``llmgw_gateway_adapter_requests_total{model,outcome}`` (requests for a LoRA adapter: ``hit`` when a replica
had it loaded, ``miss`` when it was held for a load), the tokens of each answer's ``usage``
(for a stream, its final usage chunk, sent when the client asks with
``stream_options: {"include_usage": true}``)
``llmgw_gateway_prompt_tokens_total{model,key}`` and
``llmgw_gateway_completion_tokens_total{model,key}``, requests per API key
``llmgw_gateway_key_requests_total{key,model,status}`` (``key`` is the key's
name, ``(none)`` without keys; never the key), and
``llmgw_gateway_inter_token_latency_seconds{model}`` (streams: between two
consecutive chunks from the engine). Mid-stream migration
(:mod:`llmgw.gateway.migration`): ``llmgw_gateway_stream_migrations_total{model,cause}``
(streams that went on from another replica, by why the first broke),
``llmgw_gateway_streams_not_continued_total{model,reason}`` (broken streams
that ended with an error event, by why), ``llmgw_gateway_migrated_tokens_total{model}``
(tokens carried over: sent again as the continuation's prompt) and
``llmgw_gateway_migration_gap_seconds{model}`` (the gap a client saw: from
the broken replica's last event to the next replica's first); the queue:
``llmgw_gateway_queue_seconds{key}``
(requests that waited for a seat, :mod:`llmgw.gateway.queue`) and
``llmgw_gateway_queue_overflows_total{model,cause}`` (503s of a full queue or a
wait too long).

Read at scrape time from the live state: ``llmgw_gateway_in_flight_requests{model,replica}``,
``llmgw_gateway_breaker_state{model,replica}`` (0 closed, 1 half-open, 2 open),
``llmgw_gateway_ready_replicas{model}``, ``llmgw_gateway_routes_age_seconds``
(since the server last answered), ``llmgw_gateway_routes_feed_up``,
``llmgw_gateway_routes_revision``,
``llmgw_gateway_certificate_expiry_timestamp_seconds`` (the certificate it reads
routes with, when it has one) and ``llmgw_gateway_held_requests{model}`` (requests
held for a model at zero replicas, for the models that wake on demand), and
``llmgw_gateway_queued_requests{model,priority}`` (requests waiting for a seat).

With ``--workers N`` the counted metrics are summed over every worker (see
:mod:`llmgw.gateway.workers`); the live ones are the answering worker's.
``process_*`` covers the whole gateway: one process alone, or with workers
the parent and every worker, one ``pid`` label each
(:class:`llmgw.net.metrics.ProcessGroupCollector`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from cryptography import x509
from prometheus_client import CollectorRegistry, Counter, Histogram, values
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from llmgw.gateway.balancer import Balancer
from llmgw.gateway.demand import Demand
from llmgw.gateway.migration import MigrationCause, NotContinued
from llmgw.gateway.queue import Queues
from llmgw.gateway.routes import RoutesWatcher
from llmgw.gateway.workers import MULTIPROC_ENV, PARENT_ENV
from llmgw.net.metrics import ProcessGroupCollector, register_process_collectors

__all__ = ["GatewayMetrics", "UNKNOWN_MODEL"]

#: the ``model`` label of requests naming a model the catalog does not have (keeps the label set bounded)
UNKNOWN_MODEL = "(unknown)"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)
_GAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: the ``key`` label of requests served without API keys (``--no-keys``)
NO_KEY = "(none)"


class GatewayMetrics:
    """Every metric of one gateway; :meth:`render` answers ``GET /metrics``."""

    def __init__(self, balancer: Balancer, watcher: Callable[[], RoutesWatcher | None]) -> None:
        self.registry = CollectorRegistry()
        registry: CollectorRegistry | None = self.registry
        shared = os.environ.get(MULTIPROC_ENV)
        if shared:  # one of several workers: counts go to files, a scrape sums every worker's
            values.ValueClass = values.MultiProcessValue()
            MultiProcessCollector(self.registry, shared)
            registry = None
        parent = os.environ.get(PARENT_ENV, "")
        if shared and parent.isdigit():
            self.registry.register(ProcessGroupCollector(int(parent)))
        else:
            register_process_collectors(self.registry)
        self.requests = Counter(
            "llmgw_gateway_requests",
            "Requests answered, by model, endpoint and status (499: the client left first).",
            ["model", "endpoint", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "llmgw_gateway_request_duration_seconds",
            "Seconds from a request's arrival to the end of its response.",
            ["model", "endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "llmgw_gateway_time_to_first_token_seconds",
            "Seconds from a streamed request's arrival to the first event from the engine.",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.upstream_errors = Counter(
            "llmgw_gateway_upstream_errors",
            "Failed attempts on a replica, by kind: connect, closed, status_502, status_503, timeout, "
            "mid_stream.",
            ["replica", "kind"],
            registry=registry,
        )
        self.adapter_requests = Counter(
            "llmgw_gateway_adapter_requests",
            "Requests for a LoRA adapter: a replica had it loaded (hit), or none (miss: held for a load).",
            ["model", "outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "llmgw_gateway_retries",
            "Attempts on another replica after a failure.",
            ["model"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "llmgw_gateway_prompt_tokens",
            "Prompt tokens of answered requests (from the engine's usage), by model and API key name.",
            ["model", "key"],
            registry=registry,
        )
        self.completion_tokens = Counter(
            "llmgw_gateway_completion_tokens",
            "Completion tokens of answered requests (from the engine's usage), by model and API key name.",
            ["model", "key"],
            registry=registry,
        )
        self.key_requests = Counter(
            "llmgw_gateway_key_requests",
            "Requests by API key name (never the key), model and status.",
            ["key", "model", "status"],
            registry=registry,
        )
        self.key_refusals = Counter(
            "llmgw_gateway_key_refusals",
            "Requests refused by their API key's limits, by key name and the limit hit (rpm, tpm, "
            "concurrency, models, budget).",
            ["key", "limit"],
            registry=registry,
        )
        self.queue_seconds = Histogram(
            "llmgw_gateway_queue_seconds",
            "Seconds a request waited in its model's queue for a seat (requests that waited), by API key "
            "name (never the key).",
            ["key"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_overflows = Counter(
            "llmgw_gateway_queue_overflows",
            "Requests answered 503 by a model's queue, by model and cause (queue_full, queue_timeout).",
            ["model", "cause"],
            registry=registry,
        )
        self.inter_token = Histogram(
            "llmgw_gateway_inter_token_latency_seconds",
            "Seconds between two consecutive chunks of a streamed response from the engine.",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.migrations = Counter(
            "llmgw_gateway_stream_migrations",
            "Streams that went on from another replica after theirs broke mid-way, by model and cause: "
            + ", ".join(c.value for c in MigrationCause)
            + ".",
            ["model", "cause"],
            registry=registry,
        )
        self.not_continued_total = Counter(
            "llmgw_gateway_streams_not_continued",
            "Streams broken mid-way that ended with an error event instead of going on elsewhere, by model "
            "and reason: " + ", ".join(r.value for r in NotContinued) + ".",
            ["model", "reason"],
            registry=registry,
        )
        self.migrated_tokens = Counter(
            "llmgw_gateway_migrated_tokens",
            "Tokens a continuing replica was sent as the start of the answer (prefilled again).",
            ["model"],
            registry=registry,
        )
        self.gap = Histogram(
            "llmgw_gateway_migration_gap_seconds",
            "Seconds a client waited between the broken replica's last event and the next replica's first.",
            ["model"],
            buckets=_GAP_BUCKETS,
            registry=registry,
        )
        self._live = _LiveCollector(balancer, watcher)
        self.registry.register(self._live)
        self._itl_children: dict[str, Histogram] = {}
        self._key_children: dict[tuple[str, str, int], Counter] = {}
        self._token_children: dict[tuple[str, str], tuple[Counter, Counter]] = {}
        self._request_children: dict[tuple[str, str, int], Counter] = {}
        self._duration_children: dict[tuple[str, str], Histogram] = {}
        self._ttft_children: dict[str, Histogram] = {}

    def request_done(self, model: str, endpoint: str, status: int, seconds: float) -> None:
        """Count one answered request and its duration."""
        key = (model, endpoint, status)
        counter = self._request_children.get(key)
        if counter is None:
            counter = self._request_children[key] = self.requests.labels(model, endpoint, str(status))
        counter.inc()
        histogram = self._duration_children.get(key[:2])
        if histogram is None:
            histogram = self._duration_children[key[:2]] = self.duration.labels(model, endpoint)
        histogram.observe(seconds)

    def first_token(self, model: str, seconds: float) -> None:
        """Record a streamed response's time to first token."""
        histogram = self._ttft_children.get(model)
        if histogram is None:
            histogram = self._ttft_children[model] = self.ttft.labels(model)
        histogram.observe(seconds)

    def refused_by_limit(self, key: str, limit: str) -> None:
        """Count a request of API key ``key`` (its name) refused by its ``limit`` (a ``Cause`` value)."""
        self.key_refusals.labels(key, limit).inc()

    def by_key(self, key: str, model: str, status: int, usage: tuple[int, int] | None) -> None:
        """Count a request of API key ``key`` (its name) and the (prompt, completion) tokens of its usage."""
        labels = (key, model, status)
        counter = self._key_children.get(labels)
        if counter is None:
            counter = self._key_children[labels] = self.key_requests.labels(key, model, str(status))
        counter.inc()
        if usage is not None:
            tokens = self._token_children.get((model, key))
            if tokens is None:
                tokens = self._token_children[(model, key)] = (
                    self.prompt_tokens.labels(model, key),
                    self.completion_tokens.labels(model, key),
                )
            tokens[0].inc(usage[0])
            tokens[1].inc(usage[1])

    def queued(self, key: str, seconds: float) -> None:
        """Record that a request of API key ``key`` (its name) waited ``seconds`` for a seat."""
        self.queue_seconds.labels(key).observe(seconds)

    def queue_overflow(self, model: str, cause: str) -> None:
        """Count a request for ``model`` turned away by its queue (a ``QueueCause`` value)."""
        self.queue_overflows.labels(model, cause).inc()

    def inter_token_latency(self, model: str, seconds: float) -> None:
        """Record the gap between two chunks of a stream."""
        histogram = self._itl_children.get(model)
        if histogram is None:
            histogram = self._itl_children[model] = self.inter_token.labels(model)
        histogram.observe(seconds)

    def upstream_error(self, replica: str, kind: str) -> None:
        """Count a failed attempt on ``replica``."""
        self.upstream_errors.labels(replica, kind).inc()

    def adapter_request(self, model: str, outcome: str) -> None:
        """A request for a LoRA adapter of ``model`` found it loaded (``hit``) or not (``miss``)."""
        self.adapter_requests.labels(model, outcome).inc()

    def retry(self, model: str) -> None:
        """Count a retry on another replica."""
        self.retries.labels(model).inc()

    def migration(self, model: str, cause: MigrationCause, carried: int) -> None:
        """Count a stream that went on from another replica after ``cause``, with ``carried`` tokens
        sent again as the start of its answer."""
        self.migrations.labels(model, cause.value).inc()
        if carried:
            self.migrated_tokens.labels(model).inc(carried)

    def not_continued(self, model: str, reason: NotContinued) -> None:
        """Count a broken stream that ended with an error event, and why it did not go on elsewhere."""
        self.not_continued_total.labels(model, reason.value).inc()

    def migration_gap(self, model: str, seconds: float) -> None:
        """Record the gap a migrated stream's client saw."""
        self.gap.labels(model).observe(seconds)

    def certificate(self, path: Path | None) -> None:
        """Export when the certificate at ``path`` (the gateway's, for the routes feed) expires."""
        if path is not None and path.exists():
            certificate = x509.load_pem_x509_certificate(path.read_bytes())
            self._live.cert_not_after = certificate.not_valid_after_utc.timestamp()

    def held_from(self, demand: Demand) -> None:
        """Report the held requests of ``demand`` (``llmgw_gateway_held_requests``); called once, at start."""
        self._live.demand = demand

    def queued_from(self, queues: Queues) -> None:
        """Report the requests waiting in ``queues`` (``llmgw_gateway_queued_requests``); called at start."""
        self._live.queues = queues

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition for a scraper sending ``Accept: accept``: (body, content type)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class _LiveCollector:
    """Gauges computed from the balancer and the routes watcher at scrape time."""

    def __init__(self, balancer: Balancer, watcher: Callable[[], RoutesWatcher | None]) -> None:
        self._balancer = balancer
        self._watcher = watcher
        #: when the gateway's certificate expires (UNIX time), None without one
        self.cert_not_after: float | None = None
        #: the proxy's requests held for models at zero replicas (:mod:`llmgw.gateway.demand`), once set
        self.demand: Demand | None = None
        #: the model queues (:mod:`llmgw.gateway.queue`), once set
        self.queues: Queues | None = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "llmgw_gateway_in_flight_requests",
            "Requests in flight through this gateway, per replica.",
            labels=["model", "replica"],
        )
        breaker = GaugeMetricFamily(
            "llmgw_gateway_breaker_state",
            "Circuit breaker per replica: 0 closed, 1 half-open, 2 open.",
            labels=["model", "replica"],
        )
        ready = GaugeMetricFamily(
            "llmgw_gateway_ready_replicas", "Ready replicas per model, as routed.", labels=["model"]
        )
        watcher = self._watcher()
        models = sorted(watcher.table.models) if watcher is not None and watcher.table is not None else []
        for model in models:
            replicas = self._balancer.replicas(model)
            ready.add_metric([model], len(replicas))
            for replica in replicas:
                in_flight.add_metric([model, replica.name], replica.in_flight)
                breaker.add_metric([model, replica.name], int(replica.breaker.state))
        yield in_flight
        yield breaker
        yield ready
        if self.demand is not None:  # declared always: a dashboard reads it
            held = GaugeMetricFamily(
                "llmgw_gateway_held_requests",
                "Requests held for a model at zero replicas until a replica of it is ready.",
                labels=["model"],
            )
            for model in sorted(self.demand.wake_on_demand):
                held.add_metric([model], self.demand.held[model])
            yield held
        if self.queues is not None:  # declared always: a dashboard reads it
            queued = GaugeMetricFamily(
                "llmgw_gateway_queued_requests",
                "Requests waiting for a seat in a model's queue, by model and priority class.",
                labels=["model", "priority"],
            )
            for (model, priority), waiting in sorted(self.queues.depth().items()):
                queued.add_metric([model, priority], waiting)
            yield queued
        if self.cert_not_after is not None:
            yield GaugeMetricFamily(
                "llmgw_gateway_certificate_expiry_timestamp_seconds",
                "When the certificate this gateway reads routes with expires (UNIX time).",
                value=self.cert_not_after,
            )
        if watcher is not None:
            yield GaugeMetricFamily(
                "llmgw_gateway_routes_age_seconds",
                "Seconds since the server's routes feed last answered.",
                value=watcher.age(),
            )
            yield GaugeMetricFamily(
                "llmgw_gateway_routes_feed_up",
                "1 while the server's routes feed answers, 0 during an outage or before its first answer.",
                value=1 if watcher.up else 0,
            )
            yield GaugeMetricFamily(
                "llmgw_gateway_routes_revision",
                "The routes revision in force (0 before the first answer).",
                value=watcher.table.revision if watcher.table is not None else 0,
            )
