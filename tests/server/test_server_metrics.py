"""The server's /metrics, /health and /sd/engines: on --metrics-listen and on the HTTPS port."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import httpx
import pytest
import trio
from cryptography import x509
from llmgw_engine_sim import SimEngine
from prometheus_client.parser import text_string_to_metric_families

from llmgw.server.main import serve_server
from llmgw.server.metrics import ServerMetrics
from llmgw.server.state.records import Event, EventKind
from llmgw.testing.metrics import promtool_check_metrics
from llmgw.wire.causes import FailureCause
from tests.server.test_server_api import CATALOG, sync_body


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
async def served(nursery, test_pki, tmp_path):
    """A server with --metrics-listen on port 0: (its HTTPS URL, its metrics URL, its ServerMetrics)."""
    config = test_pki.server_config(tmp_path / "state", metrics_listen=("127.0.0.1", 0))
    metrics = ServerMetrics(config.cert)
    loaded = trio.Event()
    start = partial(serve_server, config, {"sim": SimEngine()}, loaded=loaded, metrics=metrics)
    host, port = await nursery.start(start)
    with trio.fail_after(10):
        await loaded.wait()
    return f"https://{host}:{port}", "http://{}:{}".format(*metrics.listen_address), metrics


async def test_metrics_count_what_the_server_does(served, test_pki):
    """After a catalog and a node's sync: nodes, replicas, syncs, runs, requests, expiry; promtool passes."""
    url, plain, _ = served
    admin = httpx.AsyncClient(verify=test_pki.context("admin", "ops"), timeout=10)
    node = httpx.AsyncClient(verify=test_pki.context("node", "node-1"), timeout=10)
    async with admin, node, httpx.AsyncClient(timeout=10) as http:
        assert (await admin.post(f"{url}/v1/admin/catalog", json={"text": CATALOG})).status_code == 200
        assert (await node.post(f"{url}/v1/agent/sync", json=sync_body("node-1"))).status_code == 200
        with trio.fail_after(5):
            while True:
                text = (await http.get(f"{plain}/metrics")).text
                values = samples(text)
                if values.get(("llmgw_server_replicas", (("model", "small"), ("state", "starting")))) == 1:
                    break
                await trio.sleep(0.05)
        health = await http.get(f"{plain}/health")
        targets = (await http.get(f"{plain}/sd/engines")).json()
    assert values[("llmgw_server_nodes", (("state", "ready"),))] == 1
    assert values[("llmgw_server_nodes", (("state", "lost"),))] == 0
    assert values[("llmgw_server_node_state", (("node", "node-1"), ("state", "ready")))] == 1
    assert values[("llmgw_server_replicas_desired", (("model", "small"),))] == 1
    assert values[("llmgw_server_rollout_state", (("model", "small"), ("state", "done")))] == 1
    assert values[("llmgw_server_sync_duration_seconds_count", ())] == 1
    assert values[("llmgw_server_requests_total", (("endpoint", "sync"), ("status", "200")))] == 1
    assert values[("llmgw_server_reconcile_runs_total", ())] >= 1
    assert values[("llmgw_server_store_write_duration_seconds_count", ())] >= 1
    assert values[("llmgw_server_replica_failures_total", (("cause", "hung"), ("model", "small")))] == 0
    assert values[("llmgw_server_leader", ())] == 1
    expiry = values[("llmgw_server_certificate_expiry_timestamp_seconds", (("node", "node-1"),))]
    certificate = x509.load_pem_x509_certificate(test_pki.client("node", "node-1").cert_path.read_bytes())
    assert expiry == certificate.not_valid_after_utc.timestamp()
    assert ("llmgw_server_certificate_expiry_timestamp_seconds", (("node", "(server)"),)) in values
    assert any(name.startswith("process_") for name, _ in values)
    assert promtool_check_metrics(text) == []
    assert health.status_code == 200
    assert health.json() | {"status": "ok", "role": "leader", "nodes": 1, "replicas": 1} == health.json()
    [group] = targets
    assert group["labels"] == {"model": "small", "replica": "small-0", "node": "node-1", "engine": "sim"}
    assert group["targets"][0].startswith("127.0.0.5:")


async def test_https_port_serves_metrics_to_any_certificate_of_the_ca(served, test_pki):
    """/metrics and /health on the HTTPS port: a node's or gateway's certificate reads them."""
    url, _, _ = served
    for role in ("node", "gateway"):
        async with httpx.AsyncClient(verify=test_pki.context(role, f"{role}-x"), timeout=10) as http:
            metrics = await http.get(f"{url}/metrics")
            health = await http.get(f"{url}/health")
        assert metrics.status_code == 200 and "llmgw_server_leader 1.0" in metrics.text
        assert health.status_code == 200 and health.json()["status"] == "ok"


async def test_health_names_a_store_that_fails(served):
    """A store whose queries fail makes /health 503 ``degraded``, naming the store and the error."""
    _, plain, metrics = served

    class Broken:
        path = "state.db"

        async def run(self, fn):
            raise OSError("disk I/O error")

    metrics.store = Broken()
    async with httpx.AsyncClient(timeout=10) as http:
        health = await http.get(f"{plain}/health")
    assert health.status_code == 503
    assert health.json()["status"] == "degraded"
    assert health.json()["problems"] == ["the store (state.db) fails: disk I/O error"]


async def test_health_before_the_state_is_loaded_says_starting():
    """No app yet: 503 ``starting`` with what the server is doing."""
    metrics = ServerMetrics()
    metrics.front = SimpleNamespace(app=None, refusal=None, detail="loading the cluster's state from x")
    detail = "loading the cluster's state from x"
    assert await metrics.health() == (503, {"status": "starting", "detail": detail})


@pytest.mark.parametrize("cause", [c for c in FailureCause if c.counted])
def test_failure_label_is_the_events_cause_not_its_words(cause):
    """``llmgw_server_replica_failures_total{cause}`` counts the failure event's cause, whatever its
    message says (one that reads like another cause counts under its own)."""
    metrics = ServerMetrics()
    message = "failed: shard r0 on node-1 unhealthy: hung, exited, not ready within 5 s; tearing down"
    metrics.event(Event(1.0, EventKind.REPLICA, "small-0", message, cause), lambda replica: "small")
    metrics.event(Event(2.0, EventKind.REPLICA, "small-0", "ready on node-1"), lambda replica: "small")
    counted = {
        sample.labels["cause"]: sample.value
        for family in metrics.registry.collect()
        if family.name == "llmgw_server_replica_failures"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert counted == {cause.value: 1.0}


async def test_leader_and_standby_on_postgresql_say_which_they_are(nursery, test_pki, tmp_path, pg_url):
    """Two servers on one database: the leader's health is ``ok`` with its epoch, the standby's 503
    ``standby`` naming the leader; ``llmgw_server_leader`` is 1 and 0, both export the epoch."""
    servers = []
    for index in range(2):
        config = test_pki.server_config(None, store=pg_url, metrics_listen=("127.0.0.1", 0), lease=2.0)
        metrics, loaded = ServerMetrics(config.cert), trio.Event()
        start = partial(serve_server, config, {"sim": SimEngine()}, loaded=loaded, metrics=metrics)
        host, port = await nursery.start(start)
        servers.append((f"https://{host}:{port}", metrics, loaded))
        if index == 0:
            with trio.fail_after(15):
                await loaded.wait()
    (leader_url, leader, _), (_, standby, _) = servers
    leader_plain, standby_plain = ("http://{}:{}".format(*m.listen_address) for m in (leader, standby))
    async with httpx.AsyncClient(timeout=10) as http:
        with trio.fail_after(10):
            while True:  # the standby listens before it has read the lease: "starting", then no leader yet
                answer = await http.get(f"{standby_plain}/health")
                if answer.json().get("leader"):
                    break
                await trio.sleep(0.05)
        led = await http.get(f"{leader_plain}/health")
        texts = [(await http.get(f"{url}/metrics")).text for url in (leader_plain, standby_plain)]
    assert led.status_code == 200 and led.json()["role"] == "leader"
    epoch = led.json()["epoch"]
    assert epoch >= 1
    assert answer.json() == {"status": "standby", "leader": leader_url, "detail": "this server is a standby"}
    (lead_values, standby_values) = (samples(t) for t in texts)
    assert lead_values[("llmgw_server_leader", ())] == 1 and standby_values[("llmgw_server_leader", ())] == 0
    assert (
        lead_values[("llmgw_server_leader_epoch", ())]
        == standby_values[("llmgw_server_leader_epoch", ())]
        == epoch
    )


def test_a_busy_or_malformed_metrics_listen_is_a_clear_error(test_pki, tmp_path):
    """``--metrics-listen`` on a port in use, or not HOST:PORT: exit 1 naming the flag and why."""
    import socket
    import subprocess

    from llmgw.dev.cluster import program

    tls = ["--cert", str(test_pki.server.cert_path), "--key", str(test_pki.server.key_path)]
    argv = [program("llmgw"), "server", "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0", *tls]
    argv += ["--ca", str(test_pki.ca.cert_path)]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [*argv, "--metrics-listen", f"127.0.0.1:{port}"], capture_output=True, text=True
        )
    assert done.returncode == 1
    assert f"error: --metrics-listen 127.0.0.1:{port}: cannot listen: Address already in use" in done.stderr
    done = subprocess.run([*argv, "--metrics-listen", "nope"], capture_output=True, text=True)
    assert done.returncode != 0 and "--metrics-listen 'nope': expected HOST:PORT" in done.stderr
