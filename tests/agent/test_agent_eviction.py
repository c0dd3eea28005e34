"""Eviction: unused copies go least recently used first to make room for a copy; a copy in use never goes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from llmgw.agent.eviction import RoomMaker, choose_evictions
from llmgw.agent.models_dir import ModelsDir
from llmgw.agent.peer_files import PeerFiles
from llmgw.models import ModelCopy
from llmgw.weights import Manifest, compute_manifest

MB = 10**6


def copy(name: str, size: int, last_used: float, *, seed: bool = False) -> ModelCopy:
    return ModelCopy(name * 64, f"seed:///{name}", size, size, True, last_used, seed)


def wanted(size: int) -> Manifest:
    from llmgw.weights import ManifestFile

    return Manifest("seed:///new", (ManifestFile("w.bin", size, "f" * 64),))


class TestChooseEvictions:
    """The pure choice of victims."""

    def test_least_recently_used_first_and_no_more_than_needed(self):
        """Never-used goes first, then the oldest; the newest stays once there is room."""
        copies = [copy("a", 30 * MB, 300.0), copy("b", 30 * MB, 0.0), copy("c", 30 * MB, 100.0)]
        plan = choose_evictions(copies, 10 * MB, wanted(60 * MB), lambda c: False, headroom=0.0)
        assert [v.source for v in plan.victims] == ["seed:///b", "seed:///c"] and plan.enough

    def test_in_use_copies_and_seeds_are_never_chosen(self):
        """Only the unused, non-seed copy goes; it is not enough, and the plan says so."""
        copies = [copy("a", 30 * MB, 0.0), copy("b", 30 * MB, 0.0, seed=True), copy("c", 30 * MB, 1.0)]
        plan = choose_evictions(copies, 10 * MB, wanted(60 * MB), lambda c: c.source == "seed:///a", 0.0)
        assert [v.source for v in plan.victims] == ["seed:///c"] and not plan.enough

    def test_enough_free_evicts_nothing(self):
        """Room for the copy plus its 5% headroom: nothing goes."""
        plan = choose_evictions([copy("a", 30 * MB, 0.0)], 64 * MB, wanted(60 * MB), lambda c: False)
        assert plan.victims == () and plan.enough


def make_copy(models: ModelsDir, tmp_path: Path, name: str, size: int) -> Manifest:
    """A verified copy of ``size`` random bytes in the models directory."""
    source_dir = tmp_path / "src" / name
    source_dir.mkdir(parents=True)
    (source_dir / "w.bin").write_bytes(os.urandom(size))
    manifest = compute_manifest(source_dir, f"seed:///{name}")
    models.begin(manifest)
    os.replace(source_dir / "w.bin", models.copy_dir(manifest.digest) / "w.bin")
    models.mark_verified(manifest, ["w.bin"])
    return manifest


@pytest.mark.trio
async def test_room_maker_evicts_unused_copies_lru_and_never_one_in_use(tmp_path, monkeypatch):
    """A 10 MB disk with three 3 MB copies: making room for 5 MB evicts the never-used copy, then the older
    used one; the copy a shard runs stays though it is the least recently used; each eviction is reported."""
    models = ModelsDir(tmp_path / "models")
    models.prepare()
    old, never, running = (make_copy(models, tmp_path, name, 3 * MB) for name in ("old", "never", "running"))
    models.touch(old.digest)
    # the filesystem's edge: 10 MB in all, what the models directory holds is used
    capacity = 10 * MB
    monkeypatch.setattr(
        models, "free_bytes", lambda: capacity - sum(p.stat().st_size for p in models.root.rglob("*.bin"))
    )
    # the running copy was last used long ago (least recently used of the two used ones)
    models._save(running, models.load(running.digest)[1], 1.0)
    reports: list[tuple[str, str]] = []
    refreshed = []

    async def report(source: str, message: str) -> None:
        reports.append((source, message))

    async def changed() -> None:
        refreshed.append(True)

    room = RoomMaker(
        models,
        PeerFiles(models),
        server="https://127.0.0.1:1",
        server_context=lambda: None,
        in_use=lambda: ({"seed:///running"}, set()),
        report=report,
        copies_changed=changed,
        node="node-1",
    )
    target = wanted(5 * MB)

    async def manifest(source: str) -> Manifest:
        return target

    monkeypatch.setattr(room, "_manifest", manifest)
    with trio.fail_after(10):
        await room.make_room("seed:///new", lambda *args: None)
    left = {c.source for c in models.copies()}
    assert left == {"seed:///running"}, "never-used, then least recently used; the running copy stays"
    assert not models.copy_dir(never.digest).exists() and not models.copy_dir(old.digest).exists()
    assert [source for source, _ in reports] == ["seed:///never", "seed:///old"]
    assert (
        "evicted from node-1 (3.0 MB, never used, least recently used) to make room for seed:///new"
        in (reports[0][1])
    )
    assert refreshed, "the facts are refreshed after evicting"


@pytest.mark.trio
async def test_room_maker_waits_while_every_copy_is_in_use(tmp_path, monkeypatch):
    """No copy can go: the shard says it waits for disk room, and goes on once room appears."""
    models = ModelsDir(tmp_path / "models")
    models.prepare()
    free = [1 * MB]
    monkeypatch.setattr(models, "free_bytes", lambda: free[0])
    monkeypatch.setattr("llmgw.agent.eviction.ROOM_RETRY", 0.01)

    async def nothing(*args) -> None:
        return None

    room = RoomMaker(
        models,
        PeerFiles(models),
        server="https://127.0.0.1:1",
        server_context=lambda: None,
        in_use=lambda: (set(), set()),
        report=nothing,
        copies_changed=nothing,
        node="node-1",
    )

    async def manifest(source: str) -> Manifest:
        return wanted(5 * MB)

    monkeypatch.setattr(room, "_manifest", manifest)
    lines: list[str] = []
    said = trio.Event()

    def progress(line: str, *rest: object) -> None:
        lines.append(line)
        said.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(room.make_room, "seed:///new", progress)
        with trio.fail_after(5):
            await said.wait()
        free[0] = 6 * MB
    assert lines[0] == (
        "waiting for disk room: the copy needs 5.0 MB more, 1.0 MB free, and the other copies here are in use"
    )


@pytest.mark.trio
async def test_a_source_llmgw_does_not_copy_is_given_as_it_is(tmp_path):
    """A path on the node (an adapter's, say) is neither made room for nor staged: it is the path to load."""
    models = ModelsDir(tmp_path / "models")
    asked: list[str] = []

    async def nothing(*args) -> None:
        return None

    async def stage(source: str, progress) -> str:
        asked.append(source)
        return "/models/copy"

    room = RoomMaker(
        models, PeerFiles(models), server="https://127.0.0.1:1", server_context=lambda: None,
        in_use=lambda: (set(), set()), report=nothing, copies_changed=nothing, node="node-1",
    )  # fmt: skip
    with trio.fail_after(5):
        assert await room.wrap(stage)("/loras/sql", lambda *args: None) == "/loras/sql"
    assert asked == []
