"""Which catalog sources llmgw distributes, and how they are spelled."""

from __future__ import annotations

import posixpath
import re

import attrs

__all__ = [
    "HF_SCHEME",
    "SEED_SCHEME",
    "HubRef",
    "check_source",
    "hub_ref",
    "is_distributable",
    "seed_path",
]

#: a distributable path: ``seed:///data/llama`` is the directory ``/data/llama`` on whichever node has it
SEED_SCHEME = "seed://"
#: a model on a Hugging Face Hub: ``hf://ORG/NAME[@REVISION]``, fetched once per fleet, then node to node
HF_SCHEME = "hf://"

#: one part of a Hub repo id (the Hub's own rule: letters, digits, ``-``, ``_``, ``.``; 96 at most)
_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
#: a branch, tag or commit: git ref characters (``refs/pr/1`` has slashes)
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")


@attrs.frozen
class HubRef:
    """What an ``hf://`` source names: a model repo, and the revision asked for (None: the default branch)."""

    repo: str
    revision: str | None = None


def seed_path(source: str) -> str | None:
    """The directory a ``seed://`` source names (``seed:///data/m``: ``/data/m``); None for others."""
    if not source.startswith(SEED_SCHEME):
        return None
    return source[len(SEED_SCHEME) :]


def hub_ref(source: str) -> HubRef | None:
    """The repo and revision an ``hf://`` source names; None for other sources (and malformed ones)."""
    if not source.startswith(HF_SCHEME) or _hub_problem(source) is not None:
        return None
    repo, _, revision = source[len(HF_SCHEME) :].partition("@")
    return HubRef(repo, revision or None)


def is_distributable(source: str) -> bool:
    """Whether llmgw copies ``source`` between nodes (a node without it may still be chosen)."""
    return source.startswith(SEED_SCHEME) or source.startswith(HF_SCHEME)


def _hub_problem(source: str) -> str | None:
    expected = "expected hf://ORG/NAME or hf://ORG/NAME@REVISION (e.g. hf://Qwen/Qwen2.5-0.5B@main)"
    repo, at, revision = source[len(HF_SCHEME) :].partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_REPO_PART.match(p) for p in parts):
        return f"{expected}; ORG and NAME are letters, digits, '-', '_' and '.', got {source!r}"
    if any(".." in p or "--" in p or p.endswith((".", "-")) for p in parts):
        return f"{expected}; no '..' or '--' in ORG or NAME, nor '.' or '-' at their end, got {source!r}"
    if at and not (_REVISION.match(revision) and ".." not in revision and "//" not in revision):
        words = "a branch, tag or commit: letters, digits, '.', '_', '-' and '/'"
        return f"{expected}; REVISION is {words}, got {source!r}"
    return None


def check_source(source: str) -> str | None:
    """What is wrong with a catalog ``source``, in words for ``models.NAME.source: ...``; None when fine.

    Called by catalog validation (``ctl validate``, ``ctl apply`` and the server).
    """
    if not source.strip():
        return "expected a non-empty path or name"
    if source.startswith(HF_SCHEME):
        return _hub_problem(source)
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
        return (
            f"unknown source scheme {scheme}://; expected an absolute path, seed:///PATH, "
            "hf://ORG/NAME[@REVISION] or a hub name"
        )
    return None
