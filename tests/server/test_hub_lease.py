"""The server's Hub lease: one node downloads an hf:// source, the others are told who and how it goes."""

from __future__ import annotations

import pytest
from llmgw_engine_sim import SimEngine

from llmgw.testing.server import start_server
from llmgw.weights import Manifest, ManifestFile
from llmgw.wire import HubClaim, HubLease, from_json, to_json
from tests.server.test_server_api import client, sync_body

SOURCE = "hf://acme/tiny@main"


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    return await start_server(nursery, test_pki.server_config(tmp_path / "state"), {"sim": SimEngine()})


async def claim(http, server: str, status: str = "") -> HubLease:
    response = await http.post(f"{server}/v1/agent/weights/hub", json=to_json(HubClaim(SOURCE, status)))
    assert response.status_code == 200, response.text
    return from_json(response.json(), HubLease)


async def test_one_node_holds_the_lease_and_the_others_see_its_status(server, test_pki):
    """node-1 gets it and keeps it; node-2 is told node-1 has it, with node-1's last Hub error."""
    async with client(test_pki, "node", "node-1") as one, client(test_pki, "node", "node-2") as two:
        for http, node in ((one, "node-1"), (two, "node-2")):
            assert (await http.post(f"{server}/v1/agent/sync", json=sync_body(node))).status_code == 200
        assert await claim(one, server) == HubLease(SOURCE, "node-1", granted=True)
        assert await claim(two, server) == HubLease(SOURCE, "node-1", granted=False)
        reason = (
            "the hub at http://hub answered 401 Unauthorized for acme/tiny: the token is missing or wrong"
        )
        assert (await claim(one, server, reason)).granted
        assert await claim(two, server) == HubLease(SOURCE, "node-1", granted=False, status=reason)


async def test_bad_claims_and_unpinned_hub_manifests_are_refused(server, test_pki):
    """A claim for a non-hf source, and an hf:// manifest without its 40-hex commit, name the field."""
    async with client(test_pki, "node", "node-1") as one:
        body = to_json(HubClaim("seed:///m"))
        refused = await one.post(f"{server}/v1/agent/weights/hub", json=body)
        assert refused.status_code == 400 and "source: expected hf://ORG/NAME" in refused.text
        manifest = Manifest(SOURCE, (ManifestFile("config.json", 2, "a" * 64),), made_by="node-1")
        refused = await one.post(f"{server}/v1/agent/manifests", json=to_json(manifest))
        assert refused.status_code == 400 and "revision: expected the 40-hex commit" in refused.text
        pinned = Manifest(SOURCE, manifest.files, made_by="node-1", revision="c" * 40)
        stored = await one.post(f"{server}/v1/agent/manifests", json=to_json(pinned))
        assert stored.status_code == 200 and from_json(stored.json(), Manifest).revision == "c" * 40


async def test_a_lease_not_renewed_goes_to_the_next_node(server, test_pki, monkeypatch):
    """node-1 stops renewing (its agent died): once the lease ran out, node-2 gets the download."""
    import trio

    import llmgw.server.http.weights

    monkeypatch.setattr(llmgw.server.http.weights, "HUB_LEASE", 0.3)
    async with client(test_pki, "node", "node-1") as one, client(test_pki, "node", "node-2") as two:
        for http, node in ((one, "node-1"), (two, "node-2")):
            assert (await http.post(f"{server}/v1/agent/sync", json=sync_body(node))).status_code == 200
        assert (await claim(one, server)).granted
        assert not (await claim(two, server)).granted
        await trio.sleep(0.4)
        assert await claim(two, server) == HubLease(SOURCE, "node-2", granted=True)
        assert await claim(one, server) == HubLease(SOURCE, "node-2", granted=False)
