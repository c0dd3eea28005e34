"""Write deploy/grafana/llmgw.json, llmgw's Grafana dashboard, from the panels listed here.

Run it after changing a panel: ``.venv/bin/python scripts/grafana_dashboard.py``
(tests/deploy checks the JSON is what this writes). Five rows: Fleet, Models
(engines), Gateway, Tenants, Control plane; every query reads metrics the processes
export (tests/e2e/test_e2e_metrics.py scrapes them).
"""

# ruff: noqa: E501 (one PromQL query per line, as Grafana shows it)
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "llmgw.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
panels = []
y = 0
pid = 1


def row(title):
    global y, pid
    panels.append(
        {
            "type": "row",
            "title": title,
            "id": pid,
            "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            "panels": [],
        }
    )
    pid += 1
    y += 1


x = 0


def panel(title, targets, unit="short", kind="timeseries", w=8, h=8, desc=""):
    global x, y, pid
    if x + w > 24:
        x = 0
        y += h
    p = {
        "type": kind,
        "title": title,
        "id": pid,
        "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if kind == "timeseries" else {},
        "targets": [
            {"datasource": DS, "expr": e, "legendFormat": legend, "refId": chr(65 + i)}
            for i, (e, legend) in enumerate(targets)
        ],
    }
    if desc:
        p["description"] = desc
    panels.append(p)
    pid += 1
    x += w


def newrow(title):
    global x, y
    if x:
        y += 8
    x = 0
    row(title)


M = 'model=~"$model"'
R = "$__rate_interval"


def model_quantile(q, histogram):
    """The ``q`` quantile of ``histogram`` per model, over the models chosen, at the panel's rate interval."""
    return f"histogram_quantile({q}, sum by (le, model) (rate({histogram}_bucket{{{M}}}[{R}])))"


newrow("Fleet")
panel(
    "Nodes by state",
    [("max by (state) (llmgw_server_nodes)", "{{state}}")],
    desc="From the leading server: ready, cordoned, draining, lost.",
)
panel(
    "Replicas ready / desired",
    [
        (f'sum by (model) (llmgw_server_replicas{{state="ready",{M}}})', "{{model}} ready"),
        (f"max by (model) (llmgw_server_replicas_desired{{{M}}})", "{{model}} desired"),
    ],
)
panel("Replicas by state", [(f"sum by (state) (llmgw_server_replicas{{{M}}})", "{{state}}")])
panel(
    "Shards on nodes by state",
    [("sum by (state) (llmgw_agent_shards)", "{{state}}")],
    desc="What agents report: staging, starting, running, ready, unhealthy, exited, stopping.",
)
panel(
    "Replica failures by cause",
    [
        (
            f"sum by (model, cause) (increase(llmgw_server_replica_failures_total{{{M}}}[{R}]))",
            "{{model}} {{cause}}",
        )
    ],
    desc="hung: the agent's canary found the engine hung; exited/unhealthy: a shard ended or failed its health check.",
)
panel(
    "Canary results",
    [(f"sum by (result) (rate(llmgw_agent_canary_results_total{{{M}}}[{R}]))", "{{result}}")],
    unit="ops",
)
panel(
    "GPUs and node problems",
    [
        ("sum(llmgw_agent_gpus)", "GPUs"),
        ("sum by (instance) (llmgw_agent_problems) > 0", "problems {{instance}}"),
        ("sum(llmgw_agent_fenced)", "fenced nodes"),
    ],
)
panel(
    "Engines usable per node",
    [("sum by (engine) (llmgw_agent_engine_usable)", "{{engine}}")],
    desc="Nodes where each engine was found and passed engine-check.",
)
panel(
    "Weights staging (bytes/s)",
    [
        (f"sum by (instance) (rate(llmgw_agent_staging_fetched_bytes_total[{R}]))", "fetched {{instance}}"),
        (f"sum by (instance) (rate(llmgw_agent_peer_served_bytes_total[{R}]))", "served {{instance}}"),
        ("sum(llmgw_agent_peer_uploads)", "uploads now"),
    ],
    unit="Bps",
)
panel(
    "Certificates: days left",
    [
        ("min by (node) (llmgw_server_certificate_expiry_timestamp_seconds - time()) / 86400", "{{node}}"),
        (
            "min by (instance) (llmgw_gateway_certificate_expiry_timestamp_seconds - time()) / 86400",
            "gateway {{instance}}",
        ),
    ],
    unit="d",
)
panel(
    "Seconds since each node synced",
    [("max by (node) (llmgw_server_node_last_sync_age_seconds)", "{{node}}")],
    unit="s",
)
newrow("Models (engines)")
panel(
    "Requests running / waiting",
    [
        (f"sum by (model) (vllm:num_requests_running{{{M}}})", "{{model}} running"),
        (f"sum by (model) (vllm:num_requests_waiting{{{M}}})", "{{model}} waiting"),
    ],
    desc="The engines' own gauges (vLLM's names; the sim serves them too), found through the server's /sd/engines.",
)
panel(
    "Tokens per second",
    [
        (f"sum by (model) (rate(vllm:generation_tokens_total{{{M}}}[{R}]))", "{{model}} generated"),
        (f"sum by (model) (rate(vllm:prompt_tokens_total{{{M}}}[{R}]))", "{{model}} prompt"),
    ],
)
panel(
    "Engine time to first token (p95)",
    [(model_quantile(0.95, "vllm:time_to_first_token_seconds"), "{{model}}")],
    unit="s",
)
panel(
    "Engine inter-token latency (p95)",
    [(model_quantile(0.95, "vllm:inter_token_latency_seconds"), "{{model}}")],
    unit="s",
)
panel(
    "Engine end-to-end latency (p95)",
    [(model_quantile(0.95, "vllm:e2e_request_latency_seconds"), "{{model}}")],
    unit="s",
)
panel(
    "Engine requests finished",
    [
        (
            f"sum by (model, finished_reason) (rate(vllm:request_success_total{{{M}}}[{R}]))",
            "{{model}} {{finished_reason}}",
        )
    ],
    unit="reqps",
)
panel(
    "LoRA adapter requests: hits and misses",
    [(f"sum by (model, outcome) (rate(llmgw_gateway_adapter_requests_total{{{M}}}[{R}]))", "{{model}} {{outcome}}")],
    unit="reqps",
    desc="Requests for an adapter a replica had loaded (hit) or none had (miss: held for a load).",
)
panel(
    "LoRA adapter loads by outcome",
    [(f"sum by (model, outcome) (rate(llmgw_server_adapter_loads_total{{{M}}}[{R}]))", "{{model}} {{outcome}}")],
    unit="ops",
    desc="Loads that ended: loaded, or the failure's cause (staging, refused, unreachable, unsupported).",
)
panel(
    "LoRA adapter load time (p95) and adapters loaded",
    [
        (model_quantile(0.95, "llmgw_server_adapter_load_seconds"), "{{model}} load p95 (s)"),
        (f"sum by (model) (llmgw_server_adapters_loaded{{{M}}})", "{{model}} loaded"),
    ],
)
newrow("Gateway")
panel(
    "Requests by status",
    [(f"sum by (status) (rate(llmgw_gateway_requests_total{{{M}}}[{R}]))", "{{status}}")],
    unit="reqps",
)
panel(
    "Error ratio (5xx)",
    [
        (
            f'sum by (model) (rate(llmgw_gateway_requests_total{{status=~"5..",{M}}}[{R}])) / sum by (model) (rate(llmgw_gateway_requests_total{{{M}}}[{R}]))',
            "{{model}}",
        )
    ],
    unit="percentunit",
    desc="Alert LlmgwGatewayErrorRate fires over 1% for 5 minutes.",
)
panel(
    "Time to first token (p50, p95)",
    [
        (model_quantile(0.5, "llmgw_gateway_time_to_first_token_seconds"), "{{model}} p50"),
        (model_quantile(0.95, "llmgw_gateway_time_to_first_token_seconds"), "{{model}} p95"),
    ],
    unit="s",
    desc="Streams, as clients see them. Alert LlmgwTimeToFirstTokenSlow: p95 over 2 s for 10 minutes.",
)
panel(
    "Inter-token latency (p95)",
    [(model_quantile(0.95, "llmgw_gateway_inter_token_latency_seconds"), "{{model}}")],
    unit="s",
)
panel(
    "Request duration (p95)",
    [(model_quantile(0.95, "llmgw_gateway_request_duration_seconds"), "{{model}}")],
    unit="s",
)
panel(
    "Tokens per second by API key",
    [
        (f"sum by (key) (rate(llmgw_gateway_completion_tokens_total{{{M}}}[{R}]))", "{{key}} completion"),
        (f"sum by (key) (rate(llmgw_gateway_prompt_tokens_total{{{M}}}[{R}]))", "{{key}} prompt"),
    ],
    desc="From each answer's usage (streams: when the client asks for include_usage).",
)
panel(
    "Requests by API key",
    [(f"sum by (key, status) (rate(llmgw_gateway_key_requests_total{{{M}}}[{R}]))", "{{key}} {{status}}")],
    unit="reqps",
)
panel(
    "Refused by key limits",
    [("sum by (key, limit) (rate(llmgw_gateway_key_refusals_total[" + R + "]))", "{{key}} {{limit}}")],
    unit="reqps",
    desc="403 (models) and 429 (rpm, tpm, concurrency, budget) answers by API key name and the limit hit.",
)
panel(
    "In flight per replica", [(f"sum by (replica) (llmgw_gateway_in_flight_requests{{{M}}})", "{{replica}}")]
)
panel(
    "Replicas routed, breakers open",
    [
        (f"min by (model) (llmgw_gateway_ready_replicas{{{M}}})", "{{model}} routed"),
        (f"count by (model) (llmgw_gateway_breaker_state{{{M}}} == 2)", "{{model}} open breakers"),
    ],
)
panel(
    "Upstream errors and retries",
    [
        (f"sum by (kind) (rate(llmgw_gateway_upstream_errors_total[{R}]))", "{{kind}}"),
        (f"sum by (model) (rate(llmgw_gateway_retries_total{{{M}}}[{R}]))", "retries {{model}}"),
    ],
    unit="ops",
)
panel(
    "Streams continued elsewhere (mid-stream migration)",
    [
        (f"sum by (cause) (rate(llmgw_gateway_stream_migrations_total{{{M}}}[{R}]))", "continued: {{cause}}"),
        (
            f"sum by (reason) (rate(llmgw_gateway_streams_not_continued_total{{{M}}}[{R}]))",
            "ended: {{reason}}",
        ),
        (f"sum(rate(llmgw_gateway_migrated_tokens_total{{{M}}}[{R}]))", "tokens carried over"),
    ],
    unit="ops",
    desc="Streams whose replica broke mid-way: continued on another replica (by cause), or ended with an error event (by reason); tokens sent again as the start of the answer.",
)
panel(
    "Gap in a migrated stream (p50, p99)",
    [
        (model_quantile(0.5, "llmgw_gateway_migration_gap_seconds"), "{{model}} p50"),
        (model_quantile(0.99, "llmgw_gateway_migration_gap_seconds"), "{{model}} p99"),
    ],
    unit="s",
    desc="What a client waited between the broken replica's last event and the next replica's first.",
)
panel(
    "Routes feed",
    [
        ("min by (instance) (llmgw_gateway_routes_feed_up)", "up {{instance}}"),
        ("max by (instance) (llmgw_gateway_routes_age_seconds)", "age (s) {{instance}}"),
    ],
    desc="Alert LlmgwRoutesFeedDown: a gateway cannot read routes for a minute.",
)
panel(
    "Requests held for models at zero",
    [(f"sum by (model) (llmgw_gateway_held_requests{{{M}}})", "{{model}}")],
    desc="Requests a gateway holds while a model at zero replicas (replicas.min: 0) wakes (--hold-timeout).",
)
newrow("Tenants")
panel(
    "Tokens by key",
    [
        (
            f"sum by (key) (rate(llmgw_gateway_prompt_tokens_total{{{M}}}[{R}]) + rate(llmgw_gateway_completion_tokens_total{{{M}}}[{R}]))",
            "{{key}}",
        )
    ],
    unit="short",
    desc="Prompt + completion tokens per second by API key name (never the key).",
)
panel(
    "Budget used by key",
    [("max by (key, period) (llmgw_server_key_budget_used_ratio)", "{{key}} ({{period}})")],
    unit="percentunit",
    desc="Each budgeted key's tokens this period over its budget (alert LlmgwKeyAtBudget at 100%: 429 until the period ends).",
)
panel(
    "Queue wait p95 by key, requests waiting",
    [
        (f"histogram_quantile(0.95, sum by (key, le) (rate(llmgw_gateway_queue_seconds_bucket[{R}])))", "p95 {{key}}"),
        (f"sum by (model, priority) (llmgw_gateway_queued_requests{{{M}}})", "waiting {{model}} {{priority}}"),
    ],
    unit="s",
    desc="Requests waiting for a seat (--replica-concurrency), by priority class; queue_full and queue_timeout 503s are in llmgw_gateway_queue_overflows_total.",
)
newrow("Control plane")
panel(
    "Leader and epoch",
    [
        ("max by (instance) (llmgw_server_leader)", "leads {{instance}}"),
        ("max by (instance) (llmgw_server_leader_epoch)", "epoch {{instance}}"),
    ],
    desc="The epoch exists with the PostgreSQL store (several servers) only.",
)
panel(
    "Reconciler runs and duration (p99)",
    [
        (f"sum(rate(llmgw_server_reconcile_runs_total[{R}]))", "runs/s"),
        (
            f"histogram_quantile(0.99, sum by (le) (rate(llmgw_server_reconcile_duration_seconds_bucket[{R}])))",
            "p99 (s)",
        ),
    ],
)
panel(
    "Agent syncs and latency (p99)",
    [
        (f"sum(rate(llmgw_server_sync_duration_seconds_count[{R}]))", "syncs/s"),
        (
            f"histogram_quantile(0.99, sum by (le) (rate(llmgw_server_sync_duration_seconds_bucket[{R}])))",
            "p99 (s)",
        ),
    ],
    desc="Latency: recording a sync, the long-poll wait excluded.",
)
panel(
    "Store writes (p99) and errors",
    [
        (
            f"histogram_quantile(0.99, sum by (le, instance) (rate(llmgw_server_store_write_duration_seconds_bucket[{R}])))",
            "p99 {{instance}}",
        ),
        (f"sum by (instance) (increase(llmgw_server_store_errors_total[{R}]))", "errors {{instance}}"),
    ],
    unit="s",
)
panel(
    "API requests by endpoint",
    [(f"sum by (endpoint, status) (rate(llmgw_server_requests_total[{R}]))", "{{endpoint}} {{status}}")],
    unit="reqps",
)
panel(
    "Rollouts",
    [
        (f"max by (model, state) (llmgw_server_rollout_state{{{M}}}) == 1", "{{model}} {{state}}"),
        (f"max by (model) (llmgw_server_replicas_outdated{{{M}}})", "{{model}} outdated"),
        (f"max by (model) (llmgw_server_replicas_unplaced{{{M}}})", "{{model}} unplaced"),
    ],
)
panel(
    "Autoscaling: signals against targets",
    [
        (f"max by (model, signal) (llmgw_server_autoscale_signal{{{M}}})", "{{model}} {{signal}}"),
        (f"max by (model, signal) (llmgw_server_autoscale_target{{{M}}})", "{{model}} {{signal}} target"),
    ],
    desc="What the autoscaler reads (ready replicas' gauges) against the catalog's targets; "
    "alert LlmgwAutoscaleAtMax: a model held at its max while over target.",
)
panel(
    "Autoscaling: decisions",
    [
        (f"sum by (model, direction) (increase(llmgw_server_autoscale_decisions_total{{{M}}}[{R}]))",
         "{{model}} {{direction}}"),
        (f"max by (model) (llmgw_server_autoscale_at_max{{{M}}})", "{{model}} at max"),
    ],
    desc="Changes of desired replicas, up and down (`llmgw ctl autoscale`, `ctl events`).",
)
panel(
    "Events by kind",
    [(f"sum by (kind) (increase(llmgw_server_events_total[{R}]))", "{{kind}}")],
    desc="What `llmgw ctl events` lists, counted.",
)
panel("Catalog revision", [("max(llmgw_server_catalog_revision)", "revision")], kind="stat", w=4)
panel(
    "CPU (cores)",
    [
        (
            f'sum by (job, instance) (rate(process_cpu_seconds_total{{job=~"llmgw-.*"}}[{R}]))',
            "{{job}} {{instance}}",
        )
    ],
    w=10,
)
panel(
    "Resident memory",
    [('sum by (job, instance) (process_resident_memory_bytes{job=~"llmgw-.*"})', "{{job}} {{instance}}")],
    unit="bytes",
    w=10,
)
DASHBOARD = {
    "__inputs": [],
    "title": "llmgw",
    "uid": "llmgw-overview",
    "description": "llmgw: fleet, models, gateway and control plane. Needs the jobs of deploy/prometheus/prometheus.yml.",
    "tags": ["llmgw"],
    "timezone": "",
    "schemaVersion": 39,
    "version": 1,
    "editable": True,
    "refresh": "30s",
    "time": {"from": "now-3h", "to": "now"},
    "templating": {
        "list": [
            {
                "name": "datasource",
                "type": "datasource",
                "query": "prometheus",
                "label": "Prometheus",
                "current": {},
                "hide": 0,
            },
            {
                "name": "model",
                "type": "query",
                "label": "Model",
                "datasource": DS,
                "query": {"query": "label_values(llmgw_server_replicas_desired, model)", "refId": "model"},
                "definition": "label_values(llmgw_server_replicas_desired, model)",
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "current": {"text": "All", "value": "$__all"},
                "refresh": 2,
                "hide": 0,
            },
        ]
    },
    "annotations": {"list": []},
    "panels": panels,
}


def main() -> None:
    """Write the dashboard to :data:`OUT`."""
    OUT.write_text(render())
    print(f"wrote {OUT}")


def render() -> str:
    """The dashboard's JSON text."""
    return json.dumps(DASHBOARD, indent=2) + "\n"


if __name__ == "__main__":
    main()
