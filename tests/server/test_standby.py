"""Standbys on PostgreSQL: reads and the routes feed from the store, writes refused naming the leader.

Two real servers (in this process, over real mutual TLS) share one throwaway
PostgreSQL database; the first leads, the second is a standby.
"""

from __future__ import annotations

import logging
import re
from functools import partial

import httpx
import pytest
import trio
from click.testing import CliRunner
from llmgw_engine_sim import SimEngine

from llmgw.ctl.cli import ctl
from llmgw.gateway.leases import Leases
from llmgw.gateway.reports import SuspectReporter
from llmgw.net.client import ConnectionPool
from llmgw.net.server import Request, Response
from llmgw.server.ha.standby import StandbyView
from llmgw.server.main import serve_server
from llmgw.server.persist.cluster import add_api_key
from llmgw.server.persist.postgres import feed_revision, open_pg_store
from llmgw.server.persist.sqlite import StoreError
from llmgw.server.state.cluster import Settings
from llmgw.serverlist import LEADER_HEADER, STANDBY_HEADER, ServerList, send_to_leader
from llmgw.testing.gateway import start_gateway
from llmgw.testing.processes import wait_for
from llmgw.testing.server import start_server
from llmgw.wire import SuspectReport, SyncReply, from_json
from tests.server.test_server_api import CATALOG, client, sync_body


@pytest.fixture
async def servers(nursery, test_pki, tmp_path, pg_url):
    """(leader URL, standby URL): server A started first leads; B, started after, is a standby."""

    def config(name: str):
        return test_pki.server_config(
            tmp_path / name, store=pg_url, lease=3.0, poll_timeout=3.0, settings=Settings(lost_after=30)
        )

    engines = {"sim": SimEngine()}
    leader = await start_server(nursery, config("a"), engines)
    host, port = await nursery.start(partial(serve_server, config("b"), dict(engines)))
    standby = f"https://{host}:{port}"
    async with client(test_pki, "admin", "ops") as admin:

        async def standing_by():
            reply = await admin.get(f"{standby}/v1/admin/servers")
            return reply.status_code == 200 and STANDBY_HEADER in reply.headers

        await until(standing_by, "server B to answer as a standby (it found A leading)")
    return leader, standby


async def until(check, what: str):
    """Wait (10 s at most) until ``check()`` (plain or async) returns something true; return it."""
    with trio.fail_after(10):
        return await wait_for(check, what)


async def ready_replica(leader: str, test_pki) -> None:
    """node-1 syncs to the leader, the catalog is applied, node-1 reports its shard ready."""
    async with client(test_pki, "admin", "ops") as admin, client(test_pki, "node", "node-1") as node:
        reply = await node.post(f"{leader}/v1/agent/sync", json=sync_body("node-1"))
        assert reply.status_code == 200, reply.text
        applied = await admin.post(f"{leader}/v1/admin/catalog", json={"text": CATALOG})
        assert applied.status_code == 200, applied.text
        with trio.fail_after(5):
            body = {**sync_body("node-1", from_json(reply.json(), SyncReply).revision), "wait": True}
            placed = from_json((await node.post(f"{leader}/v1/agent/sync", json=body)).json(), SyncReply)
        (shard,) = placed.shards
        ready = {"replica_id": shard.replica_id, "attempt": shard.attempt, "rank": 0, "state": "ready"}
        body = {**sync_body("node-1", placed.revision), "observed": [ready]}
        assert (await node.post(f"{leader}/v1/agent/sync", json=body)).status_code == 200


async def test_standby_answers_reads_from_the_store_and_refuses_writes_naming_the_leader(servers, test_pki):
    """Reads on the standby show the leader's writes, marked as a standby's; writes: 503 naming the leader."""
    leader, standby = servers
    async with client(test_pki, "admin", "ops") as admin:
        # the key first: a view that shows the replica ready was stored after it (a key made after the replica
        # was ready could be missing from a view loaded between the two writes)
        created = await admin.post(f"{leader}/v1/admin/keys", json={"name": "team-a"})
        assert created.status_code == 201, created.text
        await ready_replica(leader, test_pki)

        async def replica_ready_on_standby():
            reply = await admin.get(f"{standby}/v1/admin/replicas")
            replicas = reply.json()["replicas"] if reply.status_code == 200 else []
            return reply if [r["state"] for r in replicas] == ["ready"] else None

        reply = await until(replica_ready_on_standby, "the standby to show the ready replica")
        assert reply.headers[STANDBY_HEADER].startswith("revision ")
        assert reply.headers[STANDBY_HEADER].endswith(f" s ago, leader {leader}")
        (shard,) = reply.json()["replicas"][0]["shards"]
        assert shard["state"] == "unknown" and shard["pid"] is None, "only the leader hears the agents"
        nodes = (await admin.get(f"{standby}/v1/admin/nodes")).json()["nodes"]
        assert [n["node_id"] for n in nodes] == ["node-1"]
        keys = (await admin.get(f"{standby}/v1/admin/keys")).json()["keys"]
        assert [k["name"] for k in keys] == ["team-a"]
        catalog = (await admin.get(f"{standby}/v1/admin/catalog")).json()
        assert (catalog["revision"], catalog["text"]) == (1, CATALOG)
        events = (await admin.get(f"{standby}/v1/admin/events")).json()["events"]
        assert any(e["message"] == "catalog applied by ops" for e in events), events
        servers_seen = (await admin.get(f"{standby}/v1/admin/servers")).json()["servers"]
        assert [(s["address"], s["role"]) for s in servers_seen] == [(leader, "leader"), (standby, "standby")]
        diff = await admin.post(f"{standby}/v1/admin/catalog/diff", json={"text": CATALOG})
        assert diff.status_code == 200, diff.text

        refused = await admin.post(f"{standby}/v1/admin/keys", json={"name": "team-b"})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "not_leader"
        assert refused.headers[LEADER_HEADER] == leader
        keys = (await admin.get(f"{leader}/v1/admin/keys")).json()["keys"]
        assert [k["name"] for k in keys] == ["team-a"], "the standby wrote nothing"
    issued = test_pki.client("admin", "ops")
    options = ["--server", standby, "--ca", str(test_pki.ca.cert_path)]
    options += ["--cert", str(issued.cert_path), "--key", str(issued.key_path)]
    result = await trio.to_thread.run_sync(lambda: CliRunner().invoke(ctl, [*options, "nodes"]))
    assert result.exit_code == 0 and "node-1" in result.stdout, result.output
    assert f"note: {standby} is a standby; this is the state the leader last stored" in result.stderr
    async with client(test_pki, "node", "node-1") as node:
        sync = await node.post(f"{standby}/v1/agent/sync", json=sync_body("node-1"))
        assert sync.status_code == 503 and sync.headers[LEADER_HEADER] == leader, (
            "agents sync with the leader"
        )


async def test_heartbeats_move_no_revision(servers, test_pki, pg_url):
    """Syncs that report nothing new write nothing: the change feed (and its NOTIFY) stays put.

    It waits 2 s (two reconciler ticks) on purpose, to show that nothing happens in that window.
    """
    leader, _ = servers
    await ready_replica(leader, test_pki)
    async with client(test_pki, "admin", "ops") as admin, client(test_pki, "node", "node-1") as node:

        async def ready():
            replicas = (await admin.get(f"{leader}/v1/admin/replicas")).json()["replicas"]
            return replicas and replicas[0]["state"] == "ready" and replicas[0]

        replica = await until(ready, "the replica to be ready on the leader")
        observed = [{"replica_id": replica["id"], "attempt": replica["attempt"], "rank": 0, "state": "ready"}]
        store = open_pg_store(pg_url)

        async def reconciler_runs() -> int:
            text = (await admin.get(f"{leader}/metrics")).text
            return int(float(re.search(r"^llmgw_server_reconcile_runs_total (\S+)$", text, re.M)[1]))

        try:
            # the leader's writes after the replica became ready have landed: each reconciler run persists
            # what changed, so two runs after it, nothing of it is left to write
            ran = await reconciler_runs()

            async def ran_twice() -> bool:
                return await reconciler_runs() >= ran + 2

            await until(ran_twice, "two reconciler runs on the leader")
            before = await store.run(feed_revision)
            revision = 0
            for _ in range(10):
                body = {**sync_body("node-1", revision), "observed": observed}
                reply = await node.post(f"{leader}/v1/agent/sync", json=body)
                assert reply.status_code == 200, reply.text
                revision = from_json(reply.json(), SyncReply).revision
                await trio.sleep(0.2)
            assert await store.run(feed_revision) == before
        finally:
            store.close()


async def test_routes_feed_on_a_standby_follows_the_leaders_writes(servers, test_pki):
    """A gateway long-polling a standby gets the routes, then is woken when the leader revokes a key."""
    leader, standby = servers
    await ready_replica(leader, test_pki)
    async with client(test_pki, "admin", "ops") as admin, client(test_pki, "gateway", "gw") as gateway:
        created = await admin.post(f"{leader}/v1/admin/keys", json={"name": "team-a"})
        assert created.status_code == 201, created.text

        async def routed():
            reply = await gateway.get(f"{standby}/v1/routes")
            table = reply.json() if reply.status_code == 200 else {}
            return table if table.get("routes", {}).get("small") and table.get("keys") else None

        table = await until(routed, "the standby's routes feed to route small with the key")
        assert table["routes"]["small"][0]["url"].startswith("http://127.0.0.5:")
        assert list(table["keys"].values()) == ["team-a"]
        same = await gateway.get(f"{standby}/v1/routes", params={"revision": table["revision"]})
        assert same.json()["revision"] == table["revision"], (
            "a reload that changed no route keeps the revision"
        )

        async def revoke():
            await trio.sleep(0.3)
            assert (await admin.delete(f"{leader}/v1/admin/keys/team-a")).status_code == 200

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(revoke)
                started = trio.current_time()
                params = {"revision": table["revision"], "wait": 1}
                woken = await gateway.get(f"{standby}/v1/routes", params=params)
                waited = trio.current_time() - started
        assert woken.status_code == 200 and woken.json()["keys"] == {}, woken.text
        assert woken.json()["revision"] != table["revision"]
        assert waited < 2.5, f"the long-poll answered after {waited:.1f} s: at its timeout, not on the change"


async def test_a_reader_that_lost_its_connection_resumes_from_its_revision(pg_url, caplog):
    """Writes made while a standby's connections are cut, and one without NOTIFY, all reach its view."""
    leader_store, reader_store = open_pg_store(pg_url), open_pg_store(pg_url)
    view = StandbyView(reader_store, {"sim": SimEngine()}, Settings(), poll=0.3)
    caplog.set_level(logging.WARNING, "llmgw.server")
    try:
        async with trio.open_nursery() as nursery:
            following = await nursery.start(view.follow)
            await until((lambda: view.view is not None), "the first view")
            await leader_store.write(lambda c: add_api_key(c, "before", "a" * 64, 1.0, "ops"))
            await until((lambda: "before" in view.view.app.keys), "the view to see the first key")
            seen = view.view.revision

            # cut every connection of the reader: its listener is gone, so no NOTIFY reaches it
            await leader_store.run(
                lambda c: c.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).fetchall()
            )
            again = open_pg_store(pg_url)
            await again.write(lambda c: add_api_key(c, "meanwhile", "b" * 64, 2.0, "ops"))
            again.close()
            await until((lambda: "meanwhile" in view.view.app.keys), "the view to catch up")
            assert view.view.revision == seen + 1
            assert any("cannot follow the store" in r.getMessage() for r in caplog.records)

            # a write that moves the revision without any NOTIFY is found by the poll
            def quiet(c):
                c.execute(
                    "INSERT INTO api_keys (name, sha256, created_at) VALUES ('quiet', ?, 3.0)", ("c" * 64,)
                )
                c.execute("UPDATE feed SET revision = revision + 1 WHERE id = 1")

            fresh = open_pg_store(pg_url)
            await fresh.run(quiet)
            assert await fresh.run(feed_revision) == seen + 2
            fresh.close()
            await until((lambda: "quiet" in view.view.app.keys), "the poll to find the quiet write")
            following.cancel()
    finally:
        leader_store.close()
        reader_store.close()


async def test_a_standby_that_cannot_reach_the_store_stops_answering_from_its_view(pg_url, caplog):
    """Past stale_after without reaching the store, the view is not served: clients get the refusal."""
    store = open_pg_store(pg_url)
    view = StandbyView(store, {"sim": SimEngine()}, Settings(), poll=0.2, stale_after=1.0)
    view.refusal = lambda: Response.json(503, {"error": {"type": "not_leader"}})
    caplog.set_level(logging.WARNING, "llmgw.server")
    request = Request("GET", "/v1/admin/events")
    try:
        async with trio.open_nursery() as nursery:
            following = await nursery.start(view.follow)
            await until(lambda: view.view is not None, "the first view")
            assert (await view.handle(request)).status == 401, (
                "served (the app refuses a request without a certificate)"
            )

            def unreachable():
                raise StoreError("cannot connect to PostgreSQL: connection refused")

            store.connect = unreachable
            await store.run(
                lambda c: c.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).fetchall()
            )
            await until(lambda: view.checked_at is not None and trio.current_time() - view.checked_at > 1.0,
                        "the view to go stale")  # fmt: skip
            assert (await view.handle(request)).status == 503
            assert any("cannot follow the store" in r.getMessage() for r in caplog.records)
            following.cancel()
    finally:
        store.close()


async def test_a_gateway_pointed_at_the_standby_only_gets_its_routes(servers, test_pki, nursery):
    """`llmgw gateway --server STANDBY`: it routes to the leader's ready replica, takes the leader's keys."""
    leader, standby = servers
    async with client(test_pki, "admin", "ops") as admin:
        # the key first: a view that shows the replica ready was stored after it (a key made after the replica
        # was ready could be missing from a view loaded between the two writes)
        created = await admin.post(f"{leader}/v1/admin/keys", json={"name": "team-a"})
        assert created.status_code == 201, created.text
        await ready_replica(leader, test_pki)
    issued = test_pki.client("gateway", "gw")
    tls = {"ca": test_pki.ca.cert_path, "cert": issued.cert_path, "key": issued.key_path}
    gateway, url = await start_gateway(nursery, standby, **tls)
    secret = created.json()["secret"]
    async with httpx.AsyncClient(timeout=10) as http:

        async def listed():
            reply = await http.get(f"{url}/v1/models", headers={"authorization": f"Bearer {secret}"})
            return reply.status_code == 200 and [m["id"] for m in reply.json()["data"]] == ["small"]

        await until(listed, "the gateway to list small, accepting the leader's key")
    (route,) = gateway.watcher.table.routes["small"]
    assert route.url.startswith("http://127.0.0.5:"), "the ready replica, as the leader stored it"


async def test_a_gateway_on_the_standby_tells_the_leader_the_routes_generation_it_holds(
    servers, test_pki, nursery
):
    """The standby's table carries the generation of the state it read, in the leader's numbering; a
    gateway reading from the standby reports it to the leader (which stops a replica that left the
    routes only once every gateway holds a table without it)."""
    leader, standby = servers
    await ready_replica(leader, test_pki)
    async with client(test_pki, "gateway", "gw") as feed:

        async def same_generation():
            tables = [(await feed.get(f"{url}/v1/routes")).json() for url in (leader, standby)]
            ready = all(t["routes"].get("small") for t in tables)
            return ready and tables[0]["generation"] == tables[1]["generation"] and tables[0]["generation"]

        generation = await until(same_generation, "the standby's routes to be the leader's, same generation")
    issued = test_pki.client("gateway", "gw")
    tls = {"ca": test_pki.ca.cert_path, "cert": issued.cert_path, "key": issued.key_path}
    gateway, _ = await start_gateway(nursery, standby, **tls)
    await until(lambda: gateway.held.delivered == generation, "the gateway to report the generation it holds")
    assert gateway.held.servers.current == leader, "reports go to the leader, routes come from the standby"
    assert gateway.watcher.server == standby


async def test_a_gateway_report_sent_to_the_standby_reaches_the_leader(servers, test_pki):
    """A stall report posted to the standby is answered not_leader; the gateway re-sends it to the leader."""
    leader, standby = servers
    async with ConnectionPool(ssl_context=test_pki.context("gateway", "gw")) as pool:
        reporter = SuspectReporter(pool, standby)
        with trio.fail_after(10):
            await reporter._deliver(SuspectReport("small-0", "no byte for 30 s"))
    assert reporter.delivered == 1 and reporter.servers.current == leader
    async with client(test_pki, "admin", "ops") as admin:
        events = (await admin.get(f"{leader}/v1/admin/events")).json()["events"]
    assert any(e["message"].startswith("gateway gw found it stalled: no byte for 30 s") for e in events)


async def test_a_gateways_lease_asked_of_the_standby_is_lent_by_the_leader(servers, test_pki):
    """Leases asked of the standby (not_leader) are asked again of the leader, which alone lends."""
    leader, standby = servers
    async with client(test_pki, "admin", "ops") as admin:
        made = await admin.post(f"{leader}/v1/admin/keys", json={"name": "capped", "limits": {"rpm": 2}})
        assert made.status_code == 201, made.text
    async with ConnectionPool(ssl_context=test_pki.context("gateway", "gw")) as pool:
        leases = Leases(pool, standby, trio.current_time)
        leases.seen("capped")
        leases.seen("capped")
        leases.seen("capped")
        with trio.fail_after(10):
            await leases.exchange()
    assert leases.up and leases.servers.current == leader
    assert [leases.take("capped") for _ in range(3)] == [True, True, False], "2 of the 3 asked: the rpm"
    assert leases.requests_wait("capped") > 0


async def test_an_agents_farewell_sent_to_the_standby_first_reaches_the_leader(servers, test_pki):
    """An agent's farewell with --server STANDBY,LEADER goes on to the leader, which takes it."""
    leader, standby = servers
    await ready_replica(leader, test_pki)
    listed = ServerList.parse(f"{standby},{leader}")
    async with client(test_pki, "node", "node-1") as node:
        body = {**sync_body("node-1"), "leaving": True}
        reply = await send_to_leader(node, listed, "POST", "/v1/agent/sync", json=body)
    assert reply.status_code == 200, reply.text
    assert listed.current == leader
    async with client(test_pki, "admin", "ops") as admin:

        async def noted():
            events = (await admin.get(f"{leader}/v1/admin/events")).json()["events"]
            return any(e["subject"] == "node-1" and "stopping on purpose" in e["message"] for e in events)

        await until(noted, "the leader to record node-1's agent leaving")
