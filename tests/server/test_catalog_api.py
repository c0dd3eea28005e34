"""The catalog over the admin API: diff before applying, refusal to remove models without prune, history."""

from __future__ import annotations

import httpx
import pytest
import trio
from click.testing import CliRunner
from llmgw_engine_sim import SimEngine

from llmgw.cli import cli
from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.server import start_server

TWO_MODELS = catalog_yaml(
    {"small": model("tiny/model"), "other": model("other/model", replicas=2)}, one=sim_profile(None)
)


ONE_MODEL = catalog_yaml(
    {"small": model("tiny/model", replicas=3)}, one=sim_profile(None, "--max-tokens", "64")
)


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    """A real `llmgw server` on 127.0.0.1, port 0; yields its base URL."""
    config = test_pki.server_config(tmp_path / "state")
    return await start_server(nursery, config, {"sim": SimEngine()})


def admin(test_pki, name: str = "alice") -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=test_pki.context("admin", name), timeout=10)


async def test_removing_a_model_is_refused_without_prune(server, test_pki):
    """A catalog without a model is refused (409, naming the model and --prune) and changes nothing."""
    async with admin(test_pki) as client:
        assert (await client.post(f"{server}/v1/admin/catalog", json={"text": TWO_MODELS})).status_code == 200
        refused = await client.post(f"{server}/v1/admin/catalog", json={"text": ONE_MODEL, "name": "c.yaml"})
        assert refused.status_code == 409
        message = refused.json()["error"]["message"]
        assert "c.yaml removes 1 model" in message and "other" in message and "--prune" in message
        assert "nothing changed" in message
        stored = (await client.get(f"{server}/v1/admin/catalog")).json()
        assert stored["revision"] == 1 and "other:" in stored["text"]


async def test_prune_removes_the_model_and_answers_the_diff(server, test_pki):
    """With prune, the catalog is applied and the answer lists what was removed, added and changed."""
    async with admin(test_pki) as client:
        await client.post(f"{server}/v1/admin/catalog", json={"text": TWO_MODELS})
        applied = await client.post(f"{server}/v1/admin/catalog", json={"text": ONE_MODEL, "prune": True})
        assert applied.status_code == 200, applied.text
        body = applied.json()
        assert body["revision"] == 2 and body["wanted"] == {"small": 3}
        changes = {(c["section"], c["name"]): c for c in body["diff"]["changes"]}
        assert changes["model", "other"]["change"] == "removed"
        assert changes["model", "small"]["fields"] == [
            "replicas: 1 -> 3",
            "profile one: args: [] -> [--max-tokens, 64]",
        ]
        assert changes["profile", "one"]["change"] == "changed"


async def test_diff_changes_nothing(server, test_pki):
    """POST /v1/admin/catalog/diff answers the changes and leaves the catalog in force as it was."""
    async with admin(test_pki) as client:
        await client.post(f"{server}/v1/admin/catalog", json={"text": TWO_MODELS})
        diff = (await client.post(f"{server}/v1/admin/catalog/diff", json={"text": ONE_MODEL})).json()
        assert diff["revision"] == 1
        assert [(c["name"], c["change"]) for c in diff["changes"] if c["section"] == "model"] == [
            ("other", "removed"),
            ("small", "changed"),
        ]
        assert (await client.get(f"{server}/v1/admin/catalog")).json()["revision"] == 1
        bad = await client.post(f"{server}/v1/admin/catalog/diff", json={"text": "models: 3"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_catalog"


async def test_history_names_who_applied_each_revision(server, test_pki):
    """Each revision is stored with the admin certificate's name; any revision can be read back."""
    async with admin(test_pki, "alice") as alice, admin(test_pki, "bob") as bob:
        await alice.post(f"{server}/v1/admin/catalog", json={"text": TWO_MODELS})
        await bob.post(f"{server}/v1/admin/catalog", json={"text": ONE_MODEL, "prune": True})
        history = (await alice.get(f"{server}/v1/admin/catalog/history")).json()["revisions"]
        assert [(r["revision"], r["author"]) for r in history] == [(1, "alice"), (2, "bob")]
        assert all(r["applied_at"] > 0 for r in history)
        first = (await alice.get(f"{server}/v1/admin/catalog", params={"revision": 1})).json()
        assert first["text"] == TWO_MODELS and first["author"] == "alice"
        missing = await alice.get(f"{server}/v1/admin/catalog", params={"revision": 9})
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == (
            "no catalog revision 9 (the latest is 2; see ctl catalog history)"
        )
        events = (await alice.get(f"{server}/v1/admin/events")).json()["events"]
        assert any(e["message"] == "catalog applied by bob" for e in events)


async def test_ctl_diff_apply_and_catalog(server, test_pki, tmp_path):
    """`ctl diff`, `ctl apply` (refused, then --prune), `ctl catalog` and its history, as a user runs them.

    No node syncs here: no replica exists, so none is to stop.
    """
    issued = test_pki.client("admin", "carol")
    base = ["ctl", "--server", server, "--ca", str(test_pki.ca.cert_path)]
    base += ["--cert", str(issued.cert_path), "--key", str(issued.key_path)]
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(TWO_MODELS)
    second.write_text(ONE_MODEL)

    def ctl(*args: str):
        return CliRunner().invoke(cli, [*base, *args], catch_exceptions=False)

    async def run(*args: str):
        return await trio.to_thread.run_sync(lambda: ctl(*args))

    applied = await run("apply", str(first))
    assert applied.exit_code == 0, applied.output
    assert "+ model small: added: 1 replica to place" in applied.output
    assert f"applied {first} as revision 1" in applied.output
    diff = await run("diff", str(second))
    assert diff.exit_code == 0, diff.output
    assert diff.stdout.splitlines() == [
        "against catalog revision 1:",
        "  - model other: removed",
        "  ~ model small: changed: 3 replicas to place",
        "      replicas: 1 -> 3",
        "      profile one: args: [] -> [--max-tokens, 64]",
        "  ~ profile one: changed",
        "      args: [] -> [--max-tokens, 64]",
    ]
    refused = await run("apply", str(second))
    assert refused.exit_code == 1
    assert refused.stdout == diff.stdout, "a refused apply shows what it would change"
    assert "removes 1 model" in refused.stderr and "apply with --prune" in refused.stderr
    pruned = await run("apply", "--prune", str(second))
    assert pruned.exit_code == 0, pruned.output
    assert "- model other: removed" in pruned.stdout
    shown = await run("catalog", "--revision", "1")
    assert shown.stdout == TWO_MODELS
    assert shown.stderr.startswith("# revision 1, applied ") and shown.stderr.rstrip().endswith("by carol")
    assert (await run("catalog")).stdout == ONE_MODEL
    history = (await run("catalog", "history")).stdout.splitlines()
    assert history[0].split() == ["revision", "applied", "by"]
    assert [line.split()[0] + " " + line.split()[-1] for line in history[2:]] == ["1 carol", "2 carol"]


async def test_an_engine_installed_after_the_server_started_is_named_with_a_restart(
    nursery, test_pki, tmp_path, monkeypatch
):
    """A catalog naming an engine whose plugin came after the server started: 400 saying to restart it."""
    from llmgw.server import late_plugins

    monkeypatch.setattr(late_plugins, "_AT_START", {})  # as if every plugin was installed after the start
    server = await start_server(nursery, test_pki.server_config(tmp_path / "state"), {})
    async with admin(test_pki) as client:
        refused = await client.post(f"{server}/v1/admin/catalog", json={"text": TWO_MODELS, "name": "c.yaml"})
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert "no plugin provides engine 'sim'" in message
    assert "plugins installed after this server started, which it has not loaded: " in message
    assert "llmgw-engine-sim" in message and "restart it" in message
