"""Rollouts over the admin API: the status view, and undo refused or done."""

from __future__ import annotations

import httpx
import pytest
from llmgw_engine_sim import SimEngine

from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.server import start_server


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    """A real `llmgw server` on 127.0.0.1, port 0; yields its base URL."""
    config = test_pki.server_config(tmp_path / "state")
    return await start_server(nursery, config, {"sim": SimEngine()})


async def apply(client: httpx.AsyncClient, server: str, *args: str, other: str = "other/model") -> None:
    models = {"small": model("tiny/model"), "other": model(other, "two")}
    text = catalog_yaml(models, one=sim_profile(None, *args), two=sim_profile(None))
    response = await client.post(f"{server}/v1/admin/catalog", json={"text": text})
    assert response.status_code == 200, response.text


async def test_rollout_status_lists_every_model_or_names_the_unknown_one(server, test_pki):
    async with httpx.AsyncClient(verify=test_pki.context("admin", "alice"), timeout=10) as client:
        await apply(client, server)
        listed = (await client.get(f"{server}/v1/admin/rollouts")).json()["rollouts"]
        assert [(r["model"], r["state"]) for r in listed] == [("other", "done"), ("small", "done")]
        missing = await client.get(f"{server}/v1/admin/rollouts", params={"model": "nope"})
        assert missing.status_code == 404
        assert "no model 'nope' in the catalog in force (models: other, small)" in missing.text


async def test_undo_reapplies_the_previous_revision_or_says_why_not(server, test_pki):
    async with httpx.AsyncClient(verify=test_pki.context("admin", "alice"), timeout=10) as client:
        await apply(client, server)
        first = await client.post(f"{server}/v1/admin/rollouts/small/undo")
        assert first.status_code == 409 and "no catalog revision before 1" in first.text
        await apply(client, server, "--bogus", other="other/model2")
        refused = await client.post(f"{server}/v1/admin/rollouts/small/undo")
        assert refused.status_code == 409
        assert "also differs from the catalog in force in model other" in refused.json()["error"]["message"]
        await apply(client, server, "--bogus")  # revision 3
        await apply(client, server, "--x")  # revision 4: only small's args differ from revision 3
        undone = await client.post(f"{server}/v1/admin/rollouts/small/undo")
        assert undone.status_code == 200, undone.text
        assert undone.json() | {"summary": ""} == {
            "model": "small",
            "restored": 3,
            "revision": 5,
            "summary": "",
        }
        stored = (await client.get(f"{server}/v1/admin/catalog")).json()
        assert stored["revision"] == 5 and "--bogus" in stored["text"]
        assert stored["author"] == "alice (ctl rollout undo small)"
