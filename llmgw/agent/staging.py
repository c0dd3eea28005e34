"""Staging a shard's weights: a verified local copy of a distributable source before the engine starts.

The same for a LoRA adapter's source, before a running engine loads it.

:class:`Stager` turns a ``seed:///PATH`` or ``hf://ORG/NAME`` source into a local path:

- on a node where ``PATH`` exists (the seed), ``PATH`` itself; its manifest
  is made (once, cached) and sent to the server, and its files served to peers;
- elsewhere, a copy under ``--models-dir``: the manifest comes from the
  server with the nodes holding copies; each missing file is fetched from a
  holder (resumed from its partial bytes), hashed, and kept only when its
  sha256 matches; a file no node has verified yet is followed as a node
  still fetching it writes it (a Hub download), so it survives that node; a
  file changed on disk since it was verified is hashed again, and fetched
  again on a mismatch (an event says so). Every verified file is served to
  other peers at once, so copies fan out;
- for ``hf://``, while no node holds a complete copy, the one node given the
  server's lease downloads it from the Hub (:mod:`llmgw.agent.hub_fetch`) and
  makes the manifest; the others copy from it (and from each other) as above.

Meanwhile the shard reports ``staging`` with ``fetching 40% (...)``; the
server does not count that time against its ready timeout.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import trio
from cryptography import x509

from llmgw.agent.config import AgentConfig
from llmgw.agent.copy_meter import CopyMeter, Progress
from llmgw.agent.hub_fetch import HubFetcher
from llmgw.agent.models_dir import ModelsDir
from llmgw.agent.peer_files import PeerError, PeerFiles, fetch_file, peer_client_context
from llmgw.serverlist import ServerList, send_to_leader
from llmgw.weights import Manifest, ManifestFile, file_sha256, hub_ref, is_distributable, seed_path
from llmgw.wire import PeerHolder, WeightsEvent, WeightsInfo, from_json, to_json

__all__ = ["Stager", "RETRY"]

log = logging.getLogger("llmgw.agent.weights")

#: seconds between two looks at the server while no manifest or holder is there
RETRY = 1.0
class Stager:
    """Local copies of distributable sources for one agent; see the module docstring."""

    def __init__(
        self,
        config: AgentConfig,
        peers: PeerFiles,
        server_context: Callable[[], ssl.SSLContext],
        copy_changed: Callable[[], Awaitable[None]],
    ) -> None:
        """:param server_context: the agent's current TLS context for the server.
        :param copy_changed: called when a copy gained a verified file (the facts are refreshed)."""
        self.config = config
        self.models = ModelsDir(config.models_dir, config.seed_root)
        self.peers = peers
        self.server_context = server_context
        self.copy_changed = copy_changed
        self.ca = x509.load_pem_x509_certificate(config.ca.read_bytes())
        self.peer_context = peer_client_context(config.cert, config.key)
        self._locks: dict[str, trio.Lock] = {}
        #: source -> digest of the server's manifest, and of the one this node sent it
        self.published: dict[str, str] = {}
        self._posted: dict[str, str] = {}
        self.hub = HubFetcher(self)
        #: the servers (``--server`` may list several): calls go to the leader
        self._servers: ServerList | None = None
        #: bytes received from peers since start, verified or not (the agent's metrics read it)
        self.bytes_fetched = 0

    def _count(self, meter: CopyMeter, size: int) -> None:
        meter.add(size)
        self.bytes_fetched += size

    # -- the server ------------------------------------------------------------------------------

    async def _call(self, method: str, path: str, *, body: Any = None, params: Any = None) -> Any:
        if self._servers is None:
            self._servers = ServerList.parse(self.config.server)
        try:
            async with httpx.AsyncClient(verify=self.server_context(), timeout=30) as client:
                response = await send_to_leader(client, self._servers, method, path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise PeerError(f"server unreachable: {exc}") from None
        if response.status_code != 200:
            raise PeerError(f"server answered {response.status_code}: {response.text[:300]}")
        return response.json()

    async def report(self, source: str, message: str) -> None:
        """Tell the server (an event for ``ctl events``) and the log; a failure to tell is logged only."""
        log.warning("%s: %s", source, message)
        try:
            await self._call("POST", "/v1/agent/weights/events", body=to_json(WeightsEvent(source, message)))
        except PeerError as exc:
            log.warning("could not report it to the server: %s", exc)

    async def publish_seed(self, source: str) -> Manifest | None:
        """Make (or reuse) the manifest of the seed ``source`` on this node, send it, serve its files.

        :returns: the manifest, or None when the seed is not on this node.
        """
        manifest = await trio.to_thread.run_sync(self.models.seed_manifest, source, self.config.node)
        if manifest is None:
            if self._posted.pop(source, None) is not None:  # emptied or removed since it was sent
                self._unoffer_seed(source)
                await self.copy_changed()
            return None
        if self._posted.get(source) != manifest.digest:
            answer = await self._call("POST", "/v1/agent/manifests", body=to_json(manifest))
            self.published[source] = from_json(answer, Manifest).digest
            self._posted[source] = manifest.digest
            if self.published[source] != manifest.digest:
                log.error("seed %s here differs from the server's manifest: copied from peers", source)
            else:
                self.peers.offer(manifest, self.models.seed_dir(source) or Path(), seed=True)
            await self.copy_changed()  # reported as a copy: peers may fetch from here (or it differs)
        if self.published[source] != manifest.digest:
            self._unoffer_seed(source)
            return None
        return manifest

    def _unoffer_seed(self, source: str) -> None:
        """Stop serving the seed ``source`` here: its files are no longer those of the fleet's manifest."""
        digest = self.published.get(source, "")
        offer = self.peers.offers.get(digest)
        if offer is not None and offer.seed:
            del self.peers.offers[digest]

    async def watch_seeds(self, sources: Callable[[], tuple[str, ...]]) -> None:
        """Publish every seed of the catalog this node holds, and serve the copies it has; forever.

        A seed is looked at again every round: one changed (a file replaced,
        the folder emptied) is hashed and sent again, or no longer served.
        """
        for copy in await trio.to_thread.run_sync(self.models.copies):
            known = await trio.to_thread.run_sync(self.models.load, copy.digest)
            if known is not None:
                self.peers.offer(known[0], self.models.copy_dir(copy.digest), seed=False)
        while True:
            for source in sources():
                if seed_path(source) is not None:
                    try:
                        await self.publish_seed(source)
                    except (PeerError, OSError) as exc:
                        log.warning("seed %s: cannot publish its manifest yet: %s", source, exc)
            await trio.sleep(RETRY * 5)

    # -- staging ---------------------------------------------------------------------------------

    async def stage(self, source: str, progress: Progress) -> str:
        """A local path holding a verified copy of ``source``; waits (reporting progress) until there is one.

        Called by a shard's supervisor before it starts anything, and for a
        LoRA adapter's source before it is loaded; cancelled when the shard is
        stopped (partial files stay, and are resumed). A source llmgw does not
        copy (a path on the node) is returned as it is.
        """
        if not is_distributable(source):
            return source
        lock = self._locks.setdefault(source, trio.Lock())
        if lock.locked():
            progress("waiting for the copy another shard on this node is making")
        async with lock:
            if hub_ref(source) is not None:
                return await self._copy(source, progress)
            try:
                if await self.publish_seed(source) is not None:
                    return str(self.models.seed_dir(source))
            except PeerError as exc:
                log.warning("seed %s: manifest not sent yet (%s); using it here", source, exc)
                return str(self.models.seed_dir(source))
            return await self._copy(source, progress)

    async def _copy(self, source: str, progress: Progress) -> str:
        while True:
            try:
                answer = await self._call("GET", "/v1/agent/weights", params={"source": source})
                info = from_json(answer, WeightsInfo)
            except PeerError as exc:
                progress(f"waiting for the server: {exc}")
                await trio.sleep(RETRY)
                continue
            manifest = info.manifest
            if manifest is not None:
                await trio.to_thread.run_sync(self.models.begin, manifest)
                self.peers.offer(manifest, self.models.copy_dir(manifest.digest), seed=False)
                missing = await self._check(manifest, progress)
                if not missing:
                    break
            if hub_ref(source) is not None and not any(h.complete for h in info.holders):
                # no node has it all: one node (the lease's) downloads from the hub, the rest wait or copy
                try:
                    lease = await self.hub.claim(source)
                except PeerError as exc:
                    progress(f"waiting for the server: {exc}")
                    await trio.sleep(RETRY)
                    continue
                if lease.granted:
                    from_peers = None
                    if manifest is not None and info.holders:  # a downloader died: first what others verified
                        from_peers = functools.partial(
                            self._fetch, manifest, missing, list(info.holders), progress
                        )
                    await self.hub.run(source, manifest, progress, from_peers)
                    continue
                if manifest is None:
                    why = f": {lease.status}" if lease.status else ""
                    progress(f"waiting for node {lease.node} to download {source} from the hub{why}")
                    await trio.sleep(RETRY)
                    continue
            elif manifest is None:
                progress(f"waiting for a node holding {seed_path(source)} to make its manifest")
                await trio.sleep(RETRY)
                continue
            holders = list(info.holders)
            if not holders:
                progress(f"fetching 0%: waiting for a node holding {source} to be online")
                await trio.sleep(RETRY)
                continue
            if not await self._fetch(manifest, missing, holders, progress):
                await trio.sleep(RETRY)  # every holder failed every file: ask again who holds it
        await trio.to_thread.run_sync(self.models.touch, manifest.digest)
        await self.copy_changed()
        return str(self.models.copy_dir(manifest.digest))

    async def _holders(self, source: str) -> list[PeerHolder]:
        """The nodes holding (some of) ``source`` now; empty when the server cannot say."""
        try:
            answer = await self._call("GET", "/v1/agent/weights", params={"source": source})
        except PeerError:
            return []
        return list(from_json(answer, WeightsInfo).holders)

    async def _check(self, manifest: Manifest, progress: Progress) -> list[ManifestFile]:
        """The files of the copy still to fetch; a file changed since verified is hashed again."""
        missing = []
        directory = self.models.copy_dir(manifest.digest)
        for file in manifest.files:
            if await trio.to_thread.run_sync(self.models.trusted, manifest, file):
                continue
            path = directory / file.path
            if not await trio.to_thread.run_sync(path.is_file):
                missing.append(file)
                continue
            progress(f"verifying {file.path}")
            digest = await trio.to_thread.run_sync(file_sha256, path)
            if digest == file.sha256:
                await trio.to_thread.run_sync(self.models.mark_verified, manifest, [file.path])
                continue
            await trio.to_thread.run_sync(self.models.forget_verified, manifest, file.path)
            await trio.to_thread.run_sync(path.unlink)
            missing.append(file)
            await self.report(
                manifest.source,
                f"{file.path} of the copy on {self.config.node} failed verification "
                f"(sha256 {digest[:12]}, manifest {file.sha256[:12]}): fetching it again",
            )
        return missing

    async def _fetch(
        self,
        manifest: Manifest,
        missing: list[ManifestFile],
        holders: list[PeerHolder],
        progress: Progress,
    ) -> bool:
        """Fetch each missing file from a holder (another when one fails); returns when each was tried.

        Copies fan out: files are taken in a random order (nodes copying at
        once start on different files, then trade them), the holders are
        asked again before each file, and nodes still copying are tried
        before complete ones (a node without the file answers 404 at once).

        :returns: whether any file was fetched and verified.
        """
        fetched = False
        directory = self.models.copy_dir(manifest.digest)
        present = manifest.total_bytes - sum(f.size for f in missing)
        partials = [self.models.partial(manifest.digest, f) for f in missing]
        present += await trio.to_thread.run_sync(
            lambda: sum(p.stat().st_size for p in partials if p.exists())
        )
        meter = CopyMeter(manifest.total_bytes, present, progress)
        meter.show()
        order = random.sample(list(zip(missing, partials, strict=True)), len(missing))
        for position, (file, partial) in enumerate(order):
            if position:
                holders = await self._holders(manifest.source) or holders
            ranked = sorted(holders, key=lambda h: (h.complete, random.random()))
            for holder in ranked:
                peer = (holder.node, holder.address, holder.port)
                try:  # the digest of the bytes as written: the file is not read again
                    digest = await fetch_file(
                        self.peer_context, self.ca, peer, manifest.digest, file, partial,
                        lambda size, meter=meter: self._count(meter, size),
                    )  # fmt: skip
                except PeerError as exc:
                    log.info("%s from node %s: %s; trying another", file.path, peer[0], exc)
                    continue
                if digest != file.sha256:
                    await trio.to_thread.run_sync(partial.unlink)
                    meter.add(-file.size)  # its bytes are gone: fetched again
                    await self.report(
                        manifest.source,
                        f"{file.path} from node {peer[0]} failed verification (sha256 {digest[:12]}, "
                        f"manifest {file.sha256[:12]}): fetching it again from another node",
                    )
                    continue
                await trio.to_thread.run_sync(os.replace, partial, directory / file.path)
                await trio.to_thread.run_sync(self.models.mark_verified, manifest, [file.path])
                await self.copy_changed()
                fetched = True
                break
            else:  # no node has it verified yet: take the bytes one is fetching now (its Hub download)
                await self._follow(manifest, file, partial, ranked, meter)
        return fetched

    async def _follow(
        self,
        manifest: Manifest,
        file: ManifestFile,
        partial: Path,
        holders: list[PeerHolder],
        meter: CopyMeter,
    ) -> None:
        """Append the bytes of ``file`` that a node still copying it has beyond ``partial``, as they come.

        So the fleet keeps what a downloading node got if it dies: the next
        downloader resumes from there. Returns after the first holder that
        gave bytes, or when none has any.
        """
        got = [0]

        def count(size: int) -> None:
            got[0] += size
            self._count(meter, size)

        for holder in holders:
            if holder.complete:
                continue
            peer = (holder.node, holder.address, holder.port)
            try:
                with self.peers.write(manifest.digest, file.path):  # others may follow it from here in turn
                    args = (self.peer_context, self.ca, peer, manifest.digest, file, partial, count)
                    await fetch_file(*args, follow=True)
            except PeerError as exc:
                log.debug("%s: no bytes from node %s still fetching it: %s", file.path, peer[0], exc)
            if got[0]:
                log.info("%s: %d bytes from node %s while it fetches it", file.path, got[0], peer[0])
                return
