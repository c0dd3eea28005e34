"""The server's Prometheus metrics and its ``/health``, in a registry of its own.

Counted as things happen: ``llmgw_server_reconcile_runs_total`` and
``llmgw_server_reconcile_duration_seconds`` (a run: judge, schedule, persist,
wake); ``llmgw_server_sync_duration_seconds`` (recording an agent's sync, the
long-poll wait excluded; its ``_count`` is the sync rate);
``llmgw_server_requests_total{endpoint,status}``;
``llmgw_server_store_write_duration_seconds`` and
``llmgw_server_store_errors_total``; ``llmgw_server_events_total{kind}`` and
``llmgw_server_replica_failures_total{model,cause}`` (cause: a counted
:class:`~llmgw.wire.causes.FailureCause`: ``exited``, ``unhealthy``, ``hung``,
``oom``, ``ready_timeout``, ``shard_gone``, ``other``).

Read from the cluster at scrape time: ``llmgw_server_leader`` (1 while this
server leads), ``llmgw_server_leader_epoch`` (PostgreSQL),
``llmgw_server_nodes{state}``, ``llmgw_server_node_last_sync_age_seconds{node}``,
``llmgw_server_certificate_expiry_timestamp_seconds{node}`` (each node's, and
the server's own as ``node="(server)"``), ``llmgw_server_replicas{model,state}``
(``starting``, ``staging``, ``ready``, ``backoff``), ``llmgw_server_replicas_desired{model}``,
``llmgw_server_replicas_outdated{model}``, ``llmgw_server_replicas_unplaced{model}``,
``llmgw_server_rollout_state{model,state}`` (1 for the state it is in),
``llmgw_server_autoscale_signal{model,signal}`` and ``llmgw_server_autoscale_target{model,signal}``
(each autoscaled model's signals against their targets), ``llmgw_server_autoscale_at_max{model}``,
``llmgw_server_autoscale_decisions_total{model,direction}`` (the autoscaler's changes, up and down),
``llmgw_server_key_budget_used_ratio{key,period}`` (each budgeted key's use this period over its budget) and
``llmgw_server_catalog_revision``; LoRA adapters: ``llmgw_server_adapter_loads_total{model,outcome}``
(loads that ended: ``loaded``, or the :class:`~llmgw.wire.AdapterCause` of a failure),
``llmgw_server_adapter_load_seconds{model}``, and at scrape time ``llmgw_server_adapter_hits_total{model}``,
``llmgw_server_adapter_misses_total{model}`` (the gateways' reports) and
``llmgw_server_adapters_loaded{model}``.

Prometheus scrapes them on ``--metrics-listen`` (plain HTTP, ``/metrics`` and
``/health`` only), or on the HTTPS port with any certificate of the CA.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import trio
from cryptography import x509
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw.net.metrics import Health, ScrapeCollector, register_process_collectors
from llmgw.server.http.keys import active_keys
from llmgw.server.persist.sqlite import ping
from llmgw.server.state.records import Event, EventKind, ReplicaState
from llmgw.server.views.autoscale import autoscale_status
from llmgw.server.views.cluster import node_state
from llmgw.server.views.rollouts import rollout_status
from llmgw.wire import ObservedAdapter
from llmgw.wire.causes import FailureCause

__all__ = ["ServerMetrics", "NODE_STATES", "REPLICA_STATES", "ROLLOUT_STATES", "FAILURE_CAUSES"]

#: every state a node is counted in (zeros included, so alerts see a series)
NODE_STATES = ("ready", "cordoned", "draining", "lost")
#: every state a replica is counted in
REPLICA_STATES = (ReplicaState.STARTING, "staging", ReplicaState.READY, ReplicaState.BACKOFF)
ROLLOUT_STATES = ("done", "rolling", "waiting", "paused")
#: every cause a replica failure is counted under (zeros included)
FAILURE_CAUSES = tuple(cause for cause in FailureCause if cause.counted)
#: seconds a store check in ``/health`` may take before the store counts as not answering
STORE_CHECK_TIMEOUT = 2.0
#: a reconciler that has not run for this many ticks is reported stuck by ``/health``
STUCK_TICKS = 10

_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServerMetrics:
    """Every metric of one server process; the server wires :attr:`front` and :attr:`store` once running."""

    def __init__(self, cert: Path | None = None, *, tick: float = 1.0) -> None:
        self.registry = CollectorRegistry()
        register_process_collectors(self.registry)
        # first: its scrape makes the failure series of new models exist before they are collected
        self.registry.register(_ClusterCollector(self))
        r = self.registry
        self.reconcile_runs = Counter("llmgw_server_reconcile_runs", "Reconciler runs finished.", registry=r)
        self.reconcile_duration = Histogram(
            "llmgw_server_reconcile_duration_seconds",
            "Seconds one reconciler run took: judging, scheduling, persisting, waking.",
            buckets=_FAST,
            registry=r,
        )
        self.sync_duration = Histogram(
            "llmgw_server_sync_duration_seconds",
            "Seconds spent recording one agent sync (the long-poll wait excluded).",
            buckets=_FAST,
            registry=r,
        )
        self.requests = Counter(
            "llmgw_server_requests",
            "Requests answered on the HTTPS port, by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.store_write = Histogram(
            "llmgw_server_store_write_duration_seconds",
            "Seconds one write of the cluster's changes to the store took.",
            buckets=_FAST,
            registry=r,
        )
        self.store_errors = Counter(
            "llmgw_server_store_errors", "Writes to the store that failed.", registry=r
        )
        self.events = Counter(
            "llmgw_server_events", "Events recorded (ctl events), by kind.", ["kind"], registry=r
        )
        self.replica_failures = Counter(
            "llmgw_server_replica_failures",
            f"Replica failures (torn down and rebuilt), by model and cause: {', '.join(FAILURE_CAUSES)}.",
            ["model", "cause"],
            registry=r,
        )
        self.adapter_loads = Counter(
            "llmgw_server_adapter_loads",
            "LoRA adapter loads that ended, by model and outcome: loaded, or the failure's cause.",
            ["model", "outcome"],
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            "llmgw_server_adapter_load_seconds",
            "Seconds a LoRA adapter load took on its replica (staging and the engine's call).",
            ["model"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        self.tick = tick
        #: the server's request handler (``llmgw.server.main._Starting``): its ``app`` once leading
        self.front: Any = None
        self.store: Any = None
        self.cert_not_after: float | None = None
        if cert is not None and cert.exists():
            certificate = x509.load_pem_x509_certificate(cert.read_bytes())
            self.cert_not_after = certificate.not_valid_after_utc.timestamp()
        #: trio time of the last reconciler run, and of the last failed store write (None: none yet)
        self.last_run: float | None = None
        self.last_store_error: tuple[float, str] | None = None
        self._touched: set[str] = set()
        #: the (host, port) ``--metrics-listen`` is bound to, once serving
        self.listen_address: tuple[str, int] | None = None

    # -- counted as it happens ----------------------------------------------------------------------

    def reconciled(self, seconds: float) -> None:
        """A reconciler run finished after ``seconds``."""
        self.reconcile_runs.inc()
        self.reconcile_duration.observe(seconds)
        self.last_run = trio.current_time()

    def adapters_ended(self, ended: list[tuple[str, ObservedAdapter]]) -> None:
        """Count the adapter loads that ended (``(model, report)``); called after each reconciler run."""
        for model, seen in ended:
            outcome = seen.cause.value if seen.cause is not None else seen.state.value
            self.adapter_loads.labels(model, outcome).inc()
            if seen.seconds is not None:
                self.adapter_load_seconds.labels(model).observe(seen.seconds)

    def store_written(self, seconds: float, error: BaseException | None = None) -> None:
        """A store write ended after ``seconds`` (``error``: it failed)."""
        self.store_write.observe(seconds)
        if error is not None:
            self.store_errors.inc()
            self.last_store_error = (trio.current_time(), str(error).strip() or type(error).__name__)

    def touch(self, models: Iterable[str]) -> None:
        """Make every model's failure series exist at 0, so the first failure shows in ``increase()``."""
        for model in models:
            if model not in self._touched:
                self._touched.add(model)
                for cause in FAILURE_CAUSES:
                    self.replica_failures.labels(model, cause)

    def answered(self, endpoint: str, status: int) -> None:
        """A request to ``endpoint`` (the handler's name) was answered ``status``."""
        self.requests.labels(endpoint, str(status)).inc()

    def event(self, event: Event, model_of: Callable[[str], str | None]) -> None:
        """An event was recorded: counted by kind, and as a failure when it is a replica's."""
        self.events.labels(event.kind).inc()
        if event.kind == EventKind.REPLICA and event.cause is not None and event.cause.counted:
            self.replica_failures.labels(model_of(event.subject) or "(unknown)", event.cause).inc()

    # -- Prometheus' service discovery of engines ---------------------------------------------------

    def engine_targets(self) -> list[dict[str, Any]]:
        """``GET /sd/engines``: rank 0 of every placed replica, in Prometheus' ``http_sd_config`` shape.

        One target group per replica: ``["ADDRESS:PORT"]`` of rank 0 (where the
        engine serves ``/metrics``), labelled ``model``, ``replica``, ``node``
        and ``engine``. Empty while this server does not lead.
        """
        app = self.front.app if self.front is not None else None
        if app is None:
            return []
        cluster = app.cluster
        groups = []
        for record in sorted(cluster.replicas.values(), key=lambda r: r.id):
            rank0 = record.placement.shards[0]
            node = cluster.nodes.get(rank0.node_id)
            if node is None or record.state == "backoff":
                continue
            launch = record.launch
            labels = {"model": record.placement.model, "replica": record.id, "node": rank0.node_id}
            if launch is not None:
                labels["engine"] = launch.profile.engine
            groups.append({"targets": [f"{node.address}:{rank0.port}"], "labels": labels})
        return groups

    # -- /health ------------------------------------------------------------------------------------

    async def health(self) -> Health:
        """``/health``: 200 ``ok`` while leading with a store that answers; else 503 naming what is wrong."""
        front = self.front
        app = front.app if front is not None else None
        lease = _lease(self.store)
        if app is None:
            if front is not None and front.refusal is not None and lease is not None and lease.epoch is None:
                seen = lease.seen
                leader = seen.address if seen is not None and seen.expires_in > 0 else None
                return 503, {"status": "standby", "leader": leader, "detail": "this server is a standby"}
            detail = front.detail if front is not None else "starting"
            return 503, {"status": "starting", "detail": detail}
        body: dict[str, Any] = {"status": "ok", "role": "leader"}
        if lease is not None:
            body["epoch"] = lease.epoch
        cluster = app.cluster
        body["nodes"] = len(cluster.nodes)
        body["replicas"] = len(cluster.replicas)
        body["replicas_ready"] = sum(r.state == "ready" for r in cluster.replicas.values())
        problems = []
        now = trio.current_time()
        if self.last_run is not None and now - self.last_run > STUCK_TICKS * self.tick:
            problems.append(f"the reconciler has not run for {now - self.last_run:.0f} s")
        if self.last_store_error is not None and now - self.last_store_error[0] < 60:
            problems.append(f"a store write failed {now - self.last_store_error[0]:.0f} s ago: "
                            f"{self.last_store_error[1]}")  # fmt: skip
        problem = await _check_store(self.store)
        if problem is not None:
            problems.append(problem)
        if problems:
            body.update(status="degraded", problems=problems)
            return 503, body
        return 200, body


async def _check_store(store: Any) -> str | None:
    """None when the store answers a trivial query within :data:`STORE_CHECK_TIMEOUT`, else what failed."""
    if store is None:
        return None
    with trio.move_on_after(STORE_CHECK_TIMEOUT):
        try:
            await store.run(ping)
        except Exception as exc:  # any failure of the store is what /health reports
            return f"the store ({store.path}) fails: {str(exc).strip() or type(exc).__name__}"
        return None
    return f"the store ({store.path}) did not answer within {STORE_CHECK_TIMEOUT:g} s"


def _lease(store: Any) -> Any:
    """The leader lease of a PostgreSQL store (its ``before_write`` is the lease's fence), else None."""
    fence = getattr(store, "before_write", None)
    return getattr(fence, "__self__", None)


class _ClusterCollector(ScrapeCollector):
    """Gauges read from the leader's cluster at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        front = metrics.front
        app = front.app if front is not None else None
        lease = _lease(metrics.store)
        yield GaugeMetricFamily(
            "llmgw_server_leader",
            "1 while this server leads with its state loaded; 0 while it starts or stands by.",
            value=int(app is not None),
        )
        if lease is not None:
            epoch = lease.epoch if lease.epoch is not None else (lease.seen.epoch if lease.seen else 0)
            yield GaugeMetricFamily(
                "llmgw_server_leader_epoch",
                "The fencing epoch this server leads under (a standby: the latest it saw).",
                value=epoch or 0,
            )
        expiry = GaugeMetricFamily(
            "llmgw_server_certificate_expiry_timestamp_seconds",
            "When certificates expire (UNIX time): each node's last sync certificate, and the server's own "
            'as node="(server)".',
            labels=["node"],
        )
        if metrics.cert_not_after is not None:
            expiry.add_metric(["(server)"], metrics.cert_not_after)
        if app is None:
            yield expiry
            return
        cluster = app.cluster
        metrics.touch(cluster.catalog.models)
        yield from _node_families(cluster, expiry)
        yield from _replica_families(cluster)
        yield from _autoscale_families(cluster)
        yield from _adapter_families(cluster)
        yield _budget_family(app)
        yield GaugeMetricFamily(
            "llmgw_server_catalog_revision", "The catalog revision in force.", value=cluster.catalog_revision
        )


def _adapter_families(cluster: Any) -> Iterator[Metric]:
    """Requests for LoRA adapters the gateways found loaded (hits) or not (misses), and adapters loaded."""
    hits = CounterMetricFamily(
        "llmgw_server_adapter_hits", "Requests for a LoRA adapter a replica had loaded (gateways' reports).",
        labels=["model"],
    )
    misses = CounterMetricFamily(
        "llmgw_server_adapter_misses",
        "Requests for a LoRA adapter no replica had loaded: each waited for a load (gateways' reports).",
        labels=["model"],
    )
    loaded = GaugeMetricFamily(
        "llmgw_server_adapters_loaded", "LoRA adapters loaded, by model.", labels=["model"]
    )
    book = cluster.adapters
    counts: dict[str, list[int]] = {}
    for (model, _adapter), use in book.uses.items():
        count = counts.setdefault(model, [0, 0])
        count[0] += use.hits
        count[1] += use.misses
    for model, (hit, miss) in sorted(counts.items()):
        hits.add_metric([model], hit)
        misses.add_metric([model], miss)
    per_model: dict[str, int] = {}
    for replica, names in book.routed.items():
        record = cluster.replicas.get(replica)
        if record is not None:
            per_model[record.placement.model] = per_model.get(record.placement.model, 0) + len(names)
    for model, count in sorted(per_model.items()):
        loaded.add_metric([model], count)
    yield from (hits, misses, loaded)


def _budget_family(app: Any) -> Metric:
    """Each live key with a budget: the share of it used this period (declared always: an alert reads it)."""
    used = GaugeMetricFamily(
        "llmgw_server_key_budget_used_ratio",
        "Tokens an API key used this period over its budget (1: spent, its requests refused), by key name "
        "and period (day, month); counted from the gateways' reports since this server began to lead.",
        labels=["key", "period"],
    )
    now = time.time()
    for name, limits in sorted(active_keys(app.keys)[1].items()):
        if limits.budget is not None:
            share = app.budgets.used(name, limits.budget_period, now) / limits.budget
            used.add_metric([name, limits.budget_period], share)
    return used


def _autoscale_families(cluster: Any) -> Iterator[Metric]:
    """Each autoscaled model's signals against their targets, and the autoscaler's changes by direction."""
    value = GaugeMetricFamily(
        "llmgw_server_autoscale_signal",
        "An autoscaled model's signal as its ready replicas report it (waiting_per_replica, kv_cache_usage).",
        labels=["model", "signal"],
    )
    target = GaugeMetricFamily(
        "llmgw_server_autoscale_target",
        "An autoscaled model's target for a signal.",
        labels=["model", "signal"],
    )
    at_max = GaugeMetricFamily(
        "llmgw_server_autoscale_at_max",
        "1 while an autoscaled model is held at its max with a signal over its target.",
        labels=["model"],
    )
    for status in autoscale_status(cluster, time.time()).models:
        for signal in status.signals:
            target.add_metric([status.model, signal.name], signal.target)
            if signal.value is not None:
                value.add_metric([status.model, signal.name], signal.value)
        at_max.add_metric([status.model], int(status.cause == "at-max"))
    changes = CounterMetricFamily(
        "llmgw_server_autoscale_decisions",
        "The autoscaler's changes of a model's desired replicas, by direction (up, down).",
        labels=["model", "direction"],
    )
    for (model, direction), count in sorted(cluster.autoscale.changes.items()):
        changes.add_metric([model, direction], count)
    yield from (value, target, at_max, changes)


def _node_families(cluster: Any, expiry: GaugeMetricFamily) -> Iterator[Metric]:
    states = dict.fromkeys(NODE_STATES, 0)
    age = GaugeMetricFamily(
        "llmgw_server_node_last_sync_age_seconds", "Seconds since each node last synced.", labels=["node"]
    )
    now = time.time()
    for node in cluster.nodes.values():
        states[node_state(node)] = states.get(node_state(node), 0) + 1
        age.add_metric([node.node_id], max(0.0, now - node.last_seen))
        if node.cert_not_after:
            expiry.add_metric([node.node_id], node.cert_not_after)
    nodes = GaugeMetricFamily("llmgw_server_nodes", "Nodes by state.", labels=["state"])
    for state, count in states.items():
        nodes.add_metric([state], count)
    yield nodes
    each = GaugeMetricFamily(
        "llmgw_server_node_state",
        "Each node's state: 1 for the state it is in (ready, cordoned, draining, lost), 0 for the others.",
        labels=["node", "state"],
    )
    for node in sorted(cluster.nodes.values(), key=lambda n: n.node_id):
        current = node_state(node)
        for state in NODE_STATES:
            each.add_metric([node.node_id, state], int(state == current))
    yield each
    yield age
    yield expiry


def _replica_families(cluster: Any) -> Iterator[Metric]:
    models = sorted(cluster.catalog.models)
    counts = {(m, s): 0 for m in models for s in REPLICA_STATES}
    outdated = dict.fromkeys(models, 0)
    for record in cluster.replicas.values():
        model = record.placement.model
        state = record.state
        if state == "starting" and _staging(cluster, record):
            state = "staging"
        counts[(model, state)] = counts.get((model, state), 0) + 1
        if record.placement.replaces is None and cluster.is_outdated(record):
            outdated[model] = outdated.get(model, 0) + 1
    replicas = GaugeMetricFamily(
        "llmgw_server_replicas",
        "Replicas by model and state (starting, staging, ready, backoff); a drain's or rollout's "
        "replacements included.",
        labels=["model", "state"],
    )
    for (model, state), count in sorted(counts.items()):
        replicas.add_metric([model, state], count)
    yield replicas
    desired = GaugeMetricFamily(
        "llmgw_server_replicas_desired",
        "Replicas the catalog asks for, by model (for an autoscaled model, what the autoscaler asks).",
        labels=["model"],
    )
    scaled = cluster.scaled_catalog()
    for model in models:
        desired.add_metric([model], scaled.models[model].replicas)
    yield desired
    stale = GaugeMetricFamily(
        "llmgw_server_replicas_outdated",
        "Replicas running an older command than the catalog's.",
        labels=["model"],
    )
    for model, count in sorted(outdated.items()):
        stale.add_metric([model], count)
    yield stale
    unplaced = GaugeMetricFamily(
        "llmgw_server_replicas_unplaced", "Replicas that cannot be placed now, by model.", labels=["model"]
    )
    waiting = dict.fromkeys(models, 0)
    for item in cluster.unplaced:
        waiting[item.model] = waiting.get(item.model, 0) + 1
    for model, count in sorted(waiting.items()):
        unplaced.add_metric([model], count)
    yield unplaced
    rollout = GaugeMetricFamily(
        "llmgw_server_rollout_state",
        "Each model's rollout: 1 for the state it is in (done, rolling, waiting, paused), 0 for the others.",
        labels=["model", "state"],
    )
    for status in rollout_status(cluster).rollouts:
        for state in ROLLOUT_STATES:
            rollout.add_metric([status.model, state], int(status.state == state))
    yield rollout


def _staging(cluster: Any, record: Any) -> bool:
    """Whether any shard of ``record`` reports ``staging`` (copying its weights)."""
    for node_id, key in record.shard_keys():
        node = cluster.nodes.get(node_id)
        shard = node.observed.get(key) if node is not None else None
        if shard is not None and shard.state == "staging":
            return True
    return False
