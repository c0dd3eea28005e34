"""The server's timers (lost nodes, long-polls) in process, driven by trio's autojump clock.

The server app is given ``trio.current_time`` as its clock and called directly with requests
that carry a client certificate, so no socket is in the path and the clock can jump.
"""

from __future__ import annotations

import json
import ssl

import pytest
import trio
import trio.testing
from llmgw_engine_sim import SimEngine

from llmgw.models import NodeFacts
from llmgw.net.server import Request
from llmgw.server.http.api import ServerApp
from llmgw.server.persist.sqlite import open_store
from llmgw.server.state.cluster import ClusterState, Settings
from llmgw.testing import make_gpus
from llmgw.testing.processes import wait_for
from llmgw.wire import SyncRequest, to_json

LOST_AFTER = 30.0
POLL_TIMEOUT = 20.0


@pytest.fixture
def autojump_clock():
    """trio's mock clock, jumping only after 20 ms of real idleness.

    The store runs sqlite in a worker thread: with the default threshold (0)
    the clock jumps while a store call is still running, since no trio task
    is runnable then, and a timer fires early or late by a tick.
    """
    return trio.testing.MockClock(autojump_threshold=0.02)


@pytest.fixture
async def app(tmp_path):
    """A server app on a fresh store, its reconciler ticking every second of trio time."""
    store = open_store(tmp_path / "state")
    app = ServerApp(
        ClusterState(Settings(lost_after=LOST_AFTER)),
        store,
        {"sim": SimEngine()},
        poll_timeout=POLL_TIMEOUT,
        clock=trio.current_time,
    )
    try:
        async with trio.open_nursery() as reconciler:
            await reconciler.start(app.run_reconciler, 1.0)
            yield app
            reconciler.cancel_scope.cancel()
    finally:
        store.close()


def der(test_pki, role: str, name: str) -> bytes:
    """The DER form of a client certificate, as the TLS server hands it to the app."""
    return ssl.PEM_cert_to_DER_cert(test_pki.client(role, name).cert_path.read_text())


async def sync(app: ServerApp, test_pki, node: str, *, revision: int = 0, wait: bool = False) -> dict:
    """One agent sync of ``node``; the reply's JSON."""
    gpus = make_gpus(4, seed=node)
    facts = NodeFacts(node_id=node, agent_version="0.1.0", gpus=gpus, engines={"sim": "0.1.0"})
    ports = (21000, 21099)
    body = SyncRequest(
        node_id=node, address="127.0.0.5", facts=facts, port_range=ports, revision=revision, wait=wait
    )
    request = Request(
        "POST",
        "/v1/agent/sync",
        body=json.dumps(to_json(body)).encode(),
        peer_cert_der=der(test_pki, "node", node),
    )
    response = await app.handle(request)
    assert response.status == 200, response.body
    return json.loads(response.body)


async def routes(app: ServerApp, test_pki, revision: int, *, wait: bool) -> dict:
    """One poll of the routes feed by a gateway; the answer's JSON."""
    target = f"/v1/routes?revision={revision}&wait={1 if wait else 0}"
    response = await app.handle(Request("GET", target, peer_cert_der=der(test_pki, "gateway", "gw")))
    assert response.status == 200, response.body
    return json.loads(response.body)


async def test_node_is_lost_once_it_stays_silent_for_lost_after(app, test_pki, autojump_clock):
    """A node that stops syncing stays ready up to lost_after, then the reconciler alone marks it lost."""
    await sync(app, test_pki, "node-1")
    silent_since = trio.current_time()
    await trio.sleep(LOST_AFTER - 1)
    assert app.cluster.nodes["node-1"].state == "ready"
    with trio.fail_after(5):
        await wait_for(lambda: app.cluster.nodes["node-1"].lost, "node-1 to be lost")
    assert trio.current_time() - silent_since > LOST_AFTER


async def test_syncing_node_is_never_lost(app, test_pki, autojump_clock):
    """A node that syncs more often than lost_after stays ready however long it runs."""
    for _ in range(10):
        await sync(app, test_pki, "node-1")
        await trio.sleep(LOST_AFTER - 5)
    assert app.cluster.nodes["node-1"].state == "ready"


async def test_sync_long_poll_answers_after_poll_timeout_when_nothing_changes(app, test_pki, autojump_clock):
    """A sync that asks to wait, with nothing new, is answered after poll_timeout with the same revision."""
    first = await sync(app, test_pki, "node-1")
    started = trio.current_time()
    again = await sync(app, test_pki, "node-1", revision=first["revision"], wait=True)
    assert again["revision"] == first["revision"]
    assert trio.current_time() - started == pytest.approx(POLL_TIMEOUT, abs=0.5)


async def test_routes_long_poll_waits_poll_timeout_or_answers_at_once(app, test_pki, autojump_clock):
    """The feed holds a poll of the current revision for poll_timeout; a stale revision is answered now."""
    current = (await routes(app, test_pki, 0, wait=False))["revision"]
    started = trio.current_time()
    assert (await routes(app, test_pki, current, wait=True))["revision"] == current
    assert trio.current_time() - started == pytest.approx(POLL_TIMEOUT, abs=0.5)
    started = trio.current_time()
    await routes(app, test_pki, current + 100, wait=True)
    assert trio.current_time() - started < 0.5
