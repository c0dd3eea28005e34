"""A sync is answered only with decisions the store holds: 503 while the leader's writes fail or hang.

An agent acts on what its sync answer says. A leader whose store writes fail (the
database is down, or a newer leader fenced it) must not have agents start or stop
what the next leader would not know of; the sync is still recorded, so the node is
not declared lost meanwhile. The server app is called directly, as in
test_reconciler_clock, on a real sqlite store whose writes a test makes fail or hang.
"""

from __future__ import annotations

import json
import ssl

import pytest
import trio
import trio.testing
from llmgw_engine_sim import SimEngine

from llmgw.net.server import Request
from llmgw.server.http.api import ServerApp
from llmgw.server.persist.sqlite import StoreError, open_store
from llmgw.server.reconciler import WRITTEN_LIMIT
from llmgw.server.state.cluster import ClusterState, Settings
from llmgw.testing.nodes import sim_node_sync
from llmgw.testing.processes import wait_for
from llmgw.wire import to_json


class FaultyStore:
    """A real store whose writes fail while :attr:`failing` is set, or wait while :attr:`hold` is unset."""

    def __init__(self, store) -> None:
        self.store = store
        self.failing: str | None = None
        self.hold: trio.Event | None = None

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    async def write(self, fn):
        if self.hold is not None:
            await self.hold.wait()
        if self.failing is not None:
            raise StoreError(self.failing)
        return await self.store.write(fn)


@pytest.fixture
def autojump_clock():
    """trio's mock clock, jumping after 20 ms of real idleness (sqlite runs in a worker thread)."""
    return trio.testing.MockClock(autojump_threshold=0.02)


@pytest.fixture
def app(tmp_path):
    """A server app on a store whose writes the test breaks; the test runs each reconcile pass itself."""
    store = FaultyStore(open_store(tmp_path / "state"))
    app = ServerApp(
        ClusterState(Settings(lost_after=30)),
        store,
        {"sim": SimEngine()},
        poll_timeout=5,
        clock=trio.current_time,
    )
    try:
        yield app
    finally:
        store.store.close()


async def reconcile(app: ServerApp) -> None:
    """One reconcile pass, as the reconciler's loop runs it."""
    async with app.reconciler.lock:
        await app.reconciler.reconcile()


async def sync(app: ServerApp, test_pki, node: str):
    """One sync of ``node`` (not waiting), with its certificate as the TLS server hands it; the response."""
    body = json.dumps(to_json(sim_node_sync(node, wait=False))).encode()
    cert = ssl.PEM_cert_to_DER_cert(test_pki.client("node", node).cert_path.read_text())
    return await app.handle(Request("POST", "/v1/agent/sync", body=body, peer_cert_der=cert))


async def test_sync_is_503_after_a_failed_write_and_the_node_stays_known(app, test_pki, autojump_clock):
    """A reconcile's write fails: node-1's sync is 503 naming why, yet recorded; a write lands again: 200."""
    assert (await sync(app, test_pki, "node-1")).status == 200
    await reconcile(app)
    app.store.failing = "database is locked"
    await sync(app, test_pki, "node-2")  # a new node: the next pass has something to write
    with pytest.raises(StoreError):
        await reconcile(app)
    before = app.cluster.nodes["node-1"].last_seen
    await trio.sleep(1)
    refused = await sync(app, test_pki, "node-1")
    assert refused.status == 503
    message = json.loads(refused.body)["error"]["message"]
    assert "could not store its decisions" in message and "database is locked" in message, message
    assert app.cluster.nodes["node-1"].last_seen > before, "the sync counts: the node is not lost"
    app.store.failing = None
    await reconcile(app)
    assert (await sync(app, test_pki, "node-1")).status == 200


async def test_sync_waits_for_the_write_in_flight_then_503_past_the_limit(app, test_pki, autojump_clock):
    """A write hangs: a sync waits for it, and is answered 503 after WRITTEN_LIMIT seconds; once it lands,
    200."""
    assert (await sync(app, test_pki, "node-1")).status == 200
    await reconcile(app)
    app.store.hold = trio.Event()
    await sync(app, test_pki, "node-2")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reconcile, app)
        with trio.fail_after(10):
            await wait_for(lambda: app.reconciler.write_in_flight, "a write in flight")
        started = trio.current_time()
        refused = await sync(app, test_pki, "node-1")
        assert refused.status == 503 and "took over" in json.loads(refused.body)["error"]["message"]
        assert trio.current_time() - started == pytest.approx(WRITTEN_LIMIT, abs=0.5)
        app.store.hold.set()
    assert (await sync(app, test_pki, "node-1")).status == 200


async def test_the_routes_feed_is_woken_before_a_hung_write_lands(app, test_pki, autojump_clock):
    """Routes name what agents reported ready: a gateway's long-poll has them while the write still hangs."""
    assert (await sync(app, test_pki, "node-1")).status == 200
    await reconcile(app)
    known = app.cluster.routes_revision
    app.store.hold = trio.Event()
    await sync(app, test_pki, "node-2")  # the pass has something to write, and the write hangs
    woken: list[float] = []

    async def long_poll() -> None:
        await app.reconciler.wait_routes(known, 30)
        woken.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_poll)
        await trio.testing.wait_all_tasks_blocked()
        app.cluster.routes_revision += 1  # what a pass does when the ready replicas changed
        began = trio.current_time()
        nursery.start_soon(reconcile, app)
        try:
            with trio.fail_after(10):
                await wait_for(lambda: app.reconciler.write_in_flight, "a write in flight")
                await wait_for(lambda: woken, "the routes long-poll to answer")
            assert woken[0] - began < 1 and app.reconciler.write_in_flight, "answered while the write hung"
        finally:
            app.store.hold.set()  # the pass is shielded: it ends only once its write does
