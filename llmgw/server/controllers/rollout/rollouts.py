"""Rollouts: replacing a model's outdated replicas without an outage, and stopping when that fails.

A replica runs the :class:`~llmgw.server.state.records.Launch` it was started
from; when the catalog in force asks for another command, the replica is
*outdated*. On every reconcile, :meth:`Rollouts.step` (called by
:meth:`Cluster.begin <llmgw.server.state.cluster.Cluster.begin>` after it judged
the replicas) moves each model's rollout on:

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

:meth:`Rollouts.status` is what ``ctl rollout status`` shows.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import attrs

from llmgw.models import Catalog
from llmgw.scheduler import Replica
from llmgw.server.controllers.rollout.staging import copied_bytes, stage_ahead, staging_note
from llmgw.server.state.records import Launch, ReplicaRecord
from llmgw.wire import RolloutList, RolloutStatus

if TYPE_CHECKING:
    from llmgw.server.state.cluster import Cluster

__all__ = ["FAILURES_TO_PAUSE", "Pause", "Rollouts", "undo_refusal"]

#: a replica on the new command failing this many times in a row pauses its model's rollout
FAILURES_TO_PAUSE = 3


@attrs.frozen
class Pause:
    """A paused rollout: what it was rolling to, and why it stopped."""

    #: :func:`_digest` of the command the failing replacements ran
    target: str
    #: what ``ctl rollout status`` says, and the failure it names (node, exit, log line)
    reason: str
    failure: str
    at: float


class Rollouts:
    """Every model's rollout: see the module docstring."""

    def __init__(self) -> None:
        #: model -> why its rollout paused; persisted (a setting row) so a restart does not retry it
        self.paused: dict[str, Pause] = {}
        #: model -> why its rollout waits for room (said once per reason)
        self.waiting: dict[str, str] = {}
        #: models with a rollout under way (for the start and done events)
        self.rolling: set[str] = set()
        #: model -> (outdated replicas, updated ones ready) and since when: progress is a change there
        self.progress: dict[str, tuple[tuple[int, int, int], float]] = {}
        #: model -> node id -> the new source it copies ahead of the rollout (``SyncReply.stage_sources``)
        self.staging: dict[str, dict[str, str]] = {}
        #: nodes whose sources to stage changed since the reconciler last looked (their long-polls wake)
        self.stage_changed: set[str] = set()
        #: :meth:`stage_sources`' answer, made once per step (read by every sync answer)
        self._stage_by_node: dict[str, tuple[str, ...]] = {}

    # -- the reconciler's step ------------------------------------------------------------------

    def step(self, cluster: Cluster, now: float) -> list[str]:
        """Move every model's rollout one step (see the module docstring); called by ``Cluster.begin``.

        :returns: ids of outdated replicas to give a replacement now (the scheduler's ``roll=``).
        """
        by_model: dict[str, list[ReplicaRecord]] = {}
        for record in list(cluster.replicas.values()):
            original = record.placement.replaces
            if original is not None and record.state == "ready" and original in cluster.replicas:
                self._retire(cluster, original, record, now)
        for record in cluster.replicas.values():
            by_model.setdefault(record.placement.model, []).append(record)
        rolls: list[str] = []
        before = self._stage_by_node
        self.staging = {}
        for model in sorted(by_model):
            wanted = Launch.of(cluster.catalog, model)
            if wanted is not None:
                rolls += self._step_model(cluster, model, wanted, by_model[model], now)
        for model in set(self.paused) - set(by_model):
            del self.paused[model]
        after = self._stage_by_node = self._by_node()
        self.stage_changed |= {n for n in before.keys() | after.keys() if before.get(n) != after.get(n)}
        return rolls

    def stage_sources(self) -> dict[str, tuple[str, ...]]:
        """Node id -> the sources it should copy ahead of the rollouts under way (its sync answer's)."""
        return self._stage_by_node

    def _by_node(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, set[str]] = {}
        for stage in self.staging.values():
            for node_id, source in stage.items():
                out.setdefault(node_id, set()).add(source)
        return {node_id: tuple(sorted(sources)) for node_id, sources in out.items()}

    def take_stage_changed(self) -> set[str]:
        """The nodes whose sources to stage changed since the last call (the reconciler wakes them)."""
        changed, self.stage_changed = self.stage_changed, set()
        return changed

    def _step_model(
        self, cluster: Cluster, model: str, wanted: Launch, records: list[ReplicaRecord], now: float
    ) -> list[str]:
        target = _digest(wanted)
        pause = self.paused.get(model)
        if pause is not None and pause.target != target:
            del self.paused[model]
            cluster.record_event(now, "rollout", model, "resumed: the catalog asks for another command")
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
            self._pause(cluster, model, target, "its replacements keep failing", failure, records, now)
            return []
        stalled = self._stalled(cluster, model, wanted, records, outdated, now)
        if stalled is not None:
            why = f"no replica replaced within its progress_deadline ({wanted.profile.progress_deadline:g} s)"
            self._pause(cluster, model, target, why, stalled, records, now)
            return []
        for record in outdated:
            if record.state != "ready":
                self._restart(cluster, record, wanted, now, "not serving: restarted on the new command")
        outdated = [r for r in outdated if r.state == "ready" and r.placement.replaces is None]
        if not outdated:
            if model in self.rolling:
                self.rolling.discard(model)
                self.waiting.pop(model, None)
                cluster.record_event(
                    now,
                    "rollout",
                    model,
                    f"done: every replica runs catalog revision {cluster.catalog_revision}",
                )
            return []
        rollout = cluster.catalog.models[model].rollout
        if model not in self.rolling:
            self.rolling.add(model)
            cluster.record_event(
                now,
                "rollout",
                model,
                f"started: {len(outdated)} outdated replica(s) to replace "
                f"(max_surge {rollout.max_surge}, max_unavailable {rollout.max_unavailable})",
            )
        stage, copying = stage_ahead(cluster, wanted, outdated)
        if stage:
            self.staging[model] = stage
        moving = {r.placement.replaces for r in replacements}
        candidates = sorted((r for r in outdated if r.id not in moving), key=lambda r: r.placement.index)
        unavailable = sum(r.state != "ready" for r in records if r.placement.replaces is None)
        restartable = [r for r in candidates if r.id not in copying]
        in_place = restartable[: max(0, rollout.max_unavailable - unavailable)]
        for record in in_place:
            self._restart(
                cluster, record, wanted, now, "restarted in place on the new command (max_unavailable)"
            )
        restarted = {r.id for r in in_place}
        candidates = [r for r in candidates if r.id not in restarted]
        surge = candidates[: max(0, rollout.max_surge - len(replacements))]
        self._note_waiting(cluster, model, {r.id for r in candidates}, rollout.max_unavailable, now)
        if model in self.waiting and not cluster.schedule_wanted:
            return []  # nothing changed that could make room
        return [r.id for r in surge]

    def _note_waiting(
        self, cluster: Cluster, model: str, candidates: set[str], max_unavailable: int, now: float
    ) -> None:
        """Say (once per reason) that replacements find no room, and why; forget it once they do."""
        stuck = next((u for u in cluster.unplaced if u.replaces in candidates), None)
        if stuck is None:
            self.waiting.pop(model, None)
            return
        reason = (
            f"no room to place a replacement beside the outdated replicas: {stuck.reason}; "
            f"max_unavailable is {max_unavailable}, so no serving replica is stopped first"
        )
        if self.waiting.get(model) != reason:
            self.waiting[model] = reason
            cluster.record_event(now, "rollout", model, f"waits: {reason}")

    def _restart(self, cluster: Cluster, record: ReplicaRecord, launch: Launch, now: float, why: str) -> None:
        """Run ``launch`` on ``record``'s placement as a new attempt (a failed one rebuilds on it)."""
        if record.launch is not None and record.launch != launch:
            record.rolled_from = record.launch
        record.launch = launch
        if record.state != "backoff":
            record.attempt = cluster.new_attempt()
            record.state = "starting"
            record.started_at = now
            record.sent_revision = 0
            record.ready_since = None
        record.consecutive_failures = 0
        cluster.dirty_replicas.add(record.id)
        if why:
            cluster.record_event(now, "replica", record.id, f"outdated, {why}")

    def _retire(self, cluster: Cluster, original: str, replacement: ReplicaRecord, now: float) -> None:
        del cluster.replicas[original]
        cluster.dirty_replicas.add(original)
        replacement.placement = attrs.evolve(replacement.placement, replaces=None)
        cluster.dirty_replicas.add(replacement.id)
        cluster.schedule_wanted = True
        cluster.record_event(
            now, "replica", original, f"replaced: {replacement.id} is ready, stopping the original"
        )

    def _stalled(
        self,
        cluster: Cluster,
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
        old = {r.id for r in outdated}
        updated = [r for r in records if r.id not in old]
        mark = (len(outdated), sum(r.state == "ready" for r in updated), copied_bytes(cluster, wanted))
        seen = self.progress.get(model)
        if not outdated or model in self.waiting or seen is None or seen[0] != mark:
            self.progress[model] = (mark, now)
            return None
        deadline = wanted.profile.progress_deadline
        if deadline is None or now - seen[1] < deadline:
            return None
        waiting = [r for r in updated if r.state != "ready"]
        if not waiting:
            return f"no replacement started in {now - seen[1]:.0f} s"
        slow = waiting[0]
        state = f"{slow.state} ({slow.reason})" if slow.reason else slow.state
        return f"{slow.id} is still {state} after {now - slow.started_at:.0f} s"

    def _pause(
        self,
        cluster: Cluster,
        model: str,
        target: str,
        why: str,
        failure: str,
        records: list[ReplicaRecord],
        now: float,
    ) -> None:
        """Pause ``model``'s rollout: stop its replacements not ready, put replicas restarted in place
        and not ready back on the command they ran before."""
        self.progress.pop(model, None)
        reason = (
            f"paused: {why}; the outdated replicas keep serving. "
            f"Apply a fixed catalog to resume, or `llmgw ctl rollout undo {model}`"
        )
        self.paused[model] = Pause(target, reason, failure, now)
        self.waiting.pop(model, None)
        cluster.record_event(now, "rollout", model, f"{reason}. Failed: {failure}")
        for record in records:
            if record.state == "ready":
                continue
            if record.placement.replaces is not None:
                del cluster.replicas[record.id]
                cluster.dirty_replicas.add(record.id)
            elif record.rolled_from is not None:
                self._restart(cluster, record, record.rolled_from, now, "")
                record.rolled_from = None
                back = "back on the command it ran before the rollout, which paused"
                cluster.record_event(now, "replica", record.id, back)
        cluster.schedule_wanted = True

    def launch_for(self, cluster: Cluster, placement: Replica) -> Launch | None:
        """What a replica just placed runs; called by the reconciler as it records a new placement.

        The catalog's command, except for a drain's replacement of an outdated
        replica while its model's rollout is paused: that one runs what its
        original runs (the catalog's command is the one that kept failing), when
        the placement has the original's shape.
        """
        wanted = Launch.of(cluster.catalog, placement.model)
        original = cluster.replicas.get(placement.replaces) if placement.replaces else None
        if placement.model not in self.paused or original is None or original.launch is None:
            return wanted
        own = original.launch
        shape = (len(placement.shards), len(placement.shards[0].gpus))
        if shape != (own.profile.nodes, own.profile.gpus_per_node) or not cluster.is_outdated(original):
            return wanted
        return own

    # -- what it shows --------------------------------------------------------------------------

    def status(self, cluster: Cluster, model: str | None = None) -> RolloutList:
        """Each model's rollout (or ``model``'s only) for ``ctl rollout status`` and ``ctl replicas``."""
        by_model: dict[str, list[ReplicaRecord]] = {name: [] for name in cluster.catalog.models}
        for record in cluster.replicas.values():
            if record.placement.model in by_model:
                by_model[record.placement.model].append(record)
        out = []
        for name in sorted(by_model):
            if model is not None and name != model:
                continue
            records = by_model[name]
            counted = [r for r in records if r.placement.replaces is None]
            outdated = sum(cluster.is_outdated(r) for r in counted)
            updated = sum(r.state == "ready" and not cluster.is_outdated(r) for r in counted)
            pause = self.paused.get(name)
            if pause is not None:
                state, reason = "paused", pause.reason
            elif not outdated:
                state, reason = "done", None
            elif name in self.waiting:
                state, reason = "waiting", self.waiting[name]
            elif name in self.staging:
                state, reason = "staging", staging_note(cluster, self.staging[name])
            else:
                state, reason = "rolling", None
            rollout = cluster.catalog.models[name].rollout
            out.append(
                RolloutStatus(
                    model=name,
                    state=state,
                    revision=cluster.catalog_revision,
                    replicas=len(counted),
                    updated=updated,
                    outdated=outdated,
                    max_surge=rollout.max_surge,
                    max_unavailable=rollout.max_unavailable,
                    reason=reason,
                    failure=pause.failure if pause is not None else None,
                )
            )
        return RolloutList(tuple(out))

    # -- persistence ----------------------------------------------------------------------------

    def saved(self) -> dict[str, list[Any]]:
        """The paused rollouts as a setting value (JSON)."""
        return {m: [p.target, p.reason, p.failure, p.at] for m, p in sorted(self.paused.items())}

    def load(self, value: dict[str, list[Any]]) -> None:
        """Restore the paused rollouts from :meth:`saved`'s value, as the server starts."""
        self.paused = {m: Pause(*fields) for m, fields in value.items()}


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
