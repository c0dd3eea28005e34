"""The control plane over real mutual TLS: who may call what, the sync call, the admin API."""

from __future__ import annotations

import logging
import ssl

import httpx
import pytest
import trio
from llmgw_engine_sim import SimEngine

from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.nodes import sim_node_sync
from llmgw.testing.server import start_server
from llmgw.wire import SyncReply, from_json, to_json

CATALOG = catalog_yaml({"small": model("tiny/model")}, one=sim_profile(2))


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    """A real `llmgw server` on 127.0.0.1, port 0; yields its base URL."""
    config = test_pki.server_config(tmp_path / "state")
    return await start_server(nursery, config, {"sim": SimEngine()})


def client(test_pki, role: str, name: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=test_pki.context(role, name), timeout=10)


def sync_body(node_id: str, revision: int = 0) -> dict:
    """The JSON of one sync of ``node_id`` (four GPUs, the sim engine) knowing ``revision``."""
    return to_json(sim_node_sync(node_id, revision=revision, wait=False))


async def sync_until_placed(node: httpx.AsyncClient, server: str) -> SyncReply:
    """node-1 syncs once, then long-polls (5 s at most) until the reconciler's answer: the reply."""
    first = await node.post(f"{server}/v1/agent/sync", json=sync_body("node-1"))
    assert first.status_code == 200, first.text
    known = from_json(first.json(), SyncReply).revision
    with trio.fail_after(5):
        second = await node.post(f"{server}/v1/agent/sync", json={**sync_body("node-1", known), "wait": True})
    assert second.status_code == 200, second.text
    return from_json(second.json(), SyncReply)


async def test_node_syncs_and_gets_its_shards(server, test_pki):
    """A node that syncs is listed by the admin API, and its next long-poll gets the catalog's replica.

    A sync only records what the agent reports; the reconciler places the
    replica right after, and wakes the node's long-poll with it.
    """
    async with client(test_pki, "admin", "ops") as admin, client(test_pki, "node", "node-1") as node:
        applied = await admin.post(f"{server}/v1/admin/catalog", json={"text": CATALOG})
        assert applied.status_code == 200, applied.text
        reply = await sync_until_placed(node, server)
        assert [s.replica_id for s in reply.shards] == ["small-0"]
        assert reply.shards[0].spec.host == "127.0.0.5"
        assert 21000 <= reply.shards[0].spec.port <= 21099
        nodes = (await admin.get(f"{server}/v1/admin/nodes")).json()["nodes"]
        assert [(n["node_id"], n["gpus_total"], n["gpus_free"]) for n in nodes] == [("node-1", 4, 2)]


async def test_long_poll_answers_when_the_revision_moves(server, test_pki, nursery):
    """A sync at the current revision waits, and answers as soon as the desired state changes."""
    async with client(test_pki, "admin", "ops") as admin, client(test_pki, "node", "node-1") as node:
        reply = from_json(
            (await node.post(f"{server}/v1/agent/sync", json=sync_body("node-1"))).json(), SyncReply
        )
        body = {**sync_body("node-1", reply.revision), "wait": True}
        answered = trio.Event()
        result = {}

        async def poll():
            result["reply"] = from_json(
                (await node.post(f"{server}/v1/agent/sync", json=body)).json(), SyncReply
            )
            answered.set()

        nursery.start_soon(poll)
        await trio.testing.wait_all_tasks_blocked(0.05)
        assert not answered.is_set()
        await admin.post(f"{server}/v1/admin/catalog", json={"text": CATALOG})
        with trio.fail_after(5):
            await answered.wait()
        assert [s.replica_id for s in result["reply"].shards] == ["small-0"]


async def test_node_claiming_another_id_is_refused_and_logged(server, test_pki, caplog):
    """A node certificate for node-1 cannot sync as node-2; the log names both."""
    caplog.set_level(logging.WARNING, logger="llmgw.server")
    async with client(test_pki, "node", "node-1") as node, client(test_pki, "admin", "ops") as admin:
        response = await node.post(f"{server}/v1/agent/sync", json=sync_body("node-2"))
        assert response.status_code == 403
        assert "'node-1' cannot sync as node 'node-2'" in response.json()["error"]["message"]
        assert any("'node-1'" in r.message and "'node-2'" in r.message for r in caplog.records)
        events = (await admin.get(f"{server}/v1/admin/events")).json()["events"]
        assert any(e["kind"] == "refusal" and e["subject"] == "node-2" for e in events)
        nodes = (await admin.get(f"{server}/v1/admin/nodes")).json()["nodes"]
        assert nodes == []


async def test_node_certificate_on_admin_api_is_refused(server, test_pki):
    """A node certificate cannot use the admin API, whatever its name."""
    async with client(test_pki, "node", "admin") as node:
        response = await node.get(f"{server}/v1/admin/nodes")
        assert response.status_code == 403
        assert "needs a admin certificate" in response.json()["error"]["message"]


async def test_admin_certificate_cannot_sync(server, test_pki):
    """An admin certificate named like a node cannot pass for that node."""
    async with client(test_pki, "admin", "node-1") as admin:
        response = await admin.post(f"{server}/v1/agent/sync", json=sync_body("node-1"))
        assert response.status_code == 403


async def test_no_certificate_is_refused(server, test_pki):
    """A client without a certificate gets nothing: the handshake is refused."""
    from llmgw import pki

    context = pki.client_ssl_context(None, None, test_pki.ca.cert_path)
    async with httpx.AsyncClient(verify=context, timeout=10) as anonymous:
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError, ssl.SSLError)):
            await anonymous.get(f"{server}/v1/admin/nodes")


async def test_invalid_catalog_changes_nothing(server, test_pki):
    """A catalog with errors is refused with each problem, and the stored catalog stays as it was."""
    async with client(test_pki, "admin", "ops") as admin:
        await admin.post(f"{server}/v1/admin/catalog", json={"text": CATALOG})
        bad = CATALOG.replace("gpus_per_node: 2", "gpus_per_node: two")
        response = await admin.post(f"{server}/v1/admin/catalog", json={"text": bad})
        assert response.status_code == 400
        assert response.json()["error"]["problems"] == [
            "profiles.one.gpus_per_node: expected an integer, got 'two'"
        ]
        stored = (await admin.get(f"{server}/v1/admin/catalog")).json()
        assert stored["text"] == CATALOG and stored["revision"] == 1


async def test_revoked_node_is_refused_without_restart(server, test_pki):
    """A revoked node is refused at its next sync, without a restart, and shows as revoked; others go on."""
    from llmgw import pki

    async with client(test_pki, "node", "node-1") as node, client(test_pki, "node", "node-2") as other:
        assert (await node.post(f"{server}/v1/agent/sync", json=sync_body("node-1"))).status_code == 200
        pki.revoke(test_pki.ca, "node-1")
        with trio.fail_after(5):
            while True:
                response = await node.post(f"{server}/v1/agent/sync", json=sync_body("node-1"))
                if response.status_code == 403:
                    break
                await trio.sleep(0.1)
        assert "revoked" in response.json()["error"]["message"]
        assert (await other.post(f"{server}/v1/agent/sync", json=sync_body("node-2"))).status_code == 200
    async with client(test_pki, "admin", "ops") as admin:
        nodes = {n["node_id"]: n for n in (await admin.get(f"{server}/v1/admin/nodes")).json()["nodes"]}
        assert nodes["node-1"]["state"] == "revoked"
        assert "is revoked" in nodes["node-1"]["warnings"][0]
        assert nodes["node-2"]["state"] == "ready"


async def test_malformed_sync_names_the_field(server, test_pki):
    """A sync body of the wrong shape gets a 400 naming the field."""
    async with client(test_pki, "node", "node-1") as node:
        body = sync_body("node-1")
        body["port_range"] = "all"
        response = await node.post(f"{server}/v1/agent/sync", json=body)
        assert response.status_code == 400
        assert "port_range" in response.json()["error"]["message"]


async def test_api_keys_are_stored_as_hashes_and_reach_the_routes_feed(server, test_pki):
    """A created key's secret is returned once; the routes feed carries only its hash; revoking removes it."""
    import hashlib

    async with client(test_pki, "admin", "ops") as admin, client(test_pki, "gateway", "gw-1") as gateway:
        created = await admin.post(f"{server}/v1/admin/keys", json={"name": "team-a"})
        assert created.status_code == 201
        secret = created.json()["secret"]
        digest = hashlib.sha256(secret.encode()).hexdigest()
        routes = (await gateway.get(f"{server}/v1/routes")).json()
        assert routes["keys"] == {digest: "team-a"}
        listed = (await admin.get(f"{server}/v1/admin/keys")).json()["keys"]
        assert [k["name"] for k in listed] == ["team-a"] and secret not in str(listed)
        again = await admin.post(f"{server}/v1/admin/keys", json={"name": "team-a"})
        assert again.status_code == 409
        await admin.delete(f"{server}/v1/admin/keys/team-a")
        assert (await gateway.get(f"{server}/v1/routes")).json()["keys"] == {}


async def test_gateway_certificate_reads_routes_but_not_admin(server, test_pki):
    """A gateway certificate may read the routes feed and nothing of the admin API."""
    async with client(test_pki, "gateway", "gw-1") as gateway:
        assert (await gateway.get(f"{server}/v1/routes")).status_code == 200
        assert (await gateway.get(f"{server}/v1/admin/nodes")).status_code == 403


async def test_drain_status_of_an_unknown_node_lists_the_nodes(server, test_pki):
    """Asking for the drain status of a node the server does not know is a 404 naming those it knows."""
    async with client(test_pki, "node", "node-1") as node, client(test_pki, "admin", "ops") as admin:
        assert (await node.post(f"{server}/v1/agent/sync", json=sync_body("node-1"))).status_code == 200
        response = await admin.get(f"{server}/v1/admin/nodes/node-9/drain")
        assert response.status_code == 404
        assert response.json()["error"]["message"] == "no node 'node-9' (nodes: node-1)"
        status = (await admin.get(f"{server}/v1/admin/nodes/node-1/drain")).json()
        assert status == {"node_id": "node-1", "state": "ready", "remaining": [], "moving": [], "stuck": []}


class TestHostileInput:
    """Bodies and queries a node or an admin could send: a 400 naming what is wrong, the server unharmed."""

    @pytest.mark.parametrize("port_range", [[30000, 20000], [0, 70000], [20000, 65536]])
    async def test_bad_port_range_is_refused_and_the_node_keeps_its_state(self, server, test_pki, port_range):
        """A port range inverted or out of 1..65535 is a 400 naming port_range; nothing changes."""
        async with client(test_pki, "admin", "ops") as admin, client(test_pki, "node", "node-1") as node:
            await admin.post(f"{server}/v1/admin/catalog", json={"text": CATALOG})
            placed = await sync_until_placed(node, server)
            before = (await admin.get(f"{server}/v1/admin/nodes")).json()
            bad = await node.post(
                f"{server}/v1/agent/sync", json={**sync_body("node-1"), "port_range": port_range}
            )
            assert bad.status_code == 400, bad.text
            assert "port_range" in bad.json()["error"]["message"]
            assert f"got [{port_range[0]}, {port_range[1]}]" in bad.json()["error"]["message"]
            again = await node.post(
                f"{server}/v1/agent/sync",
                json=sync_body("node-1", placed.revision),
            )
            assert again.status_code == 200, "the server stopped answering after the bad sync"
            after = (await admin.get(f"{server}/v1/admin/nodes")).json()
            assert [n["gpus_free"] for n in after["nodes"]] == [n["gpus_free"] for n in before["nodes"]]
            replica = from_json(again.json(), SyncReply).shards[0]
            assert 21000 <= replica.spec.port <= 21099

    @pytest.mark.parametrize(
        ("body", "why"),
        [
            pytest.param(
                b"[" * 100_000 + b"]" * 100_000,
                "request body nests arrays and objects deeper than 64 levels",
                id="nested-100000-deep",
            ),
            pytest.param(
                b'{"revision": ' + b"7" * 5000 + b"}",
                "request body holds a number of 5000 characters; at most 100 are accepted",
                id="5000-digit-integer",
            ),
            pytest.param(b"\xff\xfe not utf-8", "request body is not UTF-8", id="not-utf-8"),
            pytest.param(b'{"revision": ', "request body is not valid JSON", id="cut-short"),
        ],
    )
    async def test_unreadable_json_is_a_400(self, server, test_pki, body, why):
        """A body the JSON reader cannot take, or that breaks a bound, gets a 400 saying which."""
        async with client(test_pki, "admin", "ops") as admin, client(test_pki, "node", "node-1") as node:
            for http, path in ((node, "/v1/agent/sync"), (admin, "/v1/admin/catalog")):
                response = await http.post(f"{server}{path}", content=body)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["message"].startswith(why), response.text
            assert (await admin.get(f"{server}/v1/admin/nodes")).status_code == 200

    @pytest.mark.parametrize("since", ["1" * 30, "-1", "x"])
    async def test_event_query_out_of_range_is_a_400(self, server, test_pki, since):
        """`events?since=` past a 64-bit integer, negative or not a number is a 400 naming since."""
        async with client(test_pki, "admin", "ops") as admin:
            response = await admin.get(f"{server}/v1/admin/events", params={"since": since})
            assert response.status_code == 400, response.text
            assert "query parameter since" in response.json()["error"]["message"]
            assert (await admin.get(f"{server}/v1/admin/events")).status_code == 200

    async def test_absurd_replica_count_is_refused_by_the_server(self, server, test_pki):
        """`replicas: 1000000` sent past ctl is a 400 naming the limit; the stored catalog is unchanged."""
        async with client(test_pki, "admin", "ops") as admin:
            await admin.post(f"{server}/v1/admin/catalog", json={"text": CATALOG})
            huge = CATALOG.replace("profile: one", "profile: one\n    replicas: 1000000")
            response = await admin.post(f"{server}/v1/admin/catalog", json={"text": huge})
            assert response.status_code == 400, response.text
            message = response.json()["error"]["message"]
            assert "models.small.replicas: expected an integer at most 10000 (llmgw's limit)" in message
            stored = (await admin.get(f"{server}/v1/admin/catalog")).json()
            assert stored["text"] == CATALOG and stored["revision"] == 1


async def test_gateway_suspect_report_is_an_event_and_changes_nothing(server, test_pki):
    """A gateway's stall report is one event per replica a minute; replicas and routes stay as they were."""
    async with client(test_pki, "admin", "ops") as admin, client(test_pki, "gateway", "gw-1") as gateway:
        before = (await admin.get(f"{server}/v1/admin/replicas")).json()
        routes = (await gateway.get(f"{server}/v1/routes")).json()
        report = {"replica": "small-0", "reason": "nothing arrived from it for 10.2 s"}
        for _ in range(3):
            answered = await gateway.post(f"{server}/v1/gateway/suspect", json=report)
            assert answered.status_code == 202, answered.text
        assert answered.json() == {"replica": "small-0", "state": "unknown"}
        events = (await admin.get(f"{server}/v1/admin/events")).json()["events"]
        mine = [e["message"] for e in events if e["kind"] == "gateway"]
        assert mine == [
            "gateway gw-1 found it stalled: nothing arrived from it for 10.2 s; "
            "the agent's liveness canary decides whether it is hung"
        ]
        assert (await admin.get(f"{server}/v1/admin/replicas")).json() == before
        assert (await gateway.get(f"{server}/v1/routes")).json() == routes
        bad = await gateway.post(f"{server}/v1/gateway/suspect", json={"replica": "x" * 300, "reason": "r"})
        assert bad.status_code == 400 and "replica" in bad.json()["error"]["message"]
    async with client(test_pki, "node", "node-1") as node:
        refused = await node.post(f"{server}/v1/gateway/suspect", json=report)
        assert refused.status_code == 403


async def test_a_leader_that_starts_fences_nodes_revoked_before_it_led(test_pki, tmp_path):
    """node-1 revoked while no server ran: the next server declares it lost at once, before any sync of it."""
    from llmgw import pki

    config = test_pki.server_config(tmp_path / "state")
    async with trio.open_nursery() as first:
        url = await start_server(first, config, {"sim": SimEngine()})
        async with client(test_pki, "node", "node-1") as node, client(test_pki, "admin", "ops") as admin:
            assert (await node.post(f"{url}/v1/agent/sync", json=sync_body("node-1"))).status_code == 200
            events = (await admin.get(f"{url}/v1/admin/events")).json()["events"]  # stored by then
            assert [e["subject"] for e in events] == ["node-1"], events
        first.cancel_scope.cancel()
    [revoked] = pki.revoke(test_pki.ca, "node-1")
    wanted = f"its certificate {revoked.identity.serial:x} is revoked"
    async with trio.open_nursery() as second:
        url = await start_server(second, config, {"sim": SimEngine()})
        async with client(test_pki, "admin", "ops") as admin:
            with trio.fail_after(5):
                while True:
                    events = (await admin.get(f"{url}/v1/admin/events")).json()["events"]
                    fenced = [e for e in events if e["subject"] == "node-1" and wanted in e["message"]]
                    if fenced:
                        break
                    await trio.sleep(0.05)
        assert "lost at once" in fenced[0]["message"], fenced
        second.cancel_scope.cancel()
