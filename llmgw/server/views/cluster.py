"""What the cluster shows: the shards each node should run, the routes feed, the admin API's status views.

Plain functions over a :class:`~llmgw.server.state.cluster.ClusterState`:
each reads it and returns records of :mod:`llmgw.wire`, ready for
``to_json``; none changes a record (the desired shards are cached on the
state until the reconciler drops the cache).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping

import attrs

from llmgw.engine import Engine
from llmgw.models import DEFAULT_STOP_GRACE, LaunchSpec
from llmgw.scheduler import node_warnings
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import NodeRecord, ReplicaRecord, ReplicaState
from llmgw.server.views.adapters import adapter_routes, base_request_fields, lora_spec
from llmgw.server.views.rollouts import rollout_status
from llmgw.weights import adapter_sources
from llmgw.wire import (
    DesiredShard,
    DrainStatus,
    KeyLimits,
    NodeList,
    NodeStatus,
    ObservedShard,
    ReplicaList,
    ReplicaStatus,
    Route,
    RouteTable,
    ShardStatus,
    StagingProgress,
    UnplacedStatus,
    shard_key,
)

__all__ = [
    "EXPIRY_WARNING_DAYS",
    "desired",
    "desired_for",
    "route_table",
    "node_state",
    "node_list",
    "certificate_warning",
    "drain_status",
    "replica_list",
    "replica_counts",
]

#: a node certificate that expires within this many days gets a warning in ``ctl nodes``
EXPIRY_WARNING_DAYS = 30


# -- what agents run ---------------------------------------------------


def desired(state: ClusterState) -> dict[str, tuple[DesiredShard, ...]]:
    """Node id -> the shards it should run now."""
    if state.desired_cache is None:
        out: dict[str, list[DesiredShard]] = {node_id: [] for node_id in state.nodes}
        old, memo = state.shards_memo, {}
        for record in sorted(state.replicas.values(), key=lambda r: r.id):
            if record.state == ReplicaState.BACKOFF:
                continue
            key = _shards_key(state, record)
            built = old.get(record.id)
            if built is None or built[0] != key:
                built = (key, list(_desired_shards(state, record)))
            memo[record.id] = built
            for shard in built[1]:
                out.setdefault(shard.node_id, []).append(shard.desired)
        state.shards_memo = memo
        for node_id, held in state.stopping.shards():
            out.setdefault(node_id, []).append(held)
        state.desired_cache = {k: tuple(v) for k, v in out.items()}
    return state.desired_cache


def _shards_key(state: ClusterState, record: ReplicaRecord) -> tuple:
    """Everything :meth:`_desired_shards` reads for ``record``: when equal, its shards are too."""
    nodes = tuple(
        (node.address, node.facts.fabrics) if node is not None else None
        for node in (state.nodes.get(node_id) for node_id in record.placement.node_ids)
    )
    return (record.attempt, record.placement, state.launch_of(record), nodes)


def desired_for(state: ClusterState, node_id: str) -> tuple[DesiredShard, ...]:
    """The shards ``node_id`` should run now."""
    return desired(state).get(node_id, ())


def stage_for(
    state: ClusterState, stage: tuple[str, ...], shards: tuple[DesiredShard, ...]
) -> tuple[str, ...]:
    """What a node should copy with no shard of its own (its sync answer's ``stage_sources``): ``stage``
    (ahead of a rollout) and the distributable LoRA adapters of the models of ``shards``, the shards it
    runs, staged there ahead of any load (:func:`llmgw.weights.adapter_sources`).

    Depends only on the catalog and the shards: the sync answer's cache needs no key of its own for it.
    """
    adapters = adapter_sources(state.catalog, (s.model for s in shards if not s.stop_after_rank0))
    return tuple(sorted({*stage, *adapters})) if adapters else stage


def _desired_shards(state: ClusterState, record: ReplicaRecord) -> Iterable[_NodeShard]:
    placement = record.placement
    launch = state.launch_of(record)
    if launch is None:
        return []
    model, profile = launch.model, launch.profile
    rank0 = placement.rank0
    rank0_node = state.nodes.get(rank0.node_id)
    if rank0_node is None:
        return []
    dist_init = f"{rank0_node.address}:{rank0.dist_init_port}" if len(placement.shards) > 1 else None
    addresses = [state.nodes[s.node_id].address if s.node_id in state.nodes else "" for s in placement.shards]
    shards = []
    for shard in placement.shards:
        node = state.nodes.get(shard.node_id)
        if node is None:
            continue
        adapters: tuple[str, ...] = ()
        if placement.fabric is not None:
            fabric = next((f for f in node.facts.fabrics if f.name == placement.fabric), None)
            adapters = fabric.adapters if fabric else ()
        spec = LaunchSpec(
            model_source=model.source,
            served_name=model.served_name or placement.model,
            host=node.address,
            port=shard.port,
            gpus=shard.gpus,
            rank=shard.rank,
            nnodes=len(placement.shards),
            dist_init_addr=dist_init,
            peer_addrs=[f"{a}:{s.port}" for a, s in zip(addresses, placement.shards, strict=True)],
            adapters=adapters,
            extra_args=profile.args,
            lora=lora_spec(model, profile),
        )
        desired = DesiredShard(
            replica_id=placement.id,
            attempt=record.attempt,
            rank=shard.rank,
            model=placement.model,
            engine=profile.engine,
            spec=spec,
            sidecars=profile.sidecars,
            ready_timeout=profile.ready_timeout or state.settings.ready_timeout,
            stop_grace=DEFAULT_STOP_GRACE if profile.stop_grace is None else profile.stop_grace,
        )
        shards.append(_NodeShard(shard.node_id, desired))
    return shards


# -- the routes feed -----------------------------------------------------


def route_table(
    state: ClusterState,
    keys: Mapping[str, str] | None = None,
    limits: Mapping[str, KeyLimits] | None = None,
    engines: Mapping[str, Engine] | None = None,
) -> RouteTable:
    """The routes feed's answer: every served model, the ready replicas of each, those that wake on demand,
    ``keys`` and their ``limits``.

    Called for every ``GET /v1/routes``. ``keys`` maps the sha256 hex of
    each API key in force to its name (None: the feed says nothing of keys);
    ``limits`` maps a key's name to its limits (keys not named are unlimited).
    A replica's route says whether it ``continues`` a final assistant message, as its engine
    (among ``engines``) answers for the version its rank 0's node reported and its profile's args; the
    feed's ``base_fields`` give the base-model request fields of replicas whose engine wants some.
    """
    routes: dict[str, list[Route]] = {}
    base_fields: dict[str, dict[str, object]] = {}
    for record in sorted(state.replicas.values(), key=lambda r: r.id):
        if record.state != ReplicaState.READY:
            continue
        launch = state.launch_of(record)
        node = state.nodes.get(record.placement.rank0.node_id)
        if launch is None or node is None:
            continue
        name = launch.model.served_name or record.placement.model
        engine = (engines or {}).get(launch.profile.engine)
        continues = engine is not None and engine.continues_final_message(
            node.facts.engines.get(launch.profile.engine), launch.profile.args
        )
        routes.setdefault(name, []).append(
            Route(record.id, f"http://{node.address}:{record.placement.rank0.port}", continues)
        )
        fields = base_request_fields(state, record, engines)
        if fields:
            base_fields[record.id] = fields
    models = {state.catalog.served_name(m) for m in state.catalog.models}
    wake = {
        state.catalog.served_name(name)
        for name, model in state.catalog.models.items()
        if model.autoscale is not None and model.autoscale.min == 0
    }
    return RouteTable(
        revision=state.routes_revision,
        generation=state.routes_generation,
        models=models,
        routes=routes,
        keys=keys,
        limits=limits or {},
        wake_on_demand=wake,
        adapters=adapter_routes(state, engines),
        base_fields=base_fields,
    )


# -- the admin API's views ---------------------------------------------


def node_state(node: NodeRecord) -> str:
    """``draining``, or the node's own state (``ready``, ``cordoned``, ``lost``)."""
    return "draining" if node.draining else node.state


def node_list(
    state: ClusterState, now: float, revoked: Callable[[int], bool] = lambda serial: False
) -> NodeList:
    """Every node for ``ctl nodes``: GPUs free, replicas, warnings (certificate first).

    :param revoked: whether a certificate serial is revoked (the server's revocation list).
    """
    on_node: dict[str, list[ReplicaRecord]] = {}
    for record in state.replicas.values():
        for node_id in set(record.placement.node_ids):
            on_node.setdefault(node_id, []).append(record)
    return NodeList(
        tuple(
            _node_status(state, node, on_node.get(node.node_id, []), now, revoked)
            for node in sorted(state.nodes.values(), key=lambda n: n.node_id)
        )
    )


def _node_status(
    state: ClusterState,
    node: NodeRecord,
    on_node: list[ReplicaRecord],
    now: float,
    revoked: Callable[[int], bool],
) -> NodeStatus:
    used = sum(len(s.gpus) for r in on_node for s in r.placement.shards if s.node_id == node.node_id)
    is_revoked = node.cert_serial is not None and revoked(node.cert_serial)
    certificate = certificate_warning(node, now, is_revoked)
    warnings = ([certificate] if certificate else []) + list(node_warnings(node.view(), state.catalog))
    if node.node_id in state.spared:
        warnings.append(
            f"no sync for {now - node.last_seen:.0f} s, not declared lost: many nodes stopped syncing "
            f"at once (ctl events); `llmgw ctl nodes lost {node.node_id}` if it is gone"
        )
    return NodeStatus(
        node_id=node.node_id,
        address=node.address,
        state="revoked" if is_revoked else node_state(node),
        gpus_total=len(node.facts.gpus),
        gpus_free=max(0, len(node.facts.gpus) - used),
        fabrics=tuple(f.name for f in node.facts.fabrics),
        engines=dict(node.facts.engines),
        agent_version=node.facts.agent_version,
        replicas=tuple(sorted(r.id for r in on_node)),
        warnings=tuple(warnings),
        last_sync_ago=round(now - node.last_seen, 1),
        gpu_models=dict(Counter(g.name for g in node.facts.gpus)),
        fabric_adapters={f.name: f.adapters for f in node.facts.fabrics},
        models_free_bytes=node.facts.models_free_bytes,
        copies=sum(not c.seed for c in node.facts.model_copies),
    )


def certificate_warning(node: NodeRecord, now: float, revoked: bool) -> str | None:
    """What to tell the operator about the node's certificate: revoked, or expiring soon; None if fine."""
    if revoked:
        return f"certificate {node.cert_serial:x} is revoked: the node can no longer sync"
    if node.cert_not_after is None:
        return None
    days = (node.cert_not_after - now) / 86400
    if days >= EXPIRY_WARNING_DAYS:
        return None
    return (
        f"certificate expires in {days:.0f} days; issue a new one "
        f"(llmgw ca issue-node {node.node_id} --force)"
    )


def drain_status(state: ClusterState, node_id: str) -> DrainStatus:
    """How draining ``node_id`` goes: replicas left on it, those moving, replacements stuck and why."""
    node = state.nodes[node_id]
    remaining = sorted(
        r.id for r in state.replicas.values() if node_id in r.placement.node_ids and not r.placement.replaces
    )
    moving = sorted(
        r.placement.replaces for r in state.replicas.values() if r.placement.replaces in remaining
    )
    stuck = [f"{u.id}: {u.reason}" for u in state.unplaced if u.replaces in remaining]
    return DrainStatus(
        node_id=node_id,
        state=node_state(node),
        remaining=tuple(remaining),
        moving=tuple(moving),
        stuck=tuple(stuck),
    )


def replica_list(state: ClusterState) -> ReplicaList:
    """Every replica, its shards as agents observe them, and what cannot be placed (``ctl replicas``)."""
    replicas = tuple(_replica_status(state, r) for r in sorted(state.replicas.values(), key=lambda r: r.id))
    unplaced = tuple(UnplacedStatus(u.id, u.model, u.reason, u.replaces) for u in state.unplaced)
    rollouts = rollout_status(state).rollouts
    return ReplicaList(replicas, unplaced, state.catalog_revision, rollouts)


def replica_counts(state: ClusterState) -> dict[str, int]:
    """Model -> its replicas that exist (placed; a drain's replacements not counted), for ``ctl diff``."""
    counts: dict[str, int] = {}
    for record in state.replicas.values():
        if not record.placement.replaces:
            counts[record.placement.model] = counts.get(record.placement.model, 0) + 1
    return counts


def _replica_status(state: ClusterState, record: ReplicaRecord) -> ReplicaStatus:
    shards = []
    staged: list[ObservedShard] = []
    for shard in record.placement.shards:
        node = state.nodes.get(shard.node_id)
        observed = None
        # "unknown" until the node's agent reported (after a restart; always on a standby)
        missing = "unknown" if node is not None and not node.reported else "pending"
        if node is not None:
            observed = node.observed.get(shard_key(record.id, record.attempt, shard.rank))
        if observed is not None and observed.state == "staging":
            staged.append(observed)
        shards.append(
            ShardStatus(
                rank=shard.rank,
                node=shard.node_id,
                gpus=tuple(shard.gpus),
                port=shard.port,
                state=observed.state if observed else missing,
                pid=observed.pid if observed else None,
                detail=observed.detail if observed else None,
                argv=observed.argv if observed else (),
                env=observed.env if observed else {},
                log_path=observed.log_path if observed else None,
                engine_version=observed.engine_version if observed else None,
            )
        )
    staging, eta = _staging(staged) if staged and record.state == ReplicaState.STARTING else (None, None)
    return ReplicaStatus(
        id=record.id,
        model=record.placement.model,
        state="staging" if staged and record.state == ReplicaState.STARTING else str(record.state),
        attempt=record.attempt,
        failures=record.failures,
        reason=record.reason,
        fabric=record.placement.fabric,
        replaces=record.placement.replaces,
        shards=tuple(shards),
        outdated=state.is_outdated(record),
        staging=staging,
        eta=eta,
    )


def _staging(shards: list[ObservedShard]) -> tuple[StagingProgress | None, float | None]:
    """A staging replica's copies summed (bytes, rate), and the slowest shard's seconds left."""
    progress = [s.staged for s in shards if s.staged is not None]
    if not progress:
        return None, None
    total = StagingProgress(
        sum(p.bytes_present for p in progress),
        sum(p.bytes_total for p in progress),
        sum(p.rate for p in progress),
    )
    etas = [p.eta for p in progress]
    eta = None if len(progress) < len(shards) or None in etas else max(e for e in etas if e is not None)
    return total, eta


@attrs.frozen
class _NodeShard:
    node_id: str
    desired: DesiredShard
