"""Rollouts: replacing a model's outdated replicas without an outage, and stopping when that fails.

A replica runs the :class:`~llmgw.server.state.records.Launch` it was started
from; when the catalog in force asks for another command, the replica is
*outdated*. On every reconcile, :func:`step` (called by the reconciler
after the replicas were judged) moves each model's rollout on:

- a replacement that is ready retires the replica it replaces (its shards
  stop, rank 0 first);
- outdated replicas that serve nothing (starting, or failed and waiting to
  be rebuilt) are restarted in place on the new command at once;
- up to the model's ``rollout.max_surge`` replacements are placed beside the
  outdated replicas (the scheduler's ``roll=``, which may use the same nodes),
  each ready before its original stops; with no room for one, the rollout
  *waits* and says why;
- a new distributable source is copied to the nodes of the outdated
  replicas first (:mod:`llmgw.server.controllers.rollout.staging`), while they serve;
- up to ``rollout.max_unavailable`` outdated replicas that serve, and whose
  nodes hold the new weights, are restarted in place (they serve nothing
  until ready again);
- a replica on the new command (a replacement, or one restarted in place)
  that fails :data:`FAILURES_TO_PAUSE` times in a row (a failure is an exit,
  a failed health check, or its ready timeout) *pauses* the rollout: the
  failing replacements are stopped, the outdated replicas go on serving,
  and nothing more is replaced until the catalog asks for another command
  for the model (a fixed catalog, or ``ctl rollout undo``).

What it decided is recorded in :class:`~llmgw.server.state.rollouts.RolloutBook`;
``ctl rollout status`` shows it (:mod:`llmgw.server.views.rollouts`).
"""

from __future__ import annotations

import hashlib

from llmgw.models import Catalog
from llmgw.scheduler import Replica
from llmgw.server.controllers.rollout.staging import copied_bytes, stage_ahead
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import EventKind, Launch, ReplicaRecord, ReplicaState
from llmgw.server.state.rollouts import Pause

__all__ = ["FAILURES_TO_PAUSE", "step", "launch_for", "undo_refusal"]

#: a replica on the new command failing this many times in a row pauses its model's rollout
FAILURES_TO_PAUSE = 3


def step(cluster: ClusterState, now: float) -> list[str]:
    """Move every model's rollout one step (see the module docstring); called by the reconciler.

    :returns: ids of outdated replicas to give a replacement now (the scheduler's ``roll=``).
    """
    book = cluster.rollouts
    by_model: dict[str, list[ReplicaRecord]] = {}
    for record in list(cluster.replicas.values()):
        original = record.placement.replaces
        if original is not None and record.state == ReplicaState.READY and original in cluster.replicas:
            message = f"replaced: {record.id} is ready, stopping the original"
            cluster.retire(original, record, now, message)
    for record in cluster.replicas.values():
        by_model.setdefault(record.placement.model, []).append(record)
    rolls: list[str] = []
    staging: dict[str, dict[str, str]] = {}
    for model in sorted(by_model):
        wanted = Launch.of(cluster.catalog, model)
        if wanted is not None:
            rolls += _step_model(cluster, model, wanted, by_model[model], staging, now)
    for model in set(book.paused) - set(by_model):
        del book.paused[model]
    book.set_staging(staging)
    return rolls


def _step_model(
    cluster: ClusterState,
    model: str,
    wanted: Launch,
    records: list[ReplicaRecord],
    staging: dict[str, dict[str, str]],
    now: float,
) -> list[str]:
    book = cluster.rollouts
    target = _digest(wanted)
    pause = book.paused.get(model)
    if pause is not None and pause.target != target:
        del book.paused[model]
        cluster.record_event(now, EventKind.ROLLOUT, model, "resumed: the catalog asks for another command")
        pause = None
    outdated = [r for r in records if cluster.is_outdated(r)]
    if pause is not None:
        return []
    replacements = [r for r in records if r.placement.replaces is not None]
    # a replica on the new command failing again and again (a replacement, or one restarted in place)
    failing = [
        r for r in records if r.consecutive_failures >= FAILURES_TO_PAUSE and not cluster.is_outdated(r)
    ]
    if failing and any(r.placement.replaces is None for r in outdated):
        last = failing[0]
        failure = f"{last.id} failed {last.consecutive_failures} times in a row, last: {last.reason}"
        _pause(cluster, model, target, "its replacements keep failing", failure, records, now)
        return []
    stalled = _stalled(cluster, model, wanted, records, outdated, now)
    if stalled is not None:
        why = f"no replica replaced within its progress_deadline ({wanted.profile.progress_deadline:g} s)"
        _pause(cluster, model, target, why, stalled, records, now)
        return []
    for record in outdated:
        if record.state != ReplicaState.READY:
            _restart(cluster, record, wanted, now, "not serving: restarted on the new command")
    outdated = [r for r in outdated if r.state == ReplicaState.READY and r.placement.replaces is None]
    if not outdated:
        if model in book.rolling:
            book.rolling.discard(model)
            book.waiting.pop(model, None)
            done = f"done: every replica runs catalog revision {cluster.catalog_revision}"
            cluster.record_event(now, EventKind.ROLLOUT, model, done)
        return []
    rollout = cluster.catalog.models[model].rollout
    if model not in book.rolling:
        book.rolling.add(model)
        cluster.record_event(
            now,
            EventKind.ROLLOUT,
            model,
            f"started: {len(outdated)} outdated replica(s) to replace "
            f"(max_surge {rollout.max_surge}, max_unavailable {rollout.max_unavailable})",
        )
    stage, copying = stage_ahead(cluster, wanted, outdated)
    if stage:
        staging[model] = stage
    moving = {r.placement.replaces for r in replacements}
    candidates = sorted((r for r in outdated if r.id not in moving), key=lambda r: r.placement.index)
    unavailable = sum(r.state != ReplicaState.READY for r in records if r.placement.replaces is None)
    restartable = [r for r in candidates if r.id not in copying]
    in_place = restartable[: max(0, rollout.max_unavailable - unavailable)]
    for record in in_place:
        _restart(cluster, record, wanted, now, "restarted in place on the new command (max_unavailable)")
    restarted = {r.id for r in in_place}
    candidates = [r for r in candidates if r.id not in restarted]
    surge = candidates[: max(0, rollout.max_surge - len(replacements))]
    _note_waiting(cluster, model, {r.id for r in candidates}, rollout.max_unavailable, now)
    if model in book.waiting and not cluster.schedule_wanted:
        return []  # nothing changed that could make room
    return [r.id for r in surge]


def _note_waiting(
    cluster: ClusterState, model: str, candidates: set[str], max_unavailable: int, now: float
) -> None:
    """Say (once per reason) that replacements find no room, and why; forget it once they do."""
    waiting = cluster.rollouts.waiting
    stuck = next((u for u in cluster.unplaced if u.replaces in candidates), None)
    if stuck is None:
        waiting.pop(model, None)
        return
    reason = (
        f"no room to place a replacement beside the outdated replicas: {stuck.reason}; "
        f"max_unavailable is {max_unavailable}, so no serving replica is stopped first"
    )
    if waiting.get(model) != reason:
        waiting[model] = reason
        cluster.record_event(now, EventKind.ROLLOUT, model, f"waits: {reason}")


def _restart(cluster: ClusterState, record: ReplicaRecord, launch: Launch, now: float, why: str) -> None:
    """Run ``launch`` on ``record``'s placement as a new attempt (a failed one rebuilds on it)."""
    cluster.start_attempt(record, now, f"outdated, {why}", launch=launch)


def _stalled(
    cluster: ClusterState,
    model: str,
    wanted: Launch,
    records: list[ReplicaRecord],
    outdated: list[ReplicaRecord],
    now: float,
) -> str | None:
    """What is stuck when ``model``'s rollout made no progress within its profile's progress_deadline.

    Progress is fewer outdated replicas, more updated ones ready, or more
    bytes of the new weights copied. A rollout waiting for room is not
    stalled (it says why it waits).
    """
    book = cluster.rollouts
    old = {r.id for r in outdated}
    updated = [r for r in records if r.id not in old]
    ready = sum(r.state == ReplicaState.READY for r in updated)
    mark = (len(outdated), ready, copied_bytes(cluster, wanted))
    seen = book.progress.get(model)
    if not outdated or model in book.waiting or seen is None or seen[0] != mark:
        book.progress[model] = (mark, now)
        return None
    deadline = wanted.profile.progress_deadline
    if deadline is None or now - seen[1] < deadline:
        return None
    waiting = [r for r in updated if r.state != ReplicaState.READY]
    if not waiting:
        return f"no replacement started in {now - seen[1]:.0f} s"
    slow = waiting[0]
    state = f"{slow.state} ({slow.reason})" if slow.reason else slow.state
    return f"{slow.id} is still {state} after {now - slow.started_at:.0f} s"


def _pause(
    cluster: ClusterState,
    model: str,
    target: str,
    why: str,
    failure: str,
    records: list[ReplicaRecord],
    now: float,
) -> None:
    """Pause ``model``'s rollout: stop its replacements not ready, put replicas restarted in place
    and not ready back on the command they ran before."""
    book = cluster.rollouts
    book.progress.pop(model, None)
    reason = (
        f"paused: {why}; the outdated replicas keep serving. "
        f"Apply a fixed catalog to resume, or `llmgw ctl rollout undo {model}`"
    )
    book.paused[model] = Pause(target, reason, failure, now)
    book.waiting.pop(model, None)
    cluster.record_event(now, EventKind.ROLLOUT, model, f"{reason}. Failed: {failure}")
    for record in records:
        if record.state == ReplicaState.READY:
            continue
        if record.placement.replaces is not None:
            cluster.remove(record.id, now, None)
        elif record.rolled_from is not None:
            back = "back on the command it ran before the rollout, which paused"
            cluster.start_attempt(record, now, back, launch=record.rolled_from, back=True)
    cluster.want_schedule()


def launch_for(cluster: ClusterState, placement: Replica) -> Launch | None:
    """What a replica just placed runs; called by the placement controller as it records a new placement.

    The catalog's command, except for a drain's replacement of an outdated
    replica while its model's rollout is paused: that one runs what its
    original runs (the catalog's command is the one that kept failing), when
    the placement has the original's shape.
    """
    wanted = Launch.of(cluster.catalog, placement.model)
    original = cluster.replicas.get(placement.replaces) if placement.replaces else None
    if placement.model not in cluster.rollouts.paused or original is None or original.launch is None:
        return wanted
    own = original.launch
    shape = (len(placement.shards), len(placement.shards[0].gpus))
    if shape != (own.profile.nodes, own.profile.gpus_per_node) or not cluster.is_outdated(original):
        return wanted
    return own


def _digest(launch: Launch) -> str:
    """A short stable name of ``launch``'s command (stored with a paused rollout)."""
    return hashlib.sha256(repr(launch.command).encode()).hexdigest()[:16]


def undo_refusal(model: str, current: Catalog, previous: Catalog, revision: int) -> str | None:
    """Why re-applying catalog ``revision`` (``previous``) would not undo just ``model``'s change.

    Called by ``ctl rollout undo MODEL`` (``POST /v1/admin/rollouts/MODEL/undo``),
    which re-applies the previous revision only when it differs from the
    catalog in force in ``model`` and the profiles no other model uses.

    :returns: the refusal for people (naming what else differs), or None when the undo may go ahead.
    """
    if model not in previous.models:
        return (
            f"model {model} is not in catalog revision {revision}; remove it with ctl apply --prune instead"
        )
    others = []
    for name in sorted((set(current.models) | set(previous.models)) - {model}):
        if current.models.get(name) != previous.models.get(name):
            others.append(f"model {name}")
    users = {m.profile for name, m in [*current.models.items(), *previous.models.items()] if name != model}
    for name in sorted(set(current.profiles) | set(previous.profiles)):
        if current.profiles.get(name) != previous.profiles.get(name) and name in users:
            others.append(f"profile {name} (used by other models)")
    if others:
        return (
            f"catalog revision {revision} also differs from the catalog in force in {', '.join(others)}; "
            "undo re-applies a whole revision, so edit the catalog "
            f"(`llmgw ctl catalog --revision {revision}` prints it) and apply it"
        )
    if (
        Launch.of(previous, model) == Launch.of(current, model)
        and previous.models[model] == current.models[model]
    ):
        return (
            f"catalog revision {revision} asks the same of model {model} as the one in force: nothing to undo"
        )
    return None
