"""Which catalog sources llmgw distributes, and how they are spelled."""

from __future__ import annotations

import posixpath

__all__ = ["SEED_SCHEME", "check_source", "is_distributable", "seed_path"]

#: a distributable path: ``seed:///data/llama`` is the directory ``/data/llama`` on whichever node has it
SEED_SCHEME = "seed://"


def seed_path(source: str) -> str | None:
    """The directory a ``seed://`` source names (``seed:///data/m``: ``/data/m``); None for others."""
    if not source.startswith(SEED_SCHEME):
        return None
    return source[len(SEED_SCHEME) :]


def is_distributable(source: str) -> bool:
    """Whether llmgw copies ``source`` between nodes (a node without it may still be chosen)."""
    return source.startswith(SEED_SCHEME)


def check_source(source: str) -> str | None:
    """What is wrong with a catalog ``source``, in words for ``models.NAME.source: ...``; None when fine.

    Called by catalog validation (``ctl validate``, ``ctl apply`` and the server).
    """
    if not source.strip():
        return "expected a non-empty path or name"
    path = seed_path(source)
    if path is not None:
        expected = (
            "expected seed:///ABSOLUTE/PATH (seed:// then an absolute directory, e.g. seed:///data/llama)"
        )
        if not path.startswith("/"):
            return f"{expected}, got {source!r}"
        if path.rstrip("/") in ("", "/") or posixpath.normpath(path) != path.rstrip("/") or "//" in path:
            return f"{expected} without '.', '..' or empty parts, got {source!r}"
        return None
    scheme, sep, _ = source.partition("://")
    if sep and scheme.isalnum():
        return f"unknown source scheme {scheme}://; expected an absolute path, seed:///PATH or a hub name"
    return None
