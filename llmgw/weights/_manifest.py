"""A model's manifest: every file with its size and sha256, and the digest naming the whole."""

from __future__ import annotations

import hashlib
import os
import posixpath
from collections.abc import Callable
from pathlib import Path

import attrs

from llmgw.models import bounded

__all__ = ["MANIFEST_LIMIT", "Manifest", "ManifestFile", "compute_manifest", "file_sha256", "safe_relpath"]

#: the most files one manifest may list
MANIFEST_LIMIT = 10_000
_CHUNK = 1024 * 1024


def safe_relpath(path: str) -> bool:
    """Whether ``path`` is a relative POSIX path inside its root: no ``..``, ``.``, empty parts or NUL."""
    if not path or path.startswith("/") or "\\" in path or "\0" in path:
        return False
    parts = path.split("/")
    return all(part not in ("", ".", "..") for part in parts) and posixpath.normpath(path) == path


def _relpath(_: object, attribute: attrs.Attribute, value: str) -> None:
    if not safe_relpath(value) or len(value) > 1024:
        raise ValueError(f"{attribute.name}: expected a relative path inside the model, got {value!r}")


def _sha(_: object, attribute: attrs.Attribute, value: str) -> None:
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"{attribute.name}: expected 64 lowercase hex digits, got {value!r}")


def _size(_: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name}: expected bytes >= 0, got {value}")


@attrs.frozen
class ManifestFile:
    """One file of a model: its path under the model's directory, size and sha256 (hex)."""

    path: str = attrs.field(validator=_relpath)
    size: int = attrs.field(validator=_size)
    sha256: str = attrs.field(validator=_sha)


def _unique(instance: Manifest, attribute: attrs.Attribute, value: tuple[ManifestFile, ...]) -> None:
    paths = [f.path for f in value]
    if len(set(paths)) != len(paths):
        raise ValueError(f"{attribute.name}: a path is listed twice")
    if len(paths) > MANIFEST_LIMIT:
        limit = f"at most {MANIFEST_LIMIT} files (llmgw's limit)"
        raise ValueError(f"{attribute.name}: {limit}, got {len(paths)}")


@attrs.frozen
class Manifest:
    """What a model's copy must hold: made once by its first holder, kept by the server."""

    #: the catalog source it was made for (``seed:///data/llama``)
    source: str = attrs.field(validator=bounded())
    files: tuple[ManifestFile, ...] = attrs.field(converter=tuple, validator=_unique)
    #: the node that made it
    made_by: str = attrs.field(default="", validator=bounded(text=253))
    #: for an ``hf://`` source, the commit its files were downloaded at (the revision, pinned); else empty
    revision: str = attrs.field(default="", validator=bounded(text=64))

    @property
    def digest(self) -> str:
        """sha256 (hex) over every file's path, size and sha256: equal digests mean equal copies."""
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.path):
            h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
        return h.hexdigest()

    @property
    def total_bytes(self) -> int:
        """The size of a complete copy, in bytes."""
        return sum(f.size for f in self.files)

    def file(self, path: str) -> ManifestFile | None:
        """The entry for ``path``, or None when the manifest does not list it."""
        return next((f for f in self.files if f.path == path), None)


def file_sha256(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """The sha256 (hex) of a file's content, read in 1 MiB chunks; blocking (run it in a thread)."""
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            h.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return h.hexdigest()


def compute_manifest(root: Path, source: str, made_by: str = "") -> Manifest:
    """The manifest of every regular file under ``root`` (symlinks to files followed); blocking.

    Called by the agent of the first node holding a distributable source.
    Hidden llmgw bookkeeping (names starting ``.llmgw``) is left out.

    :raises OSError: ``root`` cannot be read.
    """
    files = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.startswith(".llmgw"):
                continue
            full = Path(directory) / name
            if not full.is_file():
                continue
            relative = full.relative_to(root).as_posix()
            files.append(ManifestFile(relative, full.stat().st_size, file_sha256(full)))
    return Manifest(source=source, files=tuple(files), made_by=made_by)
