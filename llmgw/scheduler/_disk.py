"""Disk room for model weights on one node during one :func:`~llmgw.scheduler.schedule` run.

A node may be chosen for a replica of a distributable source it does not
hold only when its models directory's filesystem can take the copy: its free
bytes, plus the bytes of copies it could evict, must cover what the copy
still lacks plus a headroom (a fraction of the model's size).

A copy can be evicted (least recently used first, by the node's agent, when
it needs the room) unless a replica placed on the node uses its source (what
the replica runs, or what the catalog asks its model to run: a rollout
stages that first), the source is being copied to some node (holders serve
the copy), or it is a seed (never moved).
"""

from __future__ import annotations

from copy import copy as shallow_copy

from llmgw.models import NodeFacts

__all__ = ["DEFAULT_HEADROOM", "DiskRoom", "format_bytes"]

#: the share of a model's size a node must have free beyond the copy itself
DEFAULT_HEADROOM = 0.05


def format_bytes(count: int) -> str:
    """``4.2 GB``, ``48 MB``, ``900 kB``: decimal units, as ``df -H`` prints them."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= size:
            digits = 1 if abs(count) < 10 * size else 0
            return f"{count / size:.{digits}f} {unit}"
    return f"{count} B"


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
