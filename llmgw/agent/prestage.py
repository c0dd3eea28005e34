"""Staging weights with no shard of their own: sources copied ahead, and adapter copies held while loaded.

Two kinds of copy have no shard of their own:

- what the server asks in ``SyncReply.stage_sources``: a rollout to a new
  distributable source asks the nodes running the model's outdated replicas
  to copy the new weights first (while the old replicas go on serving), and
  every node running a shard of a model with LoRA adapters is asked for the
  model's distributable adapters (an adapter is small next to its base, and a
  first request for it then waits for the engine's load only). :meth:`PreStager.update`
  runs one task per source asked for, through the same ``stage`` the shards use
  (room is made first, progress goes to the log), at most :data:`AT_ONCE` at a
  time, and cancels it when the server stops asking (partial files stay, and
  are resumed or evicted later);
- an adapter a running replica has loaded: whoever loads it calls
  :meth:`PreStager.hold` (which stages it, as ``stage`` does, and returns its
  local path) and :meth:`PreStager.release` once it is unloaded or the replica
  is gone.

:attr:`PreStager.sources`, both kinds, are never evicted
(:func:`llmgw.agent.eviction.weights_in_use`); every other copy is evicted
least recently used first when room is needed, and ``stage`` marks a copy used.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

__all__ = ["AT_ONCE", "PreStager"]

log = logging.getLogger("llmgw.agent.weights")

#: seconds before a failed staging is tried again
RETRY = 5.0
#: sources the server asked for that are staged at once (hundreds of adapters wait their turn)
AT_ONCE = 4

Stage = Callable[[str, Callable[..., None]], Awaitable[str]]


class PreStager:
    """Copies the sources the server asks for ahead of any shard, and holds the adapters loaded here;
    see the module docstring."""

    def __init__(self, nursery: trio.Nursery, stage: Stage) -> None:
        self.nursery = nursery
        self.stage = stage
        #: source -> the cancel scope of its task
        self._tasks: dict[str, trio.CancelScope] = {}
        #: sources whose copy is complete here (nothing more to do while asked)
        self.done: set[str] = set()
        #: source -> who holds it (:meth:`hold`): a copy in use though no shard runs from it
        self._held: dict[str, set[str]] = {}
        self._limit = trio.CapacityLimiter(AT_ONCE)

    @property
    def sources(self) -> frozenset[str]:
        """The sources the server asks this node to stage now and those held: their copies are never
        evicted."""
        return frozenset(self._tasks) | frozenset(self._held)

    def update(self, sources: tuple[str, ...]) -> None:
        """Start staging each source newly asked for; stop those no longer asked. Called per sync answer."""
        wanted = set(sources)
        for source in list(self._tasks):
            if source not in wanted:
                self._tasks.pop(source).cancel()
                self.done.discard(source)
        for source in sorted(wanted - set(self._tasks)):
            scope = trio.CancelScope()
            self._tasks[source] = scope
            self.nursery.start_soon(self._run, source, scope)

    async def hold(self, source: str, holder: str, progress: Callable[..., None]) -> str:
        """A local path holding a verified copy of ``source``, kept (never evicted) until ``holder``
        releases it.

        Called by the agent before it asks a running replica to load a LoRA
        adapter (``holder``: the replica's id, or anything the caller releases
        by), with the adapter's catalog source; waits (reporting ``progress``)
        as a shard's staging does, and fetches nothing for a copy complete
        here. The hold starts before the copy is made: a copy being made is
        not evicted either. Cancelled, it holds nothing.

        :returns: the path to give the engine (the seed's folder on a seed's node, else the copy's).
        """
        self._held.setdefault(source, set()).add(holder)
        try:
            return await self.stage(source, progress)
        except BaseException:
            self.release(source, holder)
            raise

    def release(self, source: str, holder: str) -> None:
        """``holder`` no longer uses ``source``'s copy: evictable again (least recently used first) once
        nobody holds it and the server does not ask for it. Called when an adapter is unloaded or its
        replica stops; releasing what is not held does nothing."""
        holders = self._held.get(source)
        if holders is not None:
            holders.discard(holder)
            if not holders:
                del self._held[source]

    def release_all(self, holder: str) -> None:
        """Release every source ``holder`` holds (its replica is gone). Called by the agent."""
        for source in list(self._held):
            self.release(source, holder)

    async def _run(self, source: str, scope: trio.CancelScope) -> None:
        shown = [""]

        def progress(detail: str, staged: object = None) -> None:
            if detail.split(" (")[0] != shown[0]:
                shown[0] = detail.split(" (")[0]
                log.info("staging %s ahead of use: %s", source, detail)

        with scope:
            async with self._limit:
                while True:
                    try:
                        path = await self.stage(source, progress)
                    except Exception as exc:  # noqa: BLE001 - one failed copy must not end the agent
                        log.warning("staging %s ahead of use failed: %s; trying again", source, exc)
                        await trio.sleep(RETRY)
                        continue
                    log.info("staged %s ahead of use: %s", source, path)
                    self.done.add(source)
                    return
