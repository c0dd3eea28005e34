"""Downloads from a Hub: the real ``huggingface_hub`` client against the stand-in (a real HTTP server)."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download

from llmgw.testing.hub import HubStandIn
from llmgw.weights import HubRef
from llmgw.weights.hub import HubError, HubFile, HubSettings, download, resolve

REPO = "acme/tiny"


@pytest.fixture
def hub():
    with HubStandIn() as stand_in:
        yield stand_in


@pytest.fixture
def model(hub):
    """A repo with an LFS weight file (on a CDN origin), a small file and one in a folder; its commit."""
    files = {"model.safetensors": os.urandom(3_000_000), "config.json": b'{"a": 1}', "sub/vocab.txt": b"hi"}
    return files, hub.add_model(REPO, files)


class TestStandInWithTheRealClient:
    def test_model_info_lists_files_with_sizes_and_lfs_sha256(self, hub, model):
        """HfApi.model_info(files_metadata=True): the commit, every file, LFS sha256 for the weights."""
        files, commit = model
        info = HfApi(endpoint=hub.endpoint, token=False).model_info(REPO, files_metadata=True)
        assert info.sha == commit
        siblings = {s.rfilename: s for s in info.siblings}
        assert {name: s.size for name, s in siblings.items()} == {n: len(d) for n, d in files.items()}
        weights = files["model.safetensors"]
        assert siblings["model.safetensors"].lfs["sha256"] == hashlib.sha256(weights).hexdigest()
        assert siblings["config.json"].lfs is None

    def test_hf_hub_download_and_snapshot_download_get_every_file(self, hub, model, tmp_path):
        """The library's own downloads work against it: a file, then the whole snapshot at a commit."""
        files, commit = model
        path = hf_hub_download(
            REPO, "model.safetensors", endpoint=hub.endpoint, token=False, local_dir=tmp_path
        )
        assert open(path, "rb").read() == files["model.safetensors"]
        root = snapshot_download(
            REPO, revision=commit, endpoint=hub.endpoint, token=False, local_dir=tmp_path
        )
        for name, data in files.items():
            assert (tmp_path / name).read_bytes() == data, name
        assert str(tmp_path) == root

    def test_lfs_files_come_from_the_cdn_origin_without_the_token(self, hub, model, tmp_path):
        """The weights are a 302 to another origin; the token stays with the Hub."""
        hub.token = "t0ken"
        hf_hub_download(REPO, "model.safetensors", endpoint=hub.endpoint, token="t0ken", local_dir=tmp_path)
        assert any(key.startswith("GET /cdn/") for key in hub.requests)
        assert hub.cdn_authorizations == []

    def test_unknown_revision_is_the_hubs_revision_not_found(self, hub, model):
        """404 with X-Error-Code RevisionNotFound: the library raises its RevisionNotFoundError."""
        from huggingface_hub.utils import RevisionNotFoundError

        with pytest.raises(RevisionNotFoundError):
            HfApi(endpoint=hub.endpoint, token=False).model_info(REPO, revision="nope")


class TestLlmgwDownloads:
    def test_resolve_pins_the_revision_and_gives_lfs_sha256(self, hub, model):
        """resolve(): the branch's commit, and the sha256 the Hub gives for LFS files only."""
        files, commit = model
        found = resolve(HubSettings(hub.endpoint), HubRef(REPO, "main"))
        assert found.commit == commit
        by_path = {f.path: f for f in found.files}
        assert by_path["model.safetensors"].sha256 == hashlib.sha256(files["model.safetensors"]).hexdigest()
        assert by_path["config.json"] == HubFile("config.json", len(files["config.json"]), None)

    def test_download_resumes_from_the_partial_file(self, hub, model, tmp_path):
        """A partial file of N bytes: the Hub is asked for bytes N- only; the result is the whole file."""
        files, commit = model
        data = files["model.safetensors"]
        partial = tmp_path / "model.safetensors.part"
        partial.write_bytes(data[:1_000_000])
        seen = []
        file = HubFile("model.safetensors", len(data))
        download(HubSettings(hub.endpoint), HubRef(REPO), commit, file, partial, seen.append)
        assert partial.read_bytes() == data
        assert hub.starts == [(f"{REPO}/model.safetensors", 1_000_000)]
        assert hub.bytes_served[f"{REPO}/model.safetensors"] == len(data) - 1_000_000 == sum(seen)

    def test_a_stopped_download_keeps_its_bytes(self, hub, model, tmp_path):
        """stop set: the download ends at its next block, leaving the partial file to resume."""
        files, commit = model
        stop = threading.Event()
        stop.set()
        partial = tmp_path / "part"
        file = HubFile("model.safetensors", len(files["model.safetensors"]))
        download(HubSettings(hub.endpoint), HubRef(REPO), commit, file, partial, stop=stop)
        assert partial.stat().st_size < file.size

    def test_token_is_read_from_its_file_and_never_in_the_error(self, hub, model, tmp_path):
        """A wrong token: 401 naming the token file setting, not the token; the right one works."""
        hub.token = "right"
        token_file = tmp_path / "token"
        token_file.write_text("wrong-secret\n")
        with pytest.raises(HubError) as caught:
            resolve(HubSettings(hub.endpoint, token_file), HubRef(REPO))
        assert caught.value.status == 401
        assert "--hub-token-file" in str(caught.value) and "wrong-secret" not in str(caught.value)
        token_file.write_text("right\n")
        assert resolve(HubSettings(hub.endpoint, token_file), HubRef(REPO)).commit == model[1]

    @pytest.mark.parametrize(
        ("fail", "ref", "words"),
        [
            (401, HubRef(REPO), "token is missing or wrong (none is set: give one with --hub-token-file"),
            (None, HubRef("acme/none"), "has no model repo acme/none (404)"),
            (None, HubRef(REPO, "v9"), "has no revision 'v9' in acme/tiny (404)"),
            (
                429,
                HubRef(REPO),
                "rate limited this node (429 Too Many Requests) for acme/tiny: retry after 30 s",
            ),
        ],
    )
    def test_hub_refusals_say_what_to_do(self, hub, model, fail, ref, words):
        """401, 404 (repo, revision) and 429 each become a reason an operator can act on."""
        hub.fail = fail
        with pytest.raises(HubError) as caught:
            resolve(HubSettings(hub.endpoint), ref)
        assert words in str(caught.value)
        assert caught.value.retry_after == (30 if fail == 429 else None)

    def test_an_unreadable_token_file_is_named(self, hub, model, tmp_path):
        """A token file that went missing: the reason names it and the flag."""
        with pytest.raises(HubError, match="cannot read the hub token file .* \\(--hub-token-file\\)"):
            resolve(HubSettings(hub.endpoint, tmp_path / "gone"), HubRef(REPO))
