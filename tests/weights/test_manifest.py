"""Manifests, sources and a node's models directory: what makes a copy complete and verified."""

from __future__ import annotations

import os

import pytest

from llmgw.agent.models_dir import ModelsDir
from llmgw.weights import (
    HubRef,
    Manifest,
    ManifestFile,
    check_source,
    compute_manifest,
    hub_ref,
    is_distributable,
    seed_path,
)
from llmgw.wire import from_json, to_json


def make_model(root, files: dict[str, bytes]):
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


class TestSources:
    def test_seed_source_names_a_directory(self):
        """seed:///data/m is the distributable directory /data/m."""
        assert seed_path("seed:///data/m") == "/data/m"
        assert is_distributable("seed:///data/m")
        assert not is_distributable("/data/m") and seed_path("/data/m") is None

    @pytest.mark.parametrize(
        ("source", "words"),
        [
            ("seed://data/m", "expected seed:///ABSOLUTE/PATH"),
            ("seed:///", "expected seed:///ABSOLUTE/PATH"),
            ("seed:///data/../m", "without '.', '..' or empty parts"),
            ("seed:///data//m", "without '.', '..' or empty parts"),
            ("s3://bucket/m", "unknown source scheme s3://"),
            ("hf://gpt2", "expected hf://ORG/NAME or hf://ORG/NAME@REVISION"),
            ("hf://a/b/c", "expected hf://ORG/NAME or hf://ORG/NAME@REVISION"),
            ("hf://acme/m@", "REVISION is a branch, tag or commit"),
            ("hf://acme/m@a..b", "REVISION is a branch, tag or commit"),
            ("hf://acme/m o", "ORG and NAME are letters, digits"),
            ("hf://ac--me/m", "no '..' or '--' in ORG or NAME"),
            ("  ", "expected a non-empty path or name"),
        ],
    )
    def test_bad_sources_are_refused_with_what_was_expected(self, source, words):
        """A malformed source is refused, saying what a good one looks like."""
        problem = check_source(source)
        assert problem is not None and words in problem

    def test_hub_source_names_a_repo_and_revision(self):
        """hf://ORG/NAME[@REVISION]: distributable; the revision may be a branch, tag, commit or PR ref."""
        assert hub_ref("hf://Qwen/Qwen2.5-0.5B") == HubRef("Qwen/Qwen2.5-0.5B", None)
        assert hub_ref("hf://acme/m@refs/pr/1") == HubRef("acme/m", "refs/pr/1")
        assert is_distributable("hf://acme/m@main") and hub_ref("seed:///m") is None

    @pytest.mark.parametrize(
        "source", ["seed:///data/m", "/models/x", "meta-llama/Llama-3.1-8B", "hf://acme/m.v2@0123abcd"]
    )
    def test_good_sources_pass(self, source):
        """Paths, seeds and hub names are accepted."""
        assert check_source(source) is None

    def test_catalog_names_the_field_of_a_bad_hub_source(self):
        """ctl validate names models.NAME.source and the expected spelling for a bad hf:// source."""
        from llmgw.catalog import parse_catalog
        from llmgw.errors import CatalogError
        from llmgw.plugins import get_plugin_manager

        engines = {name: r.engine for name, r in get_plugin_manager().engines().items()}
        text = "profiles: {one: {engine: sim}}\nmodels: {m: {source: 'hf://gpt2', profile: one}}\n"
        with pytest.raises(CatalogError) as caught:
            parse_catalog(text, engines)
        assert any("models.m.source" in p and "hf://ORG/NAME" in p for p in caught.value.problems)

    def test_catalog_names_the_field(self):
        """ctl validate names models.NAME.source for a bad seed source."""
        from llmgw.catalog import parse_catalog
        from llmgw.errors import CatalogError
        from llmgw.plugins import get_plugin_manager

        engines = {name: r.engine for name, r in get_plugin_manager().engines().items()}
        text = "profiles: {one: {engine: sim}}\nmodels: {m: {source: 'seed://data/m', profile: one}}\n"
        with pytest.raises(CatalogError) as caught:
            parse_catalog(text, engines)
        assert any(
            p.startswith("models.m.source: expected seed:///ABSOLUTE/PATH") for p in caught.value.problems
        )


class TestManifest:
    def test_lists_every_file_with_size_and_sha256(self, tmp_path):
        """The manifest lists each file (nested too) with its size and sha256, and nothing hidden by llmgw."""
        root = make_model(tmp_path / "m", {"a.bin": b"x" * 10, "sub/b.json": b"{}", ".llmgw-x": b"no"})
        manifest = compute_manifest(root, "seed:///m", made_by="node-1")
        assert [(f.path, f.size) for f in manifest.files] == [("a.bin", 10), ("sub/b.json", 2)]
        assert manifest.files[1].sha256 == "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        assert manifest.total_bytes == 12

    def test_digest_changes_with_any_byte(self, tmp_path):
        """Two copies with one byte apart have different digests; equal files, equal digests."""
        one = compute_manifest(make_model(tmp_path / "1", {"a": b"abc"}), "seed:///m")
        same = compute_manifest(make_model(tmp_path / "2", {"a": b"abc"}), "seed:///m")
        other = compute_manifest(make_model(tmp_path / "3", {"a": b"abd"}), "seed:///m")
        assert one.digest == same.digest != other.digest

    def test_round_trips_the_wire_and_refuses_escaping_paths(self):
        """A manifest crosses the wire unchanged; a path leaving the model's directory is refused."""
        manifest = Manifest("seed:///m", [ManifestFile("a", 1, "0" * 64)], made_by="node-1")
        assert from_json(to_json(manifest), Manifest) == manifest
        for bad in ("../etc/passwd", "/etc/passwd", "a/./b", "a//b"):
            with pytest.raises(ValueError, match="expected a relative path inside the model"):
                ManifestFile(bad, 1, "0" * 64)


class TestModelsDir:
    def test_a_copy_is_complete_once_every_file_is_verified(self, tmp_path):
        """Files verified one by one: partial bytes count as present; all verified makes it complete."""
        seed = make_model(tmp_path / "seed", {"a": b"a" * 100, "b": b"b" * 50})
        manifest = compute_manifest(seed, "seed:///seed")
        models = ModelsDir(tmp_path / "models")
        models.begin(manifest)
        copy = models.copy_dir(manifest.digest)
        (copy / "a").write_bytes(b"a" * 100)
        models.mark_verified(manifest, ["a"])
        models.partial(manifest.digest, manifest.file("b")).write_bytes(b"b" * 20)
        [partial] = models.copies()
        assert (partial.bytes_present, partial.bytes_total, partial.complete) == (120, 150, False)
        (copy / "b").write_bytes(b"b" * 50)
        models.partial(manifest.digest, manifest.file("b")).unlink()
        models.mark_verified(manifest, ["b"])
        [complete] = models.copies()
        assert (complete.bytes_present, complete.complete, complete.source) == (150, True, "seed:///seed")
        assert models.complete_copy("seed:///seed") == manifest

    def test_a_changed_file_is_no_longer_trusted(self, tmp_path):
        """A byte written into a verified file (its mtime moves) makes the copy incomplete until checked."""
        seed = make_model(tmp_path / "seed", {"a": b"a" * 100})
        manifest = compute_manifest(seed, "seed:///seed")
        models = ModelsDir(tmp_path / "models")
        models.begin(manifest)
        target = models.copy_dir(manifest.digest) / "a"
        target.write_bytes(b"a" * 100)
        models.mark_verified(manifest, ["a"])
        assert models.trusted(manifest, manifest.files[0])
        with open(target, "r+b") as handle:
            handle.seek(50)
            handle.write(b"X")
        os.utime(target, ns=(1, 1))  # a different mtime, whatever the clock's resolution
        assert not models.trusted(manifest, manifest.files[0])
        assert not models.copies()[0].complete

    def test_seed_manifest_is_made_once_and_again_after_a_change(self, tmp_path):
        """The seed's manifest is cached with its files' stats, and made again when a file changes."""
        seed = make_model(tmp_path / "seed", {"a": b"1"})
        models = ModelsDir(tmp_path / "models")
        source = f"seed://{seed}"
        first = models.seed_manifest(source, "node-1")
        assert first is not None and first.made_by == "node-1"
        assert models.seed_manifest(source, "node-1") == first
        (seed / "a").write_bytes(b"22")
        assert models.seed_manifest(source, "node-1").digest != first.digest
        assert models.seed_manifest(f"seed://{tmp_path}/absent", "node-1") is None
