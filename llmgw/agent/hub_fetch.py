"""The one download of an ``hf://`` source per fleet: done by the node holding the server's lease.

:class:`HubFetcher` is what :class:`llmgw.agent.staging.Stager` calls when a
shard needs an ``hf://`` source no node holds completely:

1. it asks the server for the source's Hub lease (``POST
   /v1/agent/weights/hub``); one node gets it, the others are told which node
   has it (and copy from peers what that node has verified so far);
2. without a manifest yet, it asks the Hub for the revision's commit and
   files (the revision is pinned to that commit), downloads the small files
   the Hub gives no sha256 for (non-LFS) to hash them, and posts the manifest
   (LFS sha256 from the Hub, the rest hashed here), like a seed's holder;
3. it downloads each file still missing into its copy, resumed from a partial
   file, verified against the manifest's sha256, and served to peers at once.

A Hub error (401, 404, 429, unreachable) is shown as the shard's staging
detail and sent as an event (once per distinct reason); the next try waits
with exponential backoff (at least the Hub's ``Retry-After``), the lease
kept and the reason passed on to the waiting nodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from llmgw.agent.copy_meter import CopyMeter, Progress
from llmgw.agent.models_dir import PARTIAL_SUFFIX
from llmgw.agent.peer_files import PeerError, in_worker
from llmgw.weights import HubRef, Manifest, ManifestFile, file_sha256, hub_ref, safe_relpath
from llmgw.weights.hub import HubError, HubFile, HubSettings, download, resolve
from llmgw.wire import HubClaim, HubLease, from_json, to_json

if TYPE_CHECKING:
    from llmgw.agent.config import AgentConfig
    from llmgw.agent.models_dir import ModelsDir
    from llmgw.agent.peer_files import PeerFiles

__all__ = ["BACKOFF_FIRST", "BACKOFF_MAX", "HubFetcher", "RENEW_EVERY"]

log = logging.getLogger("llmgw.agent.weights")

#: seconds between two renewals of the Hub lease (the server's lasts 15 s)
RENEW_EVERY = 4.0
#: the first and the longest wait after a Hub error
BACKOFF_FIRST = 2.0
BACKOFF_MAX = 120.0


class Stager(Protocol):
    """What a :class:`HubFetcher` uses of the agent's :class:`llmgw.agent.staging.Stager`, which owns it."""

    config: AgentConfig
    models: ModelsDir
    peers: PeerFiles

    async def _call(self, method: str, path: str, *, body: Any = None, params: Any = None) -> Any:
        """Call the leading server (:meth:`llmgw.agent.staging.Stager._call`)."""

    async def report(self, source: str, message: str) -> None:
        """Tell the server's events what happened to ``source``'s copy."""

    #: called when a copy gained a verified file (the agent's facts are refreshed)
    copy_changed: Callable[[], Awaitable[None]]


class HubFetcher:
    """Downloads of ``hf://`` sources for one agent's :class:`Stager`; see the module docstring."""

    def __init__(self, stager: Stager) -> None:
        self.stager = stager
        self.settings = HubSettings(stager.config.hub_endpoint, stager.config.hub_token_file)
        #: source -> Hub errors in a row, and the last reason reported as an event
        self.failures: dict[str, int] = {}
        self.reported: dict[str, str] = {}
        self.status: dict[str, str] = {}

    async def claim(self, source: str) -> HubLease:
        """Ask the server for (or renew) this node's lease to download ``source``; who holds it.

        :raises PeerError: the server cannot be reached or refused.
        """
        body = to_json(HubClaim(source, self.status.get(source, "")))
        return from_json(await self.stager._call("POST", "/v1/agent/weights/hub", body=body), HubLease)

    async def _renew(self, source: str) -> None:
        while True:
            await trio.sleep(RENEW_EVERY)
            with contextlib.suppress(PeerError):
                lease = await self.claim(source)
                if not lease.granted:
                    log.warning("%s: the hub lease went to node %s", source, lease.node)

    async def run(
        self,
        source: str,
        manifest: Manifest | None,
        progress: Progress,
        from_peers: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """One try at downloading what this node lacks of ``source``; after a Hub error, the backoff.

        Called with the lease granted. ``from_peers`` (run first, the lease
        renewed meanwhile) copies what other nodes already verified, so a node
        taking over a dead downloader's lease asks the Hub only for the rest.
        Returns when every file is here and verified, or when the backoff
        after a failure is over (the caller looks again).
        """
        ref = hub_ref(source)
        assert ref is not None
        failure: HubError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._renew, source)
            try:
                if from_peers is not None:
                    await from_peers()
                if manifest is None:
                    manifest = await self._make_manifest(source, ref, progress)
                await self._download_missing(ref, manifest, progress)
            except HubError as exc:
                failure = exc
            except PeerError as exc:
                failure = HubError(f"cannot tell the server about the download: {exc}")
            except OSError as exc:
                failure = HubError(f"cannot write the download to {self.stager.models.root}: {exc}")
            finally:
                nursery.cancel_scope.cancel()
        if failure is not None:
            await self._back_off(source, str(failure), failure.retry_after, progress)
            return
        self.failures.pop(source, None)
        self.reported.pop(source, None)
        self.status.pop(source, None)

    async def _back_off(
        self, source: str, reason: str, retry_after: float | None, progress: Progress
    ) -> None:
        failures = self.failures[source] = self.failures.get(source, 0) + 1
        delay = max(retry_after or 0.0, min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** min(failures - 1, 16)))
        self.status[source] = reason
        if self.reported.get(source) != reason:
            self.reported[source] = reason
            await self.stager.report(source, reason)
        deadline = trio.current_time() + delay
        while (left := deadline - trio.current_time()) > 0:
            progress(f"{reason}; trying again in {left:.0f} s")
            with contextlib.suppress(PeerError):
                await self.claim(source)  # keep the lease, and tell the waiting nodes why
            await trio.sleep(min(RENEW_EVERY, left))

    async def _fetch(self, ref: HubRef, commit: str, file: HubFile, partial, on_bytes=lambda n: None) -> None:
        """Download ``file`` into ``partial`` in a worker thread, resumed; stopped when cancelled."""
        await in_worker(download, self.settings, ref, commit, file, partial, on_bytes=on_bytes)

    async def _make_manifest(self, source: str, ref: HubRef, progress: Progress) -> Manifest:
        """Pin the revision, hash the files the Hub gives no sha256 for, post the manifest; the stored one."""
        stager, models = self.stager, self.stager.models
        progress(f"asking the hub at {self.settings.endpoint} for {ref.repo}")
        model = await trio.to_thread.run_sync(resolve, self.settings, ref)
        slug = hashlib.sha256(ref.repo.encode()).hexdigest()[:16]
        work = models.meta / "hub" / f"{slug}-{model.commit}"
        files = []
        for file in model.files:
            if not safe_relpath(file.path):
                raise HubError(f"{ref.repo} has a file llmgw cannot place in a copy: {file.path!r}")
            if file.sha256 is not None:
                files.append(ManifestFile(file.path, file.size, file.sha256))
                continue
            target = work / file.path
            have = await trio.to_thread.run_sync(lambda t=target: t.stat().st_size if t.is_file() else -1)
            if have != file.size:
                progress(f"downloading {file.path} from the hub (commit {model.commit[:12]})")
                partial = work / (file.path + PARTIAL_SUFFIX)
                await self._fetch(ref, model.commit, file, partial)
                await trio.to_thread.run_sync(os.replace, partial, target)
            sha256 = await trio.to_thread.run_sync(file_sha256, target)
            files.append(ManifestFile(file.path, file.size, sha256))
        mine = Manifest(source, tuple(files), made_by=stager.config.node, revision=model.commit)
        answer = await stager._call("POST", "/v1/agent/manifests", body=to_json(mine))
        stored = from_json(answer, Manifest)
        log.info("%s: revision pinned to commit %s (%d files)", source, stored.revision, len(stored.files))
        await trio.to_thread.run_sync(models.begin, stored)
        directory = models.copy_dir(stored.digest)
        stager.peers.offer(stored, directory, seed=False)

        def keep_hashed() -> list[str]:
            kept = []
            for file in stored.files:
                ours = mine.file(file.path)
                if ours is not None and ours.sha256 == file.sha256 and (work / file.path).is_file():
                    (directory / file.path).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(work / file.path, directory / file.path)
                    kept.append(file.path)
            shutil.rmtree(work, ignore_errors=True)
            return kept

        kept = await trio.to_thread.run_sync(keep_hashed)
        await trio.to_thread.run_sync(models.mark_verified, stored, kept)
        await stager.copy_changed()
        return stored

    async def _download_missing(self, ref: HubRef, manifest: Manifest, progress: Progress) -> None:
        """Download, verify and keep each file of the copy not verified here yet."""
        stager, models = self.stager, self.stager.models
        await trio.to_thread.run_sync(models.begin, manifest)
        directory = models.copy_dir(manifest.digest)
        stager.peers.offer(manifest, directory, seed=False)
        missing = [
            f for f in manifest.files if not await trio.to_thread.run_sync(models.trusted, manifest, f)
        ]
        partials = [models.partial(manifest.digest, f) for f in missing]
        present = manifest.total_bytes - sum(f.size for f in missing)
        present += await trio.to_thread.run_sync(
            lambda: sum(
                min(p.stat().st_size, f.size) for p, f in zip(partials, missing, strict=True) if p.exists()
            )
        )
        label = f"downloading from the hub (commit {manifest.revision[:12]})"
        meter = CopyMeter(manifest.total_bytes, present, progress, label)
        meter.show()
        for file, partial in zip(missing, partials, strict=True):
            with stager.peers.write(manifest.digest, file.path):  # peers follow its bytes as they come
                await self._fetch(ref, manifest.revision, HubFile(file.path, file.size), partial, meter.add)
            digest = await trio.to_thread.run_sync(file_sha256, partial)
            if digest != file.sha256:
                await trio.to_thread.run_sync(partial.unlink)
                meter.add(-file.size)
                raise HubError(
                    f"{file.path} from the hub failed verification (sha256 {digest[:12]}, "
                    f"manifest {file.sha256[:12]}): downloading it again"
                )
            await trio.to_thread.run_sync(os.replace, partial, directory / file.path)
            await trio.to_thread.run_sync(models.mark_verified, manifest, [file.path])
            await stager.copy_changed()
