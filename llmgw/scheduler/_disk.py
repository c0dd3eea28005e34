"""Disk room for model weights on one node during one :func:`~llmgw.scheduler.schedule` run.

A node may be chosen for a replica of a distributable source it does not
hold only when its models directory's filesystem can take the copy: its free
bytes, plus the bytes of copies it could evict, must cover what the copy
still lacks plus a headroom (a fraction of the model's size).

A replica of a model with LoRA adapters takes their distributable sources
too: every node running one stages them all (ahead of any load, or before
an engine that loads them only at start starts), so its room is checked and
used for the weights and every adapter together (:func:`needs_of`).

A copy can be evicted (least recently used first, by the node's agent, when
it needs the room) unless a replica placed on the node uses its source (what
the replica runs, or what the catalog asks its model to run: a rollout
stages that first), the source is being copied to some node (holders serve
the copy), or it is a seed (never moved).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from copy import copy as shallow_copy

from llmgw.models import Model, NodeFacts
from llmgw.weights import is_distributable

__all__ = ["DEFAULT_HEADROOM", "DiskRoom", "Need", "format_bytes", "needs_of"]

#: (source, bytes of a complete copy, or None: not copied, or not known yet)
Need = tuple[str, int | None]

#: the share of a model's size a node must have free beyond the copy itself
DEFAULT_HEADROOM = 0.05


def format_bytes(count: int) -> str:
    """``4.2 GB``, ``48 MB``, ``900 kB``: decimal units, as ``df -H`` prints them."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= size:
            digits = 1 if abs(count) < 10 * size else 0
            return f"{count / size:.{digits}f} {unit}"
    return f"{count} B"


def needs_of(model: Model, sizes: Mapping[str, int], source: str | None = None) -> tuple[Need, ...]:
    """What a replica of ``model`` takes on each of its nodes: its weights (``source``, by default the
    model's), then each of its adapters' distributable sources, each with its size (None for a source that
    is not copied, or whose size is not known yet). Called by the scheduler for each model it places."""
    weights = source if source is not None else model.source
    needs: list[Need] = [(weights, sizes.get(weights) if is_distributable(weights) else None)]
    for adapter in model.adapters.values():
        if is_distributable(adapter) and adapter != weights:
            needs.append((adapter, sizes.get(adapter)))
    return tuple(needs)


def needed_bytes(needs: Iterable[Need]) -> int:
    """The bytes of ``needs`` whose size is known (for messages)."""
    return sum(size or 0 for _, size in needs)


class DiskRoom:
    """What one node's models directory can still take; see the module docstring.

    Mutable and private to one run: every replica placed on the node (kept or
    new) :meth:`use`\\ s its source, which pins that source's copies and
    reserves what the copy still lacks.
    """

    __slots__ = ("free", "held", "present", "evictable", "room", "used", "reserved")

    def __init__(self, facts: NodeFacts, copying: frozenset[str] = frozenset()) -> None:
        """:param copying: sources being copied to some node now: their copies here are not evictable."""
        #: free bytes of the models directory's filesystem; None: not known (no check)
        self.free = facts.models_free_bytes
        #: sources with a complete copy (or the seed) here
        self.held: set[str] = set(facts.model_sources)
        #: source -> bytes present in its most complete copy here
        self.present: dict[str, int] = {}
        #: source -> bytes of its copies here that could be evicted (not pinned yet)
        self.evictable: dict[str, int] = {}
        for copy in facts.model_copies:
            if copy.complete:
                self.held.add(copy.source)
            if copy.seed:
                continue
            self.present[copy.source] = max(self.present.get(copy.source, 0), copy.bytes_present)
            self.evictable[copy.source] = self.evictable.get(copy.source, 0) + copy.bytes_present
        for source in copying:
            self.evictable.pop(source, None)
        self.room = (self.free or 0) + sum(self.evictable.values())
        self.used: set[str] = set()
        #: bytes copies under way here still lack (they will take them)
        self.reserved = 0

    def copy(self) -> DiskRoom:
        """A copy that changes apart from this one (a trial placement's)."""
        other = shallow_copy(self)
        other.held, other.used = set(self.held), set(self.used)
        other.present, other.evictable = dict(self.present), dict(self.evictable)
        return other

    @property
    def unused_bytes(self) -> int:
        """Bytes in copies this node could evict now."""
        return sum(self.evictable.values())

    def fits(self, source: str, size: int | None, headroom: float) -> bool:
        """Whether a replica of ``source`` (``size`` bytes; None: not known yet) may be placed here.

        True when the free bytes are not known, the size is not known, or
        ``source`` is used here already; else the room left once the copy's
        missing bytes and ``headroom`` × ``size`` are taken must not be negative.
        """
        if self.free is None or size is None or source in self.used:
            return True
        return self.room - self._cost(source, size) - (0 if source in self.held else headroom * size) >= 0

    def fits_all(self, needs: Iterable[Need], headroom: float) -> bool:
        """Whether a replica needing every source of ``needs`` (:func:`needs_of`) may be placed here: as
        :meth:`fits`, with the room each source takes (and its headroom) summed."""
        if self.free is None:
            return True
        taken = 0.0
        for source, size in dict(needs).items():
            if size is None or source in self.used:
                continue
            taken += self._cost(source, size) + (0 if source in self.held else headroom * size)
        return self.room - taken >= 0

    def use_all(self, needs: Iterable[Need]) -> None:
        """A replica placed here uses every source of ``needs`` (see :meth:`use`)."""
        for source, size in needs:
            self.use(source, size)

    def _cost(self, source: str, size: int) -> int:
        """Room a use of ``source`` takes: its copies' bytes stop being evictable, the rest is fetched."""
        missing = 0 if source in self.held else max(0, size - self.present.get(source, 0))
        return self.evictable.get(source, 0) + missing

    def use(self, source: str, size: int | None) -> None:
        """A replica placed here uses ``source``: pin its copies, reserve what the copy lacks."""
        if source in self.used:
            return
        self.used.add(source)
        pinned = self.evictable.pop(source, 0)
        self.room -= pinned
        if size is not None and source not in self.held:
            missing = max(0, size - self.present.get(source, 0))
            self.reserved += missing
            self.room -= missing
