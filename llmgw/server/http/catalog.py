"""The admin API's catalog, rollout and autoscale endpoints: show, diff, apply, history, rollout status and
undo, autoscaling status.

Mixed into :class:`llmgw.server.http.api.ServerApp`, which routes to them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import trio

from llmgw.catalog import catalog_summary, parse_catalog
from llmgw.engine import Engine
from llmgw.errors import CatalogError
from llmgw.models import Catalog
from llmgw.net.server import Request, Response
from llmgw.pki import Identity
from llmgw.server.catalog_diff import catalog_diff
from llmgw.server.controllers.rollout.rollouts import undo_refusal
from llmgw.server.http.replies import InvalidCatalog, Refused, answer, query_int
from llmgw.server.late_plugins import late_plugin_note
from llmgw.server.persist.cluster import catalog_history, catalog_revision
from llmgw.server.persist.sqlite import Store
from llmgw.server.state.cluster import ClusterState
from llmgw.server.views.adapters import adapter_list
from llmgw.server.views.autoscale import autoscale_status
from llmgw.server.views.cluster import replica_counts
from llmgw.server.views.rollouts import rollout_status
from llmgw.wire import ApplyCatalog, CatalogApplied, CatalogDiff, CatalogText, RolloutUndone, from_json

__all__ = ["CatalogEndpoints"]


class CatalogEndpoints:
    """Handlers for ``/v1/admin/catalog*``, ``/v1/admin/rollouts*`` and ``/v1/admin/autoscale``; each
    returns the JSON answer."""

    cluster: ClusterState
    store: Store
    engines: Mapping[str, Engine]
    clock: Callable[[], float]
    _lock: trio.Lock
    commit: Callable[[], Awaitable[None]]

    async def _get_catalog(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        current = self.cluster.catalog_revision
        revision = query_int(request.query.get("revision", str(current)), "revision")
        stored = await self.store.run(lambda conn: catalog_revision(conn, revision))
        if stored is not None:
            return answer(stored)
        if revision == current:  # nothing applied yet
            return answer(CatalogText(current, self.cluster.catalog_text))
        raise Refused(
            404, f"no catalog revision {revision} (the latest is {current}; see ctl catalog history)"
        )

    async def _catalog_history(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        limit = min(query_int(request.query.get("limit", "100"), "limit"), 10_000)
        return answer(await self.store.run(lambda conn: catalog_history(conn, limit)))

    def _parse_catalog(self, body: ApplyCatalog) -> Catalog:
        try:
            return parse_catalog(body.text, self.engines, source=body.name or "catalog")
        except CatalogError as exc:
            note = late_plugin_note(exc.problems)
            raise InvalidCatalog(CatalogError(exc.source, [*exc.problems, note]) if note else exc) from None

    def _scaled(self, catalog: Catalog) -> Catalog:
        """``catalog`` with its autoscaled models at the replicas the autoscaler asks for (or would)."""
        return self.cluster.autoscale.scaled(catalog, (r.placement for r in self.cluster.replicas.values()))

    def _diff_against_stored(self, catalog: Catalog) -> CatalogDiff:
        old, new = self._scaled(self.cluster.catalog), self._scaled(catalog)
        return catalog_diff(old, new, replica_counts(self.cluster), self.cluster.catalog_revision)

    async def _diff_catalog(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        catalog = await trio.to_thread.run_sync(self._parse_catalog, from_json(request.json(), ApplyCatalog))
        return answer(self._diff_against_stored(catalog))

    async def _apply_catalog(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        body = from_json(request.json(), ApplyCatalog)
        catalog = await trio.to_thread.run_sync(self._parse_catalog, body)  # seconds for a large one
        async with self._lock:
            diff = self._diff_against_stored(catalog)
            if diff.removed_models and not body.prune:
                raise Refused(409, _prune_refusal(body.name or "catalog", diff))
            self.cluster.apply_catalog(catalog, body.text, self.clock(), identity.name)
            await self.commit()
            revision = self.cluster.catalog_revision
        wanted = {name: model.replicas for name, model in self._scaled(catalog).models.items()}
        return answer(CatalogApplied(revision, catalog_summary(catalog), diff, wanted))

    async def _get_rollouts(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        model = request.query.get("model")
        if model is not None:
            self._known_model(model)
        return answer(rollout_status(self.cluster, model))

    async def _get_autoscale(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        model = request.query.get("model")
        if model is not None:
            self._known_model(model)
        return answer(autoscale_status(self.cluster, self.clock(), model))

    async def _get_adapters(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        """``GET /v1/admin/adapters[?model=M]``: where each LoRA adapter is loaded, its use (ctl adapters)."""
        model = request.query.get("model")
        if model is not None and model not in self.cluster.catalog.models:
            served = {self.cluster.catalog.served_name(m) for m in self.cluster.catalog.models}
            if model not in served:
                self._known_model(model)
        return answer(adapter_list(self.cluster, model))

    def _known_model(self, model: str) -> str:
        """``model``, or a 404 that lists the catalog's models."""
        if model not in self.cluster.catalog.models:
            known = ", ".join(sorted(self.cluster.catalog.models)) or "none"
            raise Refused(404, f"no model {model!r} in the catalog in force (models: {known})")
        return model

    async def _undo_rollout(self, request: Request, identity: Identity, params: dict[str, str]) -> Response:
        model = params["model"]
        async with self._lock:
            self._known_model(model)
            revision = self.cluster.catalog_revision - 1
            stored = await self.store.run(lambda conn: catalog_revision(conn, revision))
            if stored is None:
                raise Refused(409, f"no catalog revision before {revision + 1} to return model {model} to")
            try:
                previous = parse_catalog(stored.text, self.engines, source=f"catalog revision {revision}")
            except CatalogError as exc:
                raise Refused(409, f"cannot undo: {exc}") from None
            refusal = undo_refusal(model, self.cluster.catalog, previous, revision)
            if refusal is not None:
                raise Refused(409, f"cannot undo the rollout of {model}: {refusal}")
            author = f"{identity.name} (ctl rollout undo {model})"
            self.cluster.apply_catalog(previous, stored.text, self.clock(), author)
            await self.commit()
            applied = self.cluster.catalog_revision
        return answer(RolloutUndone(model, revision, applied, catalog_summary(previous)))


def _prune_refusal(name: str, diff: CatalogDiff) -> str:
    """Why a catalog that removes models was refused, and how to apply it anyway."""
    removed = [c for c in diff.changes if c.section == "model" and c.change == "removed"]
    listed = ", ".join(f"{c.name} ({c.stop} replica{'s' if c.stop != 1 else ''})" for c in removed)
    return (
        f"{name} removes {len(removed)} model{'s' if len(removed) != 1 else ''} that the catalog in force "
        f"(revision {diff.revision}) has: {listed}; nothing changed. To remove them and stop their replicas, "
        f'apply with --prune ("prune": true in the API); `llmgw ctl diff {name}` shows every change'
    )
