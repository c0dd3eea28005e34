"""A node's models directory (``llmgw agent --models-dir``): copies of distributable models.

Layout under the directory::

    <digest>/                      one copy: the model's files as its manifest lists them
    <digest>/<file>.llmgw-partial  a file being fetched (resumed from its size)
    .llmgw/<digest>.json           the copy's manifest, which files were verified, when it was last used
    .llmgw/seed-<hash>.json        a seed directory's manifest, with the file stats it was made from

A file counts as verified while its size and mtime are those recorded when
its sha256 matched the manifest; a file changed since (a flipped byte) is
hashed again before a shard uses the copy, and fetched again on a mismatch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from llmgw.models import ModelCopy
from llmgw.weights import Manifest, ManifestFile, compute_manifest, seed_path
from llmgw.wire import from_json, to_json

__all__ = ["ModelsDir", "PARTIAL_SUFFIX", "seed_has_files"]

log = logging.getLogger("llmgw.agent")

PARTIAL_SUFFIX = ".llmgw-partial"


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return (info.st_size, info.st_mtime_ns)


def _write_atomic(path: Path, data: dict) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, separators=(",", ":")))
    os.replace(temporary, path)


class ModelsDir:
    """One node's models directory; every method is blocking (call it from a worker thread)."""

    def __init__(self, root: Path, seed_root: Path = Path("/")) -> None:
        """:param seed_root: what stands for ``/`` when a ``seed:///PATH`` is looked up on this node."""
        self.root = root
        self.meta = root / ".llmgw"
        self.seed_root = seed_root
        #: digest -> (the state file's inode, size and mtime when read, what it held)
        self._loaded: dict[str, tuple[tuple[int, ...], tuple[Manifest, dict[str, list[int]], float]]] = {}

    def seed_dir(self, source: str) -> Path | None:
        """Where the seed ``source`` names is on this node (it may not exist); None for other sources."""
        path = seed_path(source)
        return None if path is None else self.seed_root / path.lstrip("/")

    def prepare(self) -> str | None:
        """Make the directory if missing; the problem (for ``ctl nodes``), or None."""
        try:
            self.meta.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"models dir {self.root}: cannot create it: {exc.strerror or exc}"
        return None

    def free_bytes(self) -> int | None:
        """Free bytes of the filesystem holding the directory, or None when it cannot be read."""
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return None

    # -- copies ------------------------------------------------------------------------------------

    def copy_dir(self, digest: str) -> Path:
        """Where the copy with manifest ``digest`` lives (what the engine is given)."""
        return self.root / digest

    def _state_path(self, digest: str) -> Path:
        return self.meta / f"{digest}.json"

    def load(self, digest: str) -> tuple[Manifest, dict[str, list[int]], float] | None:
        """(manifest, verified path -> [size, mtime_ns], last used) of a copy, or None when there is none.

        Read once per change of the state file (a copy of thousands of files is checked file by file).
        """
        path = self._state_path(digest)
        try:
            info = path.stat()
            stamp: tuple[int, ...] | None = (info.st_ino, info.st_size, info.st_mtime_ns)
        except OSError:
            stamp = None
        cached = self._loaded.get(digest)
        if cached is not None and stamp is not None and cached[0] == stamp:
            manifest, verified, last_used = cached[1]
            return manifest, dict(verified), last_used
        try:
            data = json.loads(path.read_text())
            manifest = from_json(data["manifest"], Manifest)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        loaded = (manifest, dict(data.get("verified", {})), float(data.get("last_used", 0.0)))
        if stamp is not None:
            self._loaded[digest] = (stamp, loaded)
        return loaded[0], dict(loaded[1]), loaded[2]

    def begin(self, manifest: Manifest) -> None:
        """Record that a copy of ``manifest`` is being made (keeps what was verified before)."""
        known = self.load(manifest.digest)
        verified, last_used = (known[1], known[2]) if known else ({}, 0.0)
        self.copy_dir(manifest.digest).mkdir(parents=True, exist_ok=True)
        self._save(manifest, verified, last_used)

    def _save(self, manifest: Manifest, verified: dict[str, list[int]], last_used: float) -> None:
        self.meta.mkdir(parents=True, exist_ok=True)
        data = {"manifest": to_json(manifest), "verified": verified, "last_used": last_used}
        _write_atomic(self._state_path(manifest.digest), data)

    def mark_verified(self, manifest: Manifest, paths: Iterable[str]) -> None:
        """Record files of a copy whose sha256 matched, with their size and mtime now."""
        known = self.load(manifest.digest)
        verified, last_used = (known[1], known[2]) if known else ({}, 0.0)
        for path in paths:
            stat = _stat(self.copy_dir(manifest.digest) / path)
            if stat is not None:
                verified[path] = list(stat)
        self._save(manifest, verified, last_used)

    def forget_verified(self, manifest: Manifest, path: str) -> None:
        """A file of a copy failed verification: it is no longer counted as present."""
        known = self.load(manifest.digest)
        if known is not None and path in known[1]:
            del known[1][path]
            self._save(manifest, known[1], known[2])

    def touch(self, digest: str) -> None:
        """A shard starts on this copy: it was used now."""
        known = self.load(digest)
        if known is not None:
            self._save(known[0], known[1], time.time())

    def trusted(self, manifest: Manifest, file: ManifestFile) -> bool:
        """Whether a file of a copy is verified and unchanged since (same size and mtime)."""
        known = self.load(manifest.digest)
        if known is None or file.path not in known[1]:
            return False
        stat = _stat(self.copy_dir(manifest.digest) / file.path)
        return stat is not None and list(stat) == known[1][file.path] and stat[0] == file.size

    def partial(self, digest: str, file: ManifestFile) -> Path:
        """Where ``file`` is written while it is fetched."""
        return self.copy_dir(digest) / (file.path + PARTIAL_SUFFIX)

    def copies(self) -> list[ModelCopy]:
        """Every copy in the directory, as the agent reports it in its facts."""
        out = []
        for state in sorted(self.meta.glob("*.json")) if self.meta.is_dir() else ():
            if state.name.startswith("seed-"):
                continue
            known = self.load(state.stem)
            if known is None:
                continue
            manifest, verified, last_used = known
            present, complete = 0, True
            directory = self.copy_dir(manifest.digest)
            for file in manifest.files:
                stat = _stat(directory / file.path)
                if stat is not None and list(stat) == verified.get(file.path):
                    present += file.size
                    continue
                complete = False
                partial = _stat(directory / (file.path + PARTIAL_SUFFIX))
                present += min(partial[0], file.size) if partial else 0
            out.append(
                ModelCopy(
                    digest=manifest.digest,
                    source=manifest.source,
                    bytes_present=present,
                    bytes_total=manifest.total_bytes,
                    complete=complete,
                    last_used=last_used,
                )
            )
        return out

    def remove(self, digest: str) -> None:
        """Delete the copy ``digest`` (evicted): its state file first, so it is never reported half gone."""
        self._state_path(digest).unlink(missing_ok=True)
        self._loaded.pop(digest, None)
        shutil.rmtree(self.copy_dir(digest), ignore_errors=True)

    def complete_copy(self, source: str) -> Manifest | None:
        """The manifest of a complete copy of ``source`` here, or None."""
        for copy in self.copies():
            if copy.source == source and copy.complete:
                known = self.load(copy.digest)
                return known[0] if known else None
        return None

    # -- seeds -------------------------------------------------------------------------------------

    def _seed_cache(self, source: str) -> Path:
        return self.meta / f"seed-{hashlib.sha256(source.encode()).hexdigest()[:32]}.json"

    def seed_copies(self, sources: Iterable[str]) -> list[ModelCopy]:
        """The seeds among ``sources`` on this node whose manifest was made from the files there now, as
        copies (never hashes: a seed changed since, emptied or half written, is no copy until hashed)."""
        out = []
        for source in sources:
            root = self.seed_dir(source)
            if root is None or not root.is_dir():
                continue
            try:
                data = json.loads(self._seed_cache(source).read_text())
                manifest = from_json(data["manifest"], Manifest)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if not manifest.files or data.get("stats") != _tree_stats(root):
                continue
            size = manifest.total_bytes
            out.append(ModelCopy(manifest.digest, source, size, size, complete=True, seed=True))
        return out

    def seed_manifest(self, source: str, node: str) -> Manifest | None:
        """The manifest of the seed directory ``source`` names on this node, or None when it is not here
        (or holds no file).

        Hashing every file takes a while: the manifest is kept with the stats
        of the files it was made from, and made again only when one changed.
        """
        root = self.seed_dir(source)
        if root is None or not root.is_dir():
            return None
        stats = _tree_stats(root)
        if not stats:
            return None  # an empty folder is no copy: never a manifest of no files
        cache = self._seed_cache(source)
        try:
            data = json.loads(cache.read_text())
            if data["stats"] == stats:
                return from_json(data["manifest"], Manifest)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        started = time.monotonic()
        manifest = compute_manifest(root, source, made_by=node)
        log.info(
            "seed %s: manifest of %d files, %.1f MB made in %.1f s (digest %s)",
            source, len(manifest.files), manifest.total_bytes / 1e6, time.monotonic() - started,
            manifest.digest[:12],
        )  # fmt: skip
        if self.prepare() is None:
            _write_atomic(cache, {"stats": _tree_stats(root), "manifest": to_json(manifest)})
        return manifest


def seed_has_files(root: Path) -> bool:
    """Whether the seed folder ``root`` holds any file (an empty one is no copy); stops at the first."""
    for _, _, filenames in os.walk(root):
        if any(not name.startswith(".llmgw") for name in filenames):
            return True
    return False


def _tree_stats(root: Path) -> dict[str, list[int]]:
    """path -> [size, mtime_ns] of every file under ``root`` (what a seed manifest was made from)."""
    stats = {}
    for directory, _, filenames in os.walk(root):
        for name in filenames:
            if name.startswith(".llmgw"):
                continue
            full = Path(directory) / name
            stat = _stat(full)
            if stat is not None:
                stats[full.relative_to(root).as_posix()] = list(stat)
    return stats
