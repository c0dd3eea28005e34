"""The agents' weights endpoints: manifests of distributable sources, who holds copies, copy events.

Mixed into :class:`llmgw.server.http.api.ServerApp`, which routes to them (node
certificates only):

- ``POST /v1/agent/manifests``: a node holding a seed sends the manifest it
  made; the first complete one stored for a source is the fleet's and stays
  (answered with it); a node sending another is named, with the files that
  differ, in one event, and is no holder of the source (:mod:`llmgw.weights`).
- ``GET /v1/agent/weights?source=S``: the stored manifest of ``S`` (or none
  yet) and the nodes holding copies of it, complete ones first.
- ``POST /v1/agent/weights/events``: a node reports something about a copy
  (a file that failed verification): recorded as an event for ``ctl events``.
- ``POST /v1/agent/weights/hub``: a node asks to download an ``hf://``
  source from the Hub. One node at a time holds that lease (renewed while it
  downloads, :data:`HUB_LEASE` seconds, lost with the node); the others are
  told which node has it and how it goes (a Hub error while it backs off),
  and copy from peers. The lease is kept in memory: after a server restart
  the downloading node takes it again with its next renewal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from llmgw.net.server import Request, Response
from llmgw.pki import Identity
from llmgw.server.http.replies import Refused, answer
from llmgw.server.persist.manifests import save_manifest
from llmgw.server.persist.sqlite import Store
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import EventKind
from llmgw.weights import Manifest, differing_files, hub_ref, is_distributable
from llmgw.wire import HubClaim, HubLease, PeerHolder, WeightsEvent, WeightsInfo, from_json

__all__ = ["HUB_LEASE", "WeightsEndpoints"]

#: seconds a node's Hub download lease lasts without a renewal
HUB_LEASE = 15.0

log = logging.getLogger("llmgw.server")


class WeightsEndpoints:
    """Handlers for ``/v1/agent/manifests`` and ``/v1/agent/weights*``."""

    cluster: ClusterState
    store: Store
    clock: Callable[[], float]
    reconciler: Any
    #: source -> (the node downloading it from the Hub, lease end on :attr:`clock`, its status)
    _hub_leases: dict[str, tuple[str, float, str]] | None = None

    def _weights_routes(self, route: Callable[..., None]) -> None:
        """Register the handlers with ``route(method, pattern, roles, handler)`` (node certificates)."""
        from llmgw.pki import Role

        route("POST", r"/v1/agent/manifests", {Role.NODE}, self._post_manifest)
        route("GET", r"/v1/agent/weights", {Role.NODE}, self._get_weights)
        route("POST", r"/v1/agent/weights/events", {Role.NODE}, self._post_weights_event)
        route("POST", r"/v1/agent/weights/hub", {Role.NODE}, self._post_hub_claim)

    async def manifests(self) -> dict[str, Manifest]:
        """The stored manifests by source (the cluster's: read from the store with it)."""
        return self.cluster.manifests

    async def _post_manifest(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        manifest = from_json(request.json(), Manifest)
        if not is_distributable(manifest.source):
            raise Refused(
                400,
                f"source: {manifest.source!r} is not a distributable source (seed:///PATH or hf://ORG/NAME)",
            )
        if hub_ref(manifest.source) is not None and len(manifest.revision) != 40:
            raise Refused(400, f"revision: expected the 40-hex commit {manifest.source} was downloaded at")
        if manifest.made_by != identity.name:
            raise Refused(403, f"made_by: a node sends its own manifests ({identity.name!r})")
        if not manifest.files:
            raise Refused(400, f"files: empty manifest of {manifest.source} (an empty folder is no copy)")
        stored = (await self.manifests()).get(manifest.source)
        if stored is None:
            now = self.clock()
            # two first manifests at once: the store keeps one, and both answers (and the cluster) name it
            stored = await self.store.write(lambda conn: save_manifest(conn, manifest, now))
            if stored.source not in self.cluster.manifests:
                self.cluster.note_manifest(stored)
                self.reconciler.request()  # its size is known: placing now counts disk room for it
                pinned = f", revision pinned to commit {stored.revision}" if stored.revision else ""
                message = (
                    f"manifest of {stored.source} made by {stored.made_by}: {len(stored.files)} files, "
                    f"{stored.total_bytes / 1e6:.1f} MB, digest {stored.digest[:12]}{pinned}"
                )
                self.cluster.record_event(now, EventKind.WEIGHTS, stored.source, message)
                log.info(message)
        if stored.digest != manifest.digest:
            files = differing_files(stored, manifest)
            more = f" and {len(files) - 20} more" if len(files) > 20 else ""
            message = (
                f"node {identity.name} holds files of {manifest.source} that differ from the manifest of "
                f"{stored.made_by} ({stored.digest[:12]}): {', '.join(files[:20])}{more}; "
                "it is no holder of it (not counted as holding it, not used as a peer) until its files match"
            )
            self.cluster.record_event(self.clock(), EventKind.WEIGHTS, identity.name, message)
            log.warning(message)
        return answer(stored)

    async def _get_weights(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        source = request.query.get("source", "")
        if not is_distributable(source):
            raise Refused(400, f"source: expected a distributable source (seed:///PATH), got {source!r}")
        manifest = (await self.manifests()).get(source)
        holders: list[PeerHolder] = []
        if manifest is not None:
            for node in self.cluster.nodes.values():
                facts = node.facts
                if node.lost or node.node_id == identity.name or facts.peer_port is None:
                    continue
                for copy in facts.model_copies:
                    if copy.digest == manifest.digest and (copy.complete or copy.bytes_present):
                        holders.append(PeerHolder(node.node_id, node.address, facts.peer_port, copy.complete))
                        break
        holders.sort(key=lambda h: (not h.complete, h.node))
        return answer(WeightsInfo(source, manifest, tuple(holders)))

    async def _post_weights_event(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        event = from_json(request.json(), WeightsEvent)
        self.cluster.record_event(
            self.clock(), EventKind.WEIGHTS, identity.name, f"{event.source}: {event.message}"
        )
        log.warning("node %s: %s: %s", identity.name, event.source, event.message)
        return answer(event)

    async def _post_hub_claim(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        claim = from_json(request.json(), HubClaim)
        if hub_ref(claim.source) is None:
            raise Refused(400, f"source: expected hf://ORG/NAME[@REVISION], got {claim.source!r}")
        leases = self._hub_leases if self._hub_leases is not None else {}
        self._hub_leases = leases
        now = self.clock()
        holder, until, status = leases.get(claim.source, ("", 0.0, ""))
        node = self.cluster.nodes.get(holder)
        free = not holder or until < now or node is None or node.lost
        if free or holder == identity.name:
            if holder != identity.name:
                log.info("node %s downloads %s from the hub", identity.name, claim.source)
            leases[claim.source] = (identity.name, now + HUB_LEASE, claim.status)
            return answer(HubLease(claim.source, identity.name, granted=True, status=claim.status))
        return answer(HubLease(claim.source, holder, granted=False, status=status))
