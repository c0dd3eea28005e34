"""The agent's Prometheus metrics and ``/health``, served on ``--metrics-listen`` (off unless given).

Counted as things happen: ``llmgw_agent_shard_starts_total{model}``,
``llmgw_agent_shard_failures_total{model,cause}`` (a shard that exited or
became unhealthy: the server restarts its replica; cause: the shard's
:class:`~llmgw.wire.causes.FailureCause`, ``exited``, ``unhealthy``, ``hung``
or ``oom``) and ``llmgw_agent_canary_results_total{model,result}``
(each liveness canary: ``ok``, ``busy``, ``failed``, ``hung``).

Read at scrape time: ``llmgw_agent_shards{state}``, ``llmgw_agent_gpus``,
``llmgw_agent_problems`` (discovery and engine-check problems ``ctl nodes`` shows),
``llmgw_agent_engine_usable{engine}`` (1: found and passed engine-check),
``llmgw_agent_server_last_sync_age_seconds``, ``llmgw_agent_fenced``,
``llmgw_agent_certificate_expiry_timestamp_seconds``,
``llmgw_agent_staging_fetched_bytes_total`` (model files received from peers;
its ``rate()`` is the staging rate), ``llmgw_agent_peer_served_bytes_total``
and ``llmgw_agent_peer_uploads``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw.net.metrics import Health, ScrapeCollector, register_process_collectors
from llmgw.wire import SHARD_STATES, ObservedShard
from llmgw.wire.causes import SHARD_CAUSES, FailureCause

__all__ = ["AgentMetrics"]

#: seconds without an answer from the server after which ``/health`` says so
SYNC_STALE = 30.0


class AgentMetrics:
    """Every metric of one agent; :attr:`agent` is set once the agent runs."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        register_process_collectors(self.registry)
        self.starts = Counter(
            "llmgw_agent_shard_starts",
            "Shards this agent started, by model.",
            ["model"],
            registry=self.registry,
        )
        self.failures = Counter(
            "llmgw_agent_shard_failures",
            "Shards that exited or turned unhealthy (their replica is restarted), by model and cause: "
            f"{', '.join(SHARD_CAUSES)}.",
            ["model", "cause"],
            registry=self.registry,
        )
        self.canaries = Counter(
            "llmgw_agent_canary_results",
            "Liveness canaries sent to rank 0, by model and result: ok, busy (no answer, tokens "
            "produced), failed (connection broke), hung.",
            ["model", "result"],
            registry=self.registry,
        )
        #: the :class:`llmgw.agent.sync.Agent`, once running
        self.agent: Any = None
        self.registry.register(_AgentCollector(self))
        #: the (host, port) ``--metrics-listen`` is bound to, once serving
        self.listen_address: tuple[str, int] | None = None

    def started(self, supervisor: Any) -> None:
        """The agent is about to start ``supervisor``'s shard."""
        model = supervisor.desired.spec.served_name
        self.starts.labels(model).inc()
        for cause in SHARD_CAUSES:  # at 0 from the start: increase() sees the first
            self.failures.labels(model, cause)
        for result in ("ok", "busy", "failed", "hung"):
            self.canaries.labels(model, result)

    def shard_changed(self, supervisor: Any, before: ObservedShard | None, after: ObservedShard) -> None:
        """A shard's observed state changed from ``before`` to ``after`` (called by the agent)."""
        old = before.state if before is not None else None
        if old == after.state:
            return
        model = supervisor.desired.spec.served_name
        if after.state in ("exited", "unhealthy") and old not in ("exited", "unhealthy", "stopping"):
            cause = after.cause or FailureCause(after.state)  # an exited or unhealthy shard has a cause
            self.failures.labels(model, cause).inc()

    def canary(self, supervisor: Any, result: str) -> None:
        """One liveness canary on ``supervisor``'s rank 0 ended with ``result``."""
        self.canaries.labels(supervisor.desired.spec.served_name, result).inc()

    async def health(self) -> Health:
        """``/health``: 200 while the agent syncs with the server and is not fenced; else 503 and why."""
        agent = self.agent
        if agent is None:
            return 503, {"status": "starting", "detail": "discovering this node"}
        body: dict[str, Any] = {"status": "ok", "node": agent.config.node, "shards": len(agent.supervisors)}
        problems = []
        if agent.fenced is not None:
            problems.append(f"fenced: {agent.fenced}")
        if agent.last_sync is None:
            problems.append("no answer from the server yet")
        elif (age := trio.current_time() - agent.last_sync) > SYNC_STALE:
            problems.append(f"no answer from the server for {age:.0f} s")
        if problems:
            body.update(status="degraded", problems=problems)
            return 503, body
        return 200, body


class _AgentCollector(ScrapeCollector):
    """Gauges read from the agent at scrape time."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        agent = self._metrics.agent
        if agent is None:
            return
        shards = GaugeMetricFamily("llmgw_agent_shards", "Shards on this node by state.", labels=["state"])
        counts = dict.fromkeys(SHARD_STATES, 0)
        for observed in list(agent.observed.values()):
            counts[observed.state] = counts.get(observed.state, 0) + 1
        for state, count in counts.items():
            shards.add_metric([state], count)
        yield shards
        facts = agent.facts
        yield GaugeMetricFamily(
            "llmgw_agent_gpus", "GPUs discovery found on this node.", value=len(facts.gpus)
        )
        yield GaugeMetricFamily(
            "llmgw_agent_problems",
            "Problems discovery and engine-check found on this node (ctl nodes lists them).",
            value=len(facts.problems),
        )
        usable = GaugeMetricFamily(
            "llmgw_agent_engine_usable",
            "1 when an engine a plugin provides was found here and passed engine-check, else 0.",
            labels=["engine"],
        )
        for name in sorted(agent.engines):
            usable.add_metric([name], int(name in facts.engines))
        yield usable
        if agent.last_sync is not None:
            yield GaugeMetricFamily(
                "llmgw_agent_server_last_sync_age_seconds",
                "Seconds since the server last answered a sync.",
                value=trio.current_time() - agent.last_sync,
            )
        yield GaugeMetricFamily(
            "llmgw_agent_fenced",
            "1 while the node is fenced (every shard stopped).",
            value=int(bool(agent.fenced)),
        )
        if agent.credentials.not_after is not None:
            yield GaugeMetricFamily(
                "llmgw_agent_certificate_expiry_timestamp_seconds",
                "When this node's certificate expires (UNIX time).",
                value=agent.credentials.not_after,
            )
        stager = getattr(agent.stage, "__self__", None)
        yield CounterMetricFamily(
            "llmgw_agent_staging_fetched_bytes",
            "Bytes of model files received from peers while staging (rate() is the staging rate).",
            value=stager.bytes_fetched if stager is not None else 0,
        )
        peers = getattr(stager, "peers", None)
        yield CounterMetricFamily(
            "llmgw_agent_peer_served_bytes",
            "Bytes of model files served to other nodes.",
            value=peers.bytes_served if peers is not None else 0,
        )
        yield GaugeMetricFamily(
            "llmgw_agent_peer_uploads",
            "Model files being served to other nodes now.",
            value=peers.uploading if peers is not None else 0,
        )
