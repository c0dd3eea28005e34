"""The admin API's catalog documents: applying one, a diff before applying, the stored revisions and authors.

Re-exported by :mod:`llmgw.wire`; read and written through its one converter.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from llmgw.models import bounded

__all__ = [
    "CatalogText", "ApplyCatalog", "CatalogApplied", "CatalogChange", "CatalogDiff", "CatalogRevision",
    "CatalogHistory",
]  # fmt: skip


@attrs.frozen
class CatalogChange:
    """One model or profile that a catalog adds, removes or changes, and what that does to replicas."""

    #: ``model`` or ``profile``
    section: str
    name: str
    #: ``added``, ``removed`` or ``changed``
    change: str
    #: one line per field that changed: ``replicas: 2 -> 3``, ``profile tp8x2: args: [] -> [--x]``
    fields: tuple[str, ...] = ()
    #: replicas to place (a model only)
    add: int = 0
    #: replicas to stop (a model only)
    stop: int = 0
    #: running replicas whose command changes: they run the old one until replaced
    outdated: int = 0


@attrs.frozen
class CatalogDiff:
    """``POST /v1/admin/catalog/diff``: what applying a catalog would change, against the stored one."""

    #: the stored revision compared against (0: none stored yet)
    revision: int
    changes: tuple[CatalogChange, ...] = ()

    @property
    def removed_models(self) -> tuple[str, ...]:
        """The models the new catalog no longer has (``ctl apply`` wants ``--prune`` for these)."""
        return tuple(c.name for c in self.changes if c.section == "model" and c.change == "removed")


@attrs.frozen
class CatalogRevision:
    """One stored catalog revision in ``GET /v1/admin/catalog/history``."""

    revision: int
    applied_at: float
    #: the name in the admin certificate that applied it ("" before llmgw recorded authors)
    author: str = ""


@attrs.frozen
class CatalogHistory:
    """``GET /v1/admin/catalog/history``: every stored revision, oldest first."""

    revisions: tuple[CatalogRevision, ...] = ()


@attrs.frozen
class CatalogText:
    """``GET /v1/admin/catalog[?revision=N]``: the catalog in force (or revision N), as it was applied."""

    revision: int
    text: str
    applied_at: float = 0.0
    #: the admin certificate's name that applied it
    author: str = ""


@attrs.frozen
class ApplyCatalog:
    """``POST /v1/admin/catalog`` (and ``.../catalog/diff``): the catalog's YAML and its name (for errors)."""

    text: str
    name: str = attrs.field(default="catalog", validator=bounded())
    #: remove the models the catalog no longer has; without it such a catalog is refused
    prune: bool = False


@attrs.frozen
class CatalogApplied:
    """The answer to :class:`ApplyCatalog`: the new revision, a one-line summary, and what changed."""

    revision: int
    summary: str
    diff: CatalogDiff | None = None
    #: model -> replicas the new revision asks for (what ``ctl apply --wait`` waits for)
    wanted: Mapping[str, int] = attrs.field(factory=dict)
