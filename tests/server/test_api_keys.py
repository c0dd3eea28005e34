"""API key names over the admin API and ``ctl keys``: one documented pattern, any name revocable."""

from __future__ import annotations

import hashlib

import httpx
import pytest
import trio
from click.testing import CliRunner
from llmgw_engine_sim import SimEngine

from llmgw.ctl.cli import ctl
from llmgw.server.persist.cluster import add_api_key
from llmgw.testing.server import start_server

#: a key an older llmgw accepted (``$`` matched before the trailing newline)
LEGACY = "nl-key\n"


@pytest.fixture
async def server(nursery, test_pki, tmp_path, open_test_store):
    """A real `llmgw server` (each store) whose state holds the legacy key ``nl-key\\n``; its URL."""
    state = tmp_path / "state"
    store = open_test_store()
    digest = hashlib.sha256(b"legacy-secret").hexdigest()
    await store.write(lambda conn: add_api_key(conn, LEGACY, digest, 1.0, "an older llmgw"))
    store.close()
    config = test_pki.server_config(state, store=open_test_store.url)
    return await start_server(nursery, config, {"sim": SimEngine()})


def admin_client(test_pki) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=test_pki.context("admin", "ops"), timeout=10)


async def run_ctl(test_pki, server: str, *args: str):
    """``llmgw ctl --server ... ARGS`` in a thread (the server runs in this one); the click Result."""
    issued = test_pki.client("admin", "ops")
    options = ["--server", server, "--ca", str(test_pki.ca.cert_path)]
    options += ["--cert", str(issued.cert_path), "--key", str(issued.key_path)]
    return await trio.to_thread.run_sync(lambda: CliRunner().invoke(ctl, [*options, *args]))


@pytest.mark.parametrize("name", ["nl-key\n", "Team", "-lead", "a" * 64, "a/b", "a b", ""])
async def test_name_outside_the_pattern_is_a_400_naming_the_field(server, test_pki, name):
    """`keys create` with a name outside the documented pattern is refused with 400 naming `name`."""
    async with admin_client(test_pki) as admin:
        response = await admin.post(f"{server}/v1/admin/keys", json={"name": name})
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert message.startswith("name: expected 1-63 of a-z, 0-9") and repr(name) in message
        names = [k["name"] for k in (await admin.get(f"{server}/v1/admin/keys")).json()["keys"]]
        assert names == [LEGACY]


async def test_ctl_revokes_a_key_whose_name_needs_escaping(server, test_pki):
    """`ctl keys revoke $'nl-key\\n'` revokes that key (not `nl-key`), with no URL error."""
    result = await run_ctl(test_pki, server, "keys", "revoke", LEGACY)
    assert result.exit_code == 0, result.output
    assert "revoked" in result.output
    async with admin_client(test_pki) as admin:
        (key,) = (await admin.get(f"{server}/v1/admin/keys")).json()["keys"]
        assert key["name"] == LEGACY and key["revoked_at"] is not None


async def test_ctl_revokes_any_valid_name_and_a_missing_one_is_a_clean_error(server, test_pki):
    """Each character a valid name may hold survives the round trip; an unknown name is a clean error."""
    created = await run_ctl(test_pki, server, "keys", "create", "a.b_c-9")
    assert created.exit_code == 0, created.output
    revoked = await run_ctl(test_pki, server, "keys", "revoke", "a.b_c-9")
    assert revoked.exit_code == 0, revoked.output
    missing = await run_ctl(test_pki, server, "keys", "revoke", "no/such%key\x00")
    assert missing.exit_code == 1
    assert "no API key named 'no/such%key\\x00'" in missing.output
    assert "Traceback" not in missing.output


async def test_each_path_segment_is_decoded_once(server, test_pki):
    """`%6Beys` is the segment `keys`; `%2541` reaches the handler as `%41`, not as `A`."""
    async with admin_client(test_pki) as admin:
        await admin.post(f"{server}/v1/admin/keys", json={"name": "a"})
        twice = await admin.delete(f"{server}/v1/admin/keys/%2561")
        assert twice.status_code == 404 and "no API key named '%61'" in twice.json()["error"]["message"]
        once = await admin.delete(f"{server}/v1/admin/%6Beys/%61")
        assert once.status_code == 200, once.text
        assert once.json()["name"] == "a"
        bad = await admin.delete(f"{server}/v1/admin/keys/%ff")
        assert bad.status_code == 400 and "not UTF-8" in bad.json()["error"]["message"]
