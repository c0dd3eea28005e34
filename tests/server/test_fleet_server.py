"""The server under fleet-sized and hostile input, over real mutual TLS.

Syncs answer from state already computed and wake only on the node's own
changes; a catalog that cannot fit leaves the server answering, with one event
per model; random and mutated bodies get a 4xx and change nothing; while the
server loads its state it says so.
"""

from __future__ import annotations

import json
import re
import threading
from functools import partial

import httpx
import hypothesis
import hypothesis.strategies as st
import pytest
import trio
from llmgw_engine_sim import SimEngine

import llmgw.server.main
from llmgw.server.main import ServerConfig, serve_server
from llmgw.server.reconciler import reconcile
from llmgw.server.state.cluster import Settings
from llmgw.testing.processes import free_port, processes, wait_for, wait_until  # noqa: F401
from llmgw.wire import SyncReply, from_json
from tests.server.test_server_api import CATALOG, client, sync_body


def _config(test_pki, tmp_path) -> ServerConfig:
    return test_pki.server_config(
        tmp_path / "state", settings=Settings(lost_after=30, source_wait=0), poll_timeout=3.0
    )


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    """A real `llmgw server` (long-poll 3 s), loaded; yields its base URL."""
    loaded = trio.Event()
    start = partial(serve_server, _config(test_pki, tmp_path), {"sim": SimEngine()}, loaded=loaded)
    host, port = await nursery.start(start)
    with trio.fail_after(10):
        await loaded.wait()
    return f"https://{host}:{port}"


async def _sync(http, server: str, node_id: str, revision: int = 0, *, wait: bool = False, **changes):
    body = {**sync_body(node_id, revision), "wait": wait, **changes}
    response = await http.post(f"{server}/v1/agent/sync", json=body)
    assert response.status_code == 200, response.text
    return from_json(response.json(), SyncReply)


async def test_a_long_poll_wakes_on_its_own_node_only(server, test_pki, nursery):
    """A replica of node-1 failing wakes node-1's long-poll at once; node-2's waits out its poll."""
    catalog = CATALOG.replace("profile: one", "profile: one\n    replicas: 2")
    async with client(test_pki, "node", "node-1") as one, client(test_pki, "node", "node-2") as two:
        await _sync(one, server, "node-1")
        await _sync(two, server, "node-2")
        async with client(test_pki, "admin", "ops") as admin:
            applied = await admin.post(f"{server}/v1/admin/catalog", json={"text": catalog})
            assert applied.status_code == 200, applied.text
        with trio.fail_after(5):
            placed_1 = await _sync(one, server, "node-1", 1, wait=True)
            placed_2 = await _sync(two, server, "node-2", 1, wait=True)
        assert len(placed_1.shards) == 1 and len(placed_2.shards) == 1, "one replica per node"
        answered: dict[str, float] = {}
        node_2_answered = trio.Event()

        async def poll(http, node_id: str, reply: SyncReply) -> None:
            # an agent that applied a revision reports the shards it runs
            running = [
                {"replica_id": s.replica_id, "attempt": s.attempt, "rank": s.rank, "state": "running"}
                for s in reply.shards
            ]
            await _sync(http, server, node_id, reply.revision, wait=True, observed=running)
            answered[node_id] = trio.current_time()
            node_2_answered.set()

        async def syncs_recorded() -> int:
            text = (await one.get(f"{server}/metrics")).text
            return int(float(re.search(r"^llmgw_server_sync_duration_seconds_count (\S+)$", text, re.M)[1]))

        recorded = await syncs_recorded()
        nursery.start_soon(poll, two, "node-2", placed_2)

        async def node_2_held() -> bool:  # its sync is recorded: what follows is its long-poll's wait
            return await syncs_recorded() > recorded

        with trio.fail_after(5):
            await wait_for(node_2_held, "node-2's sync to be recorded and its poll held")
        started = trio.current_time()
        (shard,) = placed_1.shards
        exited = {"replica_id": shard.replica_id, "attempt": shard.attempt, "rank": 0, "state": "exited"}
        with trio.fail_after(5):
            failed = await _sync(
                one, server, "node-1", placed_1.revision, observed=[{**exited, "exit_code": 1}]
            )
            if failed.revision == placed_1.revision:
                failed = await _sync(one, server, "node-1", placed_1.revision, wait=True)
        assert failed.revision > placed_1.revision and not failed.shards, "node-1 is told to stop its shard"
        woke_1 = trio.current_time() - started
        with trio.fail_after(5):
            await node_2_answered.wait()
        assert woke_1 < 1.5, f"node-1's change took {woke_1:.2f} s to reach it (its poll was not woken)"
        assert answered["node-2"] - started > 2.0, "node-2's poll was woken by node-1's change"


async def test_a_catalog_that_cannot_fit_is_one_event_per_model(server, test_pki):
    """5,000 replicas on one 4-GPU node: the API keeps answering and ctl events shows one line per model."""
    catalog = CATALOG.replace("profile: one", "profile: one\n    replicas: 5000")
    catalog += "  other:\n    source: tiny/model\n    profile: one\n    replicas: 3000\n"
    async with client(test_pki, "admin", "ops") as admin, client(test_pki, "node", "node-1") as node:
        await _sync(node, server, "node-1")
        applied = await admin.post(f"{server}/v1/admin/catalog", json={"text": catalog})
        assert applied.status_code == 200, applied.text
        with trio.fail_after(10):
            while True:
                replicas = (await admin.get(f"{server}/v1/admin/replicas")).json()
                if len(replicas["unplaced"]) == 5000 + 3000 - 2:
                    break
                await trio.sleep(0.1)
        events = (await admin.get(f"{server}/v1/admin/events", params={"limit": 10000})).json()["events"]
        unplaced = [e for e in events if "cannot be placed" in e["message"]]
        assert sorted(e["subject"] for e in unplaced) == ["other", "small"], unplaced
        counts = [int(e["message"].split(" replicas (", 1)[0]) for e in unplaced]
        assert sum(counts) == 5000 + 3000 - 2, [e["message"] for e in unplaced]


# -- random and mutated bodies -----------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw, valid: dict) -> bytes:
    """``valid`` with one field replaced, dropped or added, nested fields included; or random bytes."""
    how = draw(st.sampled_from(["replace", "drop", "add", "bytes", "truncate"]))
    if how == "bytes":
        return draw(st.binary(max_size=200))
    text = json.dumps(valid)
    if how == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))].encode()
    body = json.loads(text)
    target = body
    path = [draw(st.sampled_from(sorted(body)))]
    while isinstance(target[path[-1]], dict) and target[path[-1]] and draw(st.booleans()):
        target = target[path[-1]]
        path.append(draw(st.sampled_from(sorted(target))))
    if how == "replace":
        target[path[-1]] = draw(JSON)
    elif how == "drop":
        del target[path[-1]]
    else:
        target[draw(st.text(min_size=1, max_size=10))] = draw(JSON)
    return json.dumps(body).encode()


def _comparable(nodes: dict) -> list:
    return [{k: v for k, v in node.items() if k != "last_sync_ago"} for node in nodes["nodes"]]


@pytest.fixture
def server_process(test_pki, tmp_path, processes, llmgw_exe):  # noqa: F811
    """A real `llmgw server` process (for tests that run many examples); yields (URL, its process)."""
    port = free_port()
    argv = [llmgw_exe, "server", "--state-dir", str(tmp_path / "state"), "--listen", f"127.0.0.1:{port}"]
    argv += ["--cert", str(test_pki.server.cert_path), "--key", str(test_pki.server.key_path)]
    argv += ["--ca", str(test_pki.ca.cert_path), "--poll-timeout", "1"]
    process = processes.start(argv, name="server")
    url = f"https://127.0.0.1:{port}"
    with httpx.Client(verify=test_pki.context("admin", "ops"), timeout=5) as admin:
        wait_until(lambda: admin.get(f"{url}/v1/admin/nodes").status_code == 200, 30, "the server", process)
    return url, process


SETTINGS = hypothesis.settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture, hypothesis.HealthCheck.too_slow],
)


@SETTINGS
@hypothesis.given(body=mutated(sync_body("node-1")))
def test_mutated_syncs_get_a_4xx_and_change_nothing(server_process, test_pki, body):
    """A sync body with any field broken is a 4xx saying what is wrong; the node's state is as it was."""
    url, process = server_process
    with (
        httpx.Client(verify=test_pki.context("admin", "ops"), timeout=10) as admin,
        httpx.Client(verify=test_pki.context("node", "node-1"), timeout=10) as node,
    ):
        assert node.post(f"{url}/v1/agent/sync", json=sync_body("node-1")).status_code == 200
        before = admin.get(f"{url}/v1/admin/nodes").json()
        response = node.post(
            f"{url}/v1/agent/sync", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code < 500, response.text
        if response.status_code != 200:
            assert 400 <= response.status_code < 500
            assert response.json()["error"]["message"], "a refusal says why"
            assert _comparable(admin.get(f"{url}/v1/admin/nodes").json()) == _comparable(before)
    assert process.returncode is None, process.stderr_tail()


@SETTINGS
@hypothesis.given(
    path=st.sampled_from(["/v1/admin/catalog", "/v1/admin/keys", "/v1/admin/nodes/node-1/cordon"]),
    body=mutated({"text": CATALOG, "name": "catalog.yaml"}),
)
def test_mutated_admin_bodies_get_a_4xx_and_change_nothing(server_process, test_pki, path, body):
    """Broken admin bodies are 4xx; the stored catalog is as it was after a refusal."""
    url, process = server_process
    with httpx.Client(verify=test_pki.context("admin", "ops"), timeout=10) as admin:
        before = admin.get(f"{url}/v1/admin/catalog").json()
        response = admin.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            assert response.json()["error"]["message"], "a refusal says why"
            assert admin.get(f"{url}/v1/admin/catalog").json() == before
    assert process.returncode is None, process.stderr_tail()


# -- starting ----------------------------------------------------------------------------------


async def test_the_server_answers_starting_while_it_loads(nursery, test_pki, tmp_path, monkeypatch):
    """Listening comes first: while the state loads, requests get a 503 that says the server is starting."""
    release = threading.Event()
    real_load = llmgw.server.main.load_cluster

    def slow_load(*args, **kwargs):
        release.wait(10)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(llmgw.server.main, "load_cluster", slow_load)
    loaded = trio.Event()
    start = partial(serve_server, _config(test_pki, tmp_path), {"sim": SimEngine()}, loaded=loaded)
    host, port = await nursery.start(start)
    try:
        async with client(test_pki, "admin", "ops") as admin:
            starting = await admin.get(f"https://{host}:{port}/v1/admin/replicas")
            assert starting.status_code == 503
            error = starting.json()["error"]
            assert error["type"] == "starting"
            assert "the server is starting (loading the cluster's state from" in error["message"]
            release.set()
            with trio.fail_after(10):
                await loaded.wait()
            assert (await admin.get(f"https://{host}:{port}/v1/admin/replicas")).status_code == 200
    finally:
        release.set()


async def test_a_server_restarted_on_a_large_state_answers_ctl(tmp_path, test_pki, processes, llmgw_exe):  # noqa: F811
    """1,000 nodes and 2,000 replicas in state.db: a new server process lists them all to ctl."""
    from llmgw.catalog import parse_catalog
    from llmgw.server.persist.cluster import flush
    from llmgw.server.persist.sqlite import open_store
    from llmgw.server.state.cluster import ClusterState
    from llmgw.wire import SyncRequest

    cluster = ClusterState()
    for number in range(1000):
        body = sync_body(f"node-{number:04}")
        cluster.sync(from_json({**body, "checked_sources": ["tiny/model"]}, SyncRequest), 1000.0)
    catalog = CATALOG.replace("profile: one", "profile: one\n    replicas: 2000")
    cluster.apply_catalog(parse_catalog(catalog, {"sim": SimEngine()}), catalog, 1000.0)
    reconcile(cluster, 1000.0 + 11)  # past the wait for sources, before lost-after
    assert len(cluster.replicas) == 2000
    store = open_store(tmp_path / "state")
    try:
        await store.write(lambda conn: flush(conn, cluster, 1000.0))
    finally:
        store.close()

    port = free_port()
    argv = [llmgw_exe, "server", "--state-dir", str(tmp_path / "state"), "--listen", f"127.0.0.1:{port}"]
    argv += ["--cert", str(test_pki.server.cert_path), "--key", str(test_pki.server.key_path)]
    argv += ["--ca", str(test_pki.ca.cert_path)]
    process = processes.start(argv, name="server")
    answers: list[int] = []

    def listed() -> int:
        with httpx.Client(verify=test_pki.context("admin", "ops"), timeout=5) as admin:
            response = admin.get(f"https://127.0.0.1:{port}/v1/admin/replicas")
        answers.append(response.status_code)
        assert response.status_code in (200, 503), response.text
        if response.status_code == 503:
            assert response.json()["error"]["type"] == "starting"
            return 0
        return len(response.json()["replicas"])

    count = await trio.to_thread.run_sync(lambda: wait_until(listed, 30, "ctl replicas to list", process))
    assert count == 2000
    assert process.returncode is None, process.stderr_tail()


async def test_a_body_past_the_servers_limit_is_a_413(server, test_pki):
    """A 5 MiB body is refused by its Content-Length before it is read or parsed; the server goes on."""
    host, port = server.removeprefix("https://").split(":")
    stream = await trio.open_ssl_over_tcp_stream(
        host, int(port), ssl_context=test_pki.context("node", "node-1"), https_compatible=True
    )
    async with stream:
        head = f"POST /v1/agent/sync HTTP/1.1\r\nhost: {host}\r\ncontent-length: {5 * 1024 * 1024}\r\n\r\n"
        await stream.send_all(head.encode())
        answer = b""
        with trio.fail_after(5):
            while b"\r\n\r\n" not in answer:
                answer += await stream.receive_some(4096)
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    async with client(test_pki, "node", "node-1") as node:
        assert (await node.post(f"{server}/v1/agent/sync", json=sync_body("node-1"))).status_code == 200
