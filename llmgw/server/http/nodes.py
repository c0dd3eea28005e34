"""The admin API's nodes: list them, cordon, uncordon, drain, the drain's progress, declare one lost.

Mixed into :class:`llmgw.server.http.api.ServerApp`, which routes ``/v1/admin/nodes*`` to it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from llmgw.net.server import Request, Response
from llmgw.pki import Identity, RevocationList
from llmgw.server.http.replies import Refused, answer
from llmgw.server.state.cluster import ClusterState
from llmgw.server.views import cluster as views

__all__ = ["NodesEndpoints"]


class NodesEndpoints:
    """Handlers for ``/v1/admin/nodes*``; each returns the JSON answer."""

    cluster: ClusterState
    clock: Callable[[], float]
    revocations: RevocationList | None
    _lock: trio.Lock
    commit: Callable[[], Awaitable[None]]

    async def _get_nodes(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        revoked = self.revocations.is_revoked if self.revocations is not None else (lambda serial: False)
        return answer(views.node_list(self.cluster, self.clock(), revoked))

    async def _node_action(self, request: Request, identity: Identity, params: dict[str, str]) -> Response:
        node_id, action = params["node"], params["action"]
        async with self._lock:
            self._known_node(node_id)
            self.cluster.set_cordon(node_id, action != "uncordon", self.clock(), drain=action == "drain")
            await self.commit()
        return answer(views.drain_status(self.cluster, node_id))

    async def _declare_lost(self, request: Request, identity: Identity, params: dict[str, str]) -> Response:
        """``ctl nodes lost NODE``: the operator says the node is gone, whatever the server suspects."""
        node_id = params["node"]
        async with self._lock:
            self._known_node(node_id)
            self.cluster.fence_node(node_id, f"declared lost by {identity.name}", self.clock())
            await self.commit()
        return answer(views.drain_status(self.cluster, node_id))

    async def _get_drain(self, request: Request, identity: Identity, params: dict[str, str]) -> Response:
        return answer(views.drain_status(self.cluster, self._known_node(params["node"])))

    def _known_node(self, node_id: str) -> str:
        """``node_id``, or a 404 that lists the nodes there are."""
        if node_id not in self.cluster.nodes:
            known = ", ".join(sorted(self.cluster.nodes)) or "none"
            raise Refused(404, f"no node {node_id!r} (nodes: {known})")
        return node_id
