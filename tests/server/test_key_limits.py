"""Per-key limits over the admin API and ``ctl keys``: stored with the key, listed, changed all or nothing,
handed to gateways in the routes feed; keys from before limits stay unlimited."""

from __future__ import annotations

import hashlib
import json
import sqlite3

import httpx
import pytest
import trio
from click.testing import CliRunner
from llmgw_engine_sim import SimEngine

from llmgw.ctl.cli import ctl
from llmgw.server.persist.cluster import add_api_key, load_api_keys, set_api_key_limits
from llmgw.server.persist.sqlite import MIGRATIONS, open_store
from llmgw.testing.server import start_server
from llmgw.wire import KeyLimits, Priority, from_json


@pytest.fixture
async def server(nursery, test_pki, tmp_path, open_test_store):
    """A real `llmgw server` (each store) whose state holds `old`, a key stored before limits; its URL."""
    store = open_test_store()
    digest = hashlib.sha256(b"old-secret").hexdigest()
    await store.write(lambda conn: add_api_key(conn, "old", digest, 1.0, "an older llmgw"))
    store.close()
    config = test_pki.server_config(tmp_path / "state", store=open_test_store.url)
    return await start_server(nursery, config, {"sim": SimEngine()})


def client(test_pki, role: str, name: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=test_pki.context(role, name), timeout=10)


async def run_ctl(test_pki, server: str, *args: str):
    """``llmgw ctl --server ... ARGS`` in a thread (the server runs in this one); the click Result."""
    issued = test_pki.client("admin", "ops")
    options = ["--server", server, "--ca", str(test_pki.ca.cert_path)]
    options += ["--cert", str(issued.cert_path), "--key", str(issued.key_path)]
    return await trio.to_thread.run_sync(lambda: CliRunner().invoke(ctl, [*options, *args]))


async def listed(test_pki, server: str) -> dict[str, dict]:
    """``ctl keys list -o json``: key name -> its limits."""
    result = await run_ctl(test_pki, server, "keys", "list", "-o", "json")
    assert result.exit_code == 0, result.output
    return {k["name"]: k["limits"] for k in json.loads(result.stdout)}


UNLIMITED = {
    "rpm": None, "tpm": None, "concurrency": None, "models": None, "priority": "standard", "budget": None,
    "budget_period": "day",
}  # fmt: skip


async def test_ctl_creates_a_key_with_limits_and_lists_them(server, test_pki):
    """`keys create --rpm --tpm --concurrency --models --priority` stores them; `keys list` shows them."""
    created = await run_ctl(
        test_pki, server, "keys", "create", "team-a", "--rpm", "3", "--tpm", "1000", "--concurrency", "2",
        "--models", "llama, embed", "--priority", "batch",
    )  # fmt: skip
    assert created.exit_code == 0, created.output
    assert created.stdout.startswith("llmgw-")
    assert "rpm 3, tpm 1000, concurrency 2, budget -, models llama,embed, priority batch" in created.stderr
    keys = await listed(test_pki, server)
    expected = {"rpm": 3, "tpm": 1000, "concurrency": 2, "models": ["llama", "embed"], "priority": "batch"}
    assert keys == {"old": UNLIMITED, "team-a": {**UNLIMITED, **expected}}
    table = await run_ctl(test_pki, server, "keys", "list")
    header, _, old, team = table.stdout.splitlines()
    assert header.split() == [
        "name", "created", "revoked", "rpm", "tpm", "concurrency", "budget", "models", "priority",
    ]  # fmt: skip
    assert old.split()[-6:] == ["-", "-", "-", "-", "*", "standard"]
    assert team.split()[-6:] == ["3", "1000", "2", "-", "llama,embed", "batch"]


async def test_routes_feed_carries_the_limits_of_live_keys_only(server, test_pki):
    """Gateways get each limited key's limits by name; unlimited and revoked keys carry none."""
    async with client(test_pki, "admin", "ops") as admin, client(test_pki, "gateway", "gw-1") as gateway:
        body = {"name": "capped", "limits": {"rpm": 3, "priority": "critical"}}
        created = await admin.post(f"{server}/v1/admin/keys", json=body)
        assert created.status_code == 201, created.text
        await admin.post(f"{server}/v1/admin/keys", json={"name": "free"})
        routes = (await gateway.get(f"{server}/v1/routes")).json()
        assert set(routes["keys"].values()) == {"old", "capped", "free"}
        assert routes["limits"] == {"capped": {**UNLIMITED, "rpm": 3, "priority": "critical"}}
        await admin.delete(f"{server}/v1/admin/keys/capped")
        assert (await gateway.get(f"{server}/v1/routes")).json()["limits"] == {}


async def test_update_changes_the_limits_given_and_keeps_the_others(server, test_pki):
    """`keys update` sets what it is given, `unlimited` and `*` lift a limit, the rest stays."""
    await run_ctl(test_pki, server, "keys", "create", "k", "--rpm", "3", "--tpm", "50", "--models", "a")
    result = await run_ctl(test_pki, server, "keys", "update", "k", "--rpm", "10", "--priority", "critical")
    assert result.exit_code == 0, result.output
    assert "rpm 10, tpm 50, concurrency -, budget -, models a, priority critical" in result.output
    result = await run_ctl(test_pki, server, "keys", "update", "k", "--tpm", "unlimited", "--models", "*")
    assert result.exit_code == 0, result.output
    assert (await listed(test_pki, server))["k"] == {**UNLIMITED, "rpm": 10, "priority": "critical"}
    result = await run_ctl(test_pki, server, "keys", "update", "old", "--concurrency", "4")
    assert result.exit_code == 0, result.output
    assert (await listed(test_pki, server))["old"] == {**UNLIMITED, "concurrency": 4}


@pytest.mark.parametrize(
    ("args", "flag", "expected"),
    [
        (["--rpm", "0"], "--rpm", "expected a positive integer"),
        (["--tpm", "1.5"], "--tpm", "expected a positive integer"),
        (["--concurrency", "-2"], "--concurrency", "expected a positive integer"),
        (["--models", "a,,b"], "--models", "expected model names separated by commas"),
        (["--models", "a,a"], "--models", "a model is named twice"),
        (["--priority", "urgent"], "--priority", "'urgent' is not one of 'critical', 'standard', 'batch'"),
        (["--rpm", "unlimited"], "--rpm", "expected a positive integer (at most 1000000000000), got"),
    ],
)
async def test_ctl_refuses_a_bad_limit_naming_its_flag(server, test_pki, args, flag, expected):
    """A bad limit on `keys create` is a usage error naming the flag and what it takes; nothing is created."""
    result = await run_ctl(test_pki, server, "keys", "create", "k", *args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}'" in result.output and expected in result.output
    assert "Traceback" not in result.output
    assert set(await listed(test_pki, server)) == {"old"}


async def test_a_bad_update_changes_nothing(server, test_pki):
    """An update with one bad value leaves every limit as it was, over ctl and over the API."""
    await run_ctl(test_pki, server, "keys", "create", "k", "--rpm", "3")
    before = (await listed(test_pki, server))["k"]
    result = await run_ctl(test_pki, server, "keys", "update", "k", "--tpm", "100", "--concurrency", "0")
    assert result.exit_code == 2 and "Invalid value for '--concurrency'" in result.output
    nothing = await run_ctl(test_pki, server, "keys", "update", "k")
    assert nothing.exit_code == 2 and "give at least one of --rpm" in nothing.output
    async with client(test_pki, "admin", "ops") as admin:
        for body, named in [
            ({"tpm": 100, "rpm": 0}, "rpm: expected a positive integer"),
            ({"tpm": 100, "unlimited": ["tpm"]}, "tpm: given a value and lifted"),
            (
                {"tpm": 100, "unlimited": ["priority"]},
                "unlimited: expected some of rpm, tpm, concurrency, models",
            ),
            ({"tpm": "100"}, "expected an integer, got '100'"),
            ({"priority": "gold"}, "expected one of critical, standard, batch, got 'gold'"),
        ]:
            response = await admin.patch(f"{server}/v1/admin/keys/k", json=body)
            assert response.status_code == 400, (body, response.text)
            assert named in response.json()["error"]["message"]
        missing = await admin.patch(f"{server}/v1/admin/keys/nope", json={"rpm": 1})
        assert missing.status_code == 404 and "no API key named 'nope'" in missing.json()["error"]["message"]
        await admin.delete(f"{server}/v1/admin/keys/k")
        revoked = await admin.patch(f"{server}/v1/admin/keys/k", json={"rpm": 1})
        assert revoked.status_code == 409 and "revoked" in revoked.json()["error"]["message"]
    assert (await listed(test_pki, server))["k"] == before


async def test_limits_are_stored_with_the_key(open_test_store):
    """Limits written to the store are read back as they were (each store); an unlimited key stores none."""
    store = open_test_store()
    try:
        limits = KeyLimits(rpm=5, tpm=7, concurrency=1, models=("m",), priority=Priority.CRITICAL)
        await store.write(lambda conn: add_api_key(conn, "a", "a" * 64, 1.0, "ops", limits))
        await store.write(lambda conn: add_api_key(conn, "b", "b" * 64, 1.0, "ops"))
        await store.write(lambda conn: set_api_key_limits(conn, "b", KeyLimits(rpm=2), 2.0, "ops"))
        await store.write(lambda conn: set_api_key_limits(conn, "a", KeyLimits(), 2.0, "ops"))
        keys = await store.run(load_api_keys)
        assert keys["a"].limits == KeyLimits() and keys["b"].limits == KeyLimits(rpm=2)
        stored = await store.run(
            lambda c: c.execute("SELECT name, limits FROM api_keys ORDER BY name").fetchall()
        )
        assert stored[0] == ("a", None)
    finally:
        store.close()


async def test_keys_stored_before_limits_migrate_unlimited(tmp_path):
    """A key in a database from before limits keeps its hash and dates, and is unlimited once migrated."""
    before = next(i for i, script in enumerate(MIGRATIONS) if "ADD COLUMN limits" in script)
    conn = sqlite3.connect(tmp_path / "state.db")
    for script in MIGRATIONS[:before]:
        conn.executescript(script)
    conn.execute("INSERT INTO api_keys (name, sha256, created_at) VALUES ('team', ?, 5.0)", ("c" * 64,))
    conn.execute(f"PRAGMA user_version = {before}")
    conn.commit()
    conn.close()
    store = open_store(tmp_path)
    try:
        (record,) = (await store.run(load_api_keys)).values()
        assert (record.digest, record.created_at, record.revoked_at) == ("c" * 64, 5.0, None)
        assert record.limits == KeyLimits()
    finally:
        store.close()


async def test_gateways_lease_a_keys_rate_from_the_server(server, test_pki):
    """`POST /v1/gateway/allowances` lends two gateways no more than the rpm in all; nodes may not ask."""
    async with client(test_pki, "admin", "ops") as admin:
        await admin.post(f"{server}/v1/admin/keys", json={"name": "k", "limits": {"rpm": 5, "tpm": 100}})
    asked = {
        "gateway": "gw-a:1",
        "keys": [{"key": "k", "wanted": 4, "tokens": 150}, {"key": "old", "wanted": 9}],
    }
    async with client(test_pki, "gateway", "gw-1") as gateway:
        first = await gateway.post(f"{server}/v1/gateway/allowances", json=asked)
        assert first.status_code == 200, first.text
        (lent,) = first.json()["keys"]  # `old` has no rate: no answer for it
        assert lent["key"] == "k" and lent["granted"] == 4 and lent["tokens_wait"] > 0
        second = await gateway.post(f"{server}/v1/gateway/allowances", json={**asked, "gateway": "gw-b:2"})
        assert second.json()["keys"][0]["granted"] == 1
        bad = await gateway.post(
            f"{server}/v1/gateway/allowances", json={"gateway": "g", "keys": [{"key": 3}]}
        )
        assert bad.status_code == 400 and "expected a string" in bad.json()["error"]["message"]
    async with client(test_pki, "node", "node-1") as node:
        refused = await node.post(f"{server}/v1/gateway/allowances", json=asked)
        assert refused.status_code == 403


async def test_gateways_hold_a_keys_seats_under_their_certificate(server, test_pki):
    """`POST /v1/gateway/allowances` lends a key's concurrency as seats, with their TTL: two held by one
    gateway are not lent to another, even one naming the same process (seats are held per certificate)."""
    async with client(test_pki, "admin", "ops") as admin:
        await admin.post(f"{server}/v1/admin/keys", json={"name": "k", "limits": {"concurrency": 2}})
    asked = {"gateway": "gw:1", "keys": [{"key": "k", "seats_used": 1, "seats_wanted": 2}]}
    async with client(test_pki, "gateway", "gw-1") as first:
        lent = (await first.post(f"{server}/v1/gateway/allowances", json=asked)).json()
        assert lent["keys"][0]["seats"] == 2 and lent["seat_ttl"] > 0, lent
    async with client(test_pki, "gateway", "gw-2") as second:
        mimic = {"gateway": "gw:1", "keys": [{"key": "k", "seats_wanted": 1}]}
        lent = (await second.post(f"{server}/v1/gateway/allowances", json=mimic)).json()
        assert lent["keys"][0]["seats"] == 0, lent


async def test_ctl_warns_when_the_server_did_not_store_the_limits(server, test_pki, monkeypatch):
    """Against a server that ignores limits (an llmgw from before them), `keys create --rpm` says so."""
    import llmgw.server.http.keys as endpoints

    def older(data, kind):
        return from_json({k: v for k, v in data.items() if k != "limits"}, kind)

    monkeypatch.setattr(endpoints, "from_json", older)
    result = await run_ctl(test_pki, server, "keys", "create", "k", "--rpm", "3")
    assert result.exit_code == 0, result.output
    assert "warning: the server did not store the limits asked (rpm 3, tpm -" in result.stderr
