"""Making room in the models directory for a copy: unused copies evicted, least recently used first.

The server places a replica on a node without the model's copy only when
the node's free bytes plus the bytes of its unused copies cover the copy
(:mod:`llmgw.scheduler._disk`); this agent does the evicting, just before it
fetches, because it is the one that knows, at that moment, what it runs.

:class:`RoomMaker` wraps the stager's ``stage(source, progress)``: when the
server has the source's manifest and this node is not the seed, it frees
what the copy still lacks plus the server's headroom (``--disk-headroom``) of
its size, deleting copies in this order: never used first, then least
recently used. It never deletes:

- a copy a shard of this node uses (desired, running, or still stopping),
  or of a source the server asked this node to stage ahead (a rollout's, or
  the LoRA adapters of a model running here), or an adapter a running
  replica has loaded (held, :meth:`llmgw.agent.prestage.PreStager.hold`);
- a copy whose files a peer is downloading now;
- a seed (not in the models directory at all), or the copy being made.

Each eviction is an event (``ctl events``: ``evicted ... to make room for ...``).
When even evicting every candidate leaves too little room, the shard stays
``staging`` and says so (``waiting for disk room: ...``), looking again every
few seconds: a copy in use becomes evictable once its shard stops (a
rollout restarting a replica in place).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from llmgw.agent.models_dir import ModelsDir
from llmgw.agent.peer_files import PeerFiles
from llmgw.models import ModelCopy
from llmgw.scheduler import DEFAULT_HEADROOM, format_bytes
from llmgw.serverlist import ServerList, send_to_leader
from llmgw.weights import Manifest, is_distributable, seed_path
from llmgw.wire import WeightsInfo, from_json

__all__ = ["RoomMaker", "Eviction", "choose_evictions", "weights_in_use"]

log = logging.getLogger("llmgw.agent.weights")

#: seconds between two looks at the disk while there is not enough room
ROOM_RETRY = 2.0

Progress = Callable[..., None]
Stage = Callable[[str, Progress], Awaitable[str]]


@attrs.frozen
class Eviction:
    """What one look at the models directory decided for a copy of ``manifest``."""

    #: free bytes now, and bytes the copy still lacks
    free: int
    missing: int
    #: the copies to delete, in order (least recently used first)
    victims: tuple[ModelCopy, ...] = ()
    #: whether free bytes plus the victims' cover what is missing
    enough: bool = True


def choose_evictions(
    copies: list[ModelCopy],
    free: int,
    manifest: Manifest,
    in_use: Callable[[ModelCopy], bool],
    headroom: float = DEFAULT_HEADROOM,
) -> Eviction:
    """Which copies to evict so that a copy of ``manifest`` fits; pure (tests call it directly).

    :param copies: every copy in the models directory (seeds are never chosen).
    :param free: the filesystem's free bytes.
    :param in_use: whether a copy must stay (a shard uses it, a peer downloads it).
    :returns: the victims, least recently used first, stopping as soon as the
        copy's missing bytes plus ``headroom`` × its size are free; ``enough``
        is False when even every candidate leaves less than the missing bytes.
    """
    mine = next((c for c in copies if c.digest == manifest.digest), None)
    missing = manifest.total_bytes - (mine.bytes_present if mine is not None else 0)
    target = missing + int(headroom * manifest.total_bytes)
    if free >= target:
        return Eviction(free, missing)
    candidates = sorted(
        (c for c in copies if not c.seed and c.digest != manifest.digest and not in_use(c)),
        key=lambda c: (c.last_used, c.digest),
    )
    victims: list[ModelCopy] = []
    room = free
    for copy in candidates:
        if room >= target:
            break
        victims.append(copy)
        room += copy.bytes_present
    return Eviction(free, missing, tuple(victims), room >= missing)


@attrs.define(eq=False, slots=False)  # not slotted: tests stand in for its _manifest
class RoomMaker:
    """Frees room before a copy is fetched; see the module docstring.

    :param server: the ``--server`` value (its URLs are :attr:`servers`).
    :param in_use: () -> (sources, local paths) this node's shards use or the server asked to stage.
    :param report: ``async (source, message)``: an event for ``ctl events``.
    :param copies_changed: called after evicting (the facts are refreshed).
    :param headroom: the share of a copy's size to free beyond it (the server's ``--disk-headroom``).
    """

    models: ModelsDir
    peers: PeerFiles
    servers: ServerList = attrs.field(converter=ServerList.parse, alias="server", kw_only=True)
    server_context: Callable[[], Any] = attrs.field(kw_only=True)
    in_use: Callable[[], tuple[set[str], set[str]]] = attrs.field(kw_only=True)
    report: Callable[[str, str], Awaitable[None]] = attrs.field(kw_only=True)
    copies_changed: Callable[[], Awaitable[None]] = attrs.field(kw_only=True)
    node: str = attrs.field(kw_only=True)
    headroom: Callable[[], float] = attrs.field(default=lambda: DEFAULT_HEADROOM, kw_only=True)
    _lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)

    def wrap(self, stage: Stage) -> Stage:
        """``stage`` with room made first (what the agent hands its shard supervisors, its
        :class:`~llmgw.agent.prestage.PreStager`, and whoever loads adapters).

        A source llmgw does not copy (a path on the node, a hub name the engine
        resolves) is returned as it is, at once: the engine is given it.
        """

        async def staged(source: str, progress: Progress) -> str:
            if not is_distributable(source):
                return source
            await self.make_room(source, progress)
            return await stage(source, progress)

        return staged

    async def _manifest(self, source: str) -> Manifest | None:
        """The server's manifest of ``source``; None when it has none yet or cannot be asked."""
        try:
            async with httpx.AsyncClient(verify=self.server_context(), timeout=30) as client:
                response = await send_to_leader(
                    client, self.servers, "GET", "/v1/agent/weights", params={"source": source}
                )
            if response.status_code == 200:
                return from_json(response.json(), WeightsInfo).manifest
            problem = f"{self.servers.current} answered {response.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            problem = f"{self.servers.current}: {exc}"
        log.info("%s: cannot ask the server for its manifest (%s): no room made first", source, problem)
        return None

    async def make_room(self, source: str, progress: Progress) -> None:
        """Evict unused copies until a copy of ``source`` fits; wait while it cannot (see the module doc).

        Returns at once on the seed's node; waits for a seed's manifest (its
        size); returns when another source's size is not known yet.
        """
        seed = self.models.seed_dir(source)
        if seed is not None and await trio.to_thread.run_sync(seed.is_dir):
            return
        manifest = await self._manifest(source)
        while manifest is None and seed is not None:
            # a seed's copy cannot start before its holder made the manifest: wait for it, to know its size
            progress(f"waiting for a node holding {seed_path(source)} to make its manifest")
            await trio.sleep(ROOM_RETRY / 2)
            manifest = await self._manifest(source)
        if manifest is None:
            return
        said = ""
        while True:
            async with self._lock:
                plan = await trio.to_thread.run_sync(self._plan, manifest)
                if plan.enough:
                    for victim in plan.victims:
                        await self._evict(victim, manifest, plan)
                    if plan.victims:
                        await self.copies_changed()
                    return
            message = (
                f"waiting for disk room: the copy needs {format_bytes(plan.missing)} more, "
                f"{format_bytes(plan.free)} free, and the other copies here are in use"
            )
            if message != said:
                said = message
                log.warning("%s: %s", source, message)
            progress(message)
            await trio.sleep(ROOM_RETRY)

    def _plan(self, manifest: Manifest) -> Eviction:
        sources, paths = self.in_use()
        used_digests = {Path(p).name for p in paths if Path(p).parent == self.models.root}

        def in_use(copy: ModelCopy) -> bool:
            return (
                copy.source in sources
                or copy.digest in used_digests
                or self.peers.sending.get(copy.digest, 0) > 0
            )

        free = self.models.free_bytes()
        if free is None:
            return Eviction(0, 0)
        return choose_evictions(self.models.copies(), free, manifest, in_use, self.headroom())

    async def _evict(self, victim: ModelCopy, manifest: Manifest, plan: Eviction) -> None:
        self.peers.offers.pop(victim.digest, None)
        await trio.to_thread.run_sync(self.models.remove, victim.digest)
        used = f"last used {_ago(time.time() - victim.last_used)} ago" if victim.last_used else "never used"
        message = (
            f"evicted from {self.node} ({format_bytes(victim.bytes_present)}, {used}, least recently used) "
            f"to make room for {manifest.source} ({format_bytes(plan.missing)} to fetch, "
            f"{format_bytes(plan.free)} was free)"
        )
        await self.report(victim.source, message)  # logged there too


def weights_in_use(agent: Any) -> tuple[set[str], set[str]]:
    """(sources, local paths) the shards of ``agent`` (:class:`~llmgw.agent.sync.Agent`) use, the
    sources the server asked it to stage ahead and the adapters held loaded
    (:attr:`llmgw.agent.prestage.PreStager.sources`): copies of these are never evicted.

    A shard's source becomes the local path of its copy once staged; a shard
    stays listed until its processes are gone (stopping included).
    """
    sources = set(agent.prestage.sources) if agent.prestage is not None else set()
    paths: set[str] = set()
    for supervisor in list(agent.supervisors.values()):
        source = supervisor.desired.spec.model_source
        sources.add(source)
        paths.add(source)
    return sources, paths


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"
