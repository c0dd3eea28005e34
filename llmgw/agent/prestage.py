"""Staging weights with no shard yet: what the server asks in ``SyncReply.stage_sources``.

A rollout to a new distributable source asks the nodes running the model's
outdated replicas to copy the new weights first (while the old replicas go
on serving), so a replica restarted in place, or a replacement placed there,
starts without waiting for the copy. :class:`PreStager` runs one task per
source asked for, through the same ``stage`` the shards use (room is made
first, progress goes to the log), and cancels it when the server stops
asking (partial files stay, and are resumed or evicted later).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

__all__ = ["PreStager"]

log = logging.getLogger("llmgw.agent.weights")

#: seconds before a failed staging is tried again
RETRY = 5.0

Stage = Callable[[str, Callable[..., None]], Awaitable[str]]


class PreStager:
    """Copies the sources the server asks for ahead of any shard; see the module docstring."""

    def __init__(self, nursery: trio.Nursery, stage: Stage) -> None:
        self.nursery = nursery
        self.stage = stage
        #: source -> the cancel scope of its task
        self._tasks: dict[str, trio.CancelScope] = {}
        #: sources whose copy is complete here (nothing more to do while asked)
        self.done: set[str] = set()

    @property
    def sources(self) -> frozenset[str]:
        """The sources the server asks this node to stage now (their copies are never evicted)."""
        return frozenset(self._tasks)

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

    async def _run(self, source: str, scope: trio.CancelScope) -> None:
        shown = [""]

        def progress(detail: str, staged: object = None) -> None:
            if detail.split(" (")[0] != shown[0]:
                shown[0] = detail.split(" (")[0]
                log.info("staging %s ahead of a rollout: %s", source, detail)

        with scope:
            while True:
                try:
                    path = await self.stage(source, progress)
                except Exception as exc:  # noqa: BLE001 - one failed copy must not end the agent
                    log.warning("staging %s ahead of a rollout failed: %s; trying again", source, exc)
                    await trio.sleep(RETRY)
                    continue
                log.info("staged %s ahead of a rollout: %s", source, path)
                self.done.add(source)
                return
