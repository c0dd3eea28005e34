"""The fleet's manifest of a seed is the first complete one: two nodes sending theirs at once never swap it.

Issue 24: node-1's "2 files" and node-2's "0 files" manifests arrived in the
same second; the store kept the first but the server's memory (what ``ctl
models`` and placement read) took the last. A real server, real node
certificates, both POSTs in flight together.
"""

from __future__ import annotations

import pytest
import trio
from llmgw_engine_sim import SimEngine

from llmgw.testing.server import start_server
from llmgw.weights import Manifest, ManifestFile
from llmgw.wire import EventList, ModelList, from_json, to_json
from tests.server.test_server_api import client, sync_body

SOURCE = "seed:///data/m"
CATALOG = f"""
profiles:
  one:
    engine: sim
    gpus_per_node: 1
models:
  m:
    source: {SOURCE}
    profile: one
    replicas: 0
"""


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    return await start_server(nursery, test_pki.server_config(tmp_path / "state"), {"sim": SimEngine()})


def manifest(node: str, sha: str) -> Manifest:
    return Manifest(
        SOURCE, (ManifestFile("weights.bin", 100, sha * 64), ManifestFile("config.json", 2, "c" * 64)), node
    )


async def test_two_first_manifests_at_once_leave_one_for_the_store_the_answers_and_ctl_models(
    server, test_pki
):
    """Each try: both answers, ctl models and the one event name the same manifest; the other node's
    differing file is named in an event of its own."""
    async with client(test_pki, "node", "node-1") as one, client(test_pki, "node", "node-2") as two:
        for http, node in ((one, "node-1"), (two, "node-2")):
            assert (await http.post(f"{server}/v1/agent/sync", json=sync_body(node))).status_code == 200
        async with client(test_pki, "admin", "ops") as admin:
            applied = await admin.post(f"{server}/v1/admin/catalog", json={"text": CATALOG})
            assert applied.status_code == 200, applied.text
            answers: dict[str, Manifest] = {}

            async def send(http, node: str, sha: str) -> None:
                response = await http.post(f"{server}/v1/agent/manifests", json=to_json(manifest(node, sha)))
                assert response.status_code == 200, response.text
                answers[node] = from_json(response.json(), Manifest)

            async with trio.open_nursery() as both:
                both.start_soon(send, one, "node-1", "a")
                both.start_soon(send, two, "node-2", "b")
            assert answers["node-1"] == answers["node-2"]
            fleet = answers["node-1"]
            [model] = from_json((await admin.get(f"{server}/v1/admin/models")).json(), ModelList).models
            assert model.digest == fleet.digest
            other = "node-2" if fleet.made_by == "node-1" else "node-1"
            # read once: the server stores the events it holds before it answers
            events = from_json((await admin.get(f"{server}/v1/admin/events")).json(), EventList).events
            made = [e.message for e in events if e.message.startswith(f"manifest of {SOURCE} made by")]
            assert made == [
                f"manifest of {SOURCE} made by {fleet.made_by}: 2 files, 0.0 MB, digest {fleet.digest[:12]}"
            ]
            [differ] = [e.message for e in events if e.message.startswith(f"node {other} holds files")]
            assert "weights.bin (other content)" in differ and "config.json" not in differ


async def test_an_empty_manifest_is_refused_naming_the_field(server, test_pki):
    """A folder with no file is no copy: its manifest is refused, and nothing is stored."""
    async with client(test_pki, "node", "node-1") as one:
        empty = Manifest(SOURCE, (), "node-1")
        refused = await one.post(f"{server}/v1/agent/manifests", json=to_json(empty))
        assert refused.status_code == 400 and "files: empty manifest of seed:///data/m" in refused.text
        weights = await one.get(f"{server}/v1/agent/weights", params={"source": SOURCE})
        assert weights.status_code == 200 and weights.json()["manifest"] is None
