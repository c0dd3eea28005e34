"""The agents' sync call: a node reports its facts and shards, and reads what it should run.

Mixed into :class:`llmgw.server.http.api.ServerApp`, which routes ``POST /v1/agent/sync`` to it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import attrs
import trio

from llmgw.models import NodeFacts
from llmgw.net.server import Request, Response
from llmgw.pki import Identity
from llmgw.server.http.replies import Refused, answer
from llmgw.server.reconciler import Reconciler
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import EventKind
from llmgw.server.views import cluster as views
from llmgw.server.views.adapters import desired_adapters
from llmgw.wire import SyncReply, SyncRequest, from_json

__all__ = ["SyncEndpoints"]

log = logging.getLogger("llmgw.server")


class SyncEndpoints:
    """The handler of ``POST /v1/agent/sync``, with the caches that keep a heartbeat cheap."""

    cluster: ClusterState
    clock: Callable[[], float]
    reconciler: Reconciler
    _lock: trio.Lock
    poll_timeout: float
    metrics: Any
    #: node id -> (the facts it last sent, as JSON and as read): see _read_sync
    _facts: dict[str, tuple[Any, NodeFacts]]
    #: node id -> (what its last sync answer was made from, the answer)
    _replies: dict[str, tuple[tuple, Response]]

    async def _sync(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        began = time.perf_counter()
        sync = self._read_sync(request.json(), identity.name)
        if sync.node_id != identity.name:
            message = (
                f"node certificate for {identity.name!r} cannot sync as node {sync.node_id!r}; "
                "a node syncs under the id its certificate was issued for"
            )
            log.warning("refused sync: certificate CN %r claims node id %r", identity.name, sync.node_id)
            self.cluster.record_event(
                self.clock(),
                EventKind.REFUSAL,
                sync.node_id,
                f"sync refused: certificate is for {identity.name!r}",
            )
            async with self._lock:
                await self.reconciler.save()
            raise Refused(403, message)
        rank0 = [r.id for r in self.cluster.replicas.values() if r.placement.rank0.node_id == sync.node_id]
        if self.cluster.sync(sync, self.clock()) | self.cluster.adapters.observe(rank0, sync.adapters):
            self.reconciler.request()
        self.cluster.record_certificate(sync.node_id, identity.serial, identity.not_after.timestamp())
        if self.metrics is not None:
            self.metrics.sync_duration.observe(time.perf_counter() - began)
        if sync.wait:
            await self.reconciler.wait_node(sync.node_id, sync.revision, self.poll_timeout)
        unwritten = await self.reconciler.written()
        if unwritten is not None:
            # the sync is recorded (the node is not lost), but what to run is not said until stored
            raise Refused(503, f"this server could not store its decisions ({unwritten}); retry")
        return self._sync_reply(sync.node_id)

    def _read_sync(self, data: Any, node: str) -> SyncRequest:
        """The sync request in ``data``, its facts reused when they are the ones ``node`` sent last.

        Facts change rarely and are most of a sync's body: structuring them
        again for every heartbeat would be most of a sync's cost.
        """
        facts = data.get("facts") if isinstance(data, dict) else None
        known = self._facts.get(node)
        if known is None or facts != known[0]:
            sync = from_json(data, SyncRequest)
            self._facts[node] = (facts, sync.facts)
            return sync
        sync = from_json({**data, "facts": {"node_id": node, "agent_version": ""}}, SyncRequest)
        return attrs.evolve(sync, facts=known[1])

    def _sync_reply(self, node_id: str) -> Response:
        """The sync answer for ``node_id``, encoded once per revision of what it says."""
        shards = views.desired_for(self.cluster, node_id)
        stage = self.cluster.rollouts.stage_sources().get(node_id, ())
        adapters = desired_adapters(self.cluster, node_id)
        key = (self.cluster.revision, self.cluster.sources_revision, shards, stage, adapters)
        cached = self._replies.get(node_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        reply = SyncReply(
            revision=self.cluster.revision,
            shards=shards,
            check_sources=self.cluster.sources_to_check(),
            stage_sources=views.stage_for(self.cluster, stage, shards),
            lost_after=self.cluster.settings.lost_after,
            disk_headroom=self.cluster.settings.disk_headroom,
            adapters=adapters,
        )
        response = answer(reply)
        self._replies[node_id] = (key, response)
        return response
