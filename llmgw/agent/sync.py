"""The agent's loop with the server: report facts and shards, apply the shards it should run.

One call carries it all (DESIGN.md, "Agent protocol"): :class:`Agent` posts a
:class:`~llmgw.wire.SyncRequest` and applies the :class:`~llmgw.wire.SyncReply`
whenever its revision moved: a supervisor starts for every desired shard not
running, every running shard no longer desired is stopped. A desired shard
marked ``stop_after_rank0`` (a worker of a replica whose rank 0 is stopping
with its grace) is left running as it is, and never started.

What the server relies on: after a reply is applied, every shard it names
is in ``observed`` (``starting`` at least) until the server stops wanting it;
its entry is made as the reply is applied, before the next sync.

A local change (a shard's state, the node's facts) cancels the long-poll in
flight and syncs at once. While the server is unreachable (or answers 5xx)
every shard keeps running and the agent retries with exponential backoff and
jitter, logging once per outage; while it refuses this node (401/403) the
agent logs the server's message and retries slowly. Nothing is restarted when
the server comes back: it adopts what runs.

Two refusals fence the node instead: the server saying this node's
certificate is revoked, and the certificate's own expiry (read at start). The
agent then stops every shard at once (the server rebuilds them elsewhere) and
logs why; it keeps retrying, and runs what the server asks again once a sync
is accepted (a re-onboarded node comes back). A certificate rewritten on disk
(re-onboarding, renewal) is used from the next sync on, without a restart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import httpx
import trio

from llmgw import wire
from llmgw.agent.adoption import AdoptedShard, previous_exits
from llmgw.agent.blocking import blockers_of
from llmgw.agent.config import AgentConfig
from llmgw.agent.credentials import Credentials
from llmgw.agent.facts import with_weights
from llmgw.agent.lora import AdapterLoader, rank0_of
from llmgw.agent.models_dir import ModelsDir
from llmgw.agent.process import Child
from llmgw.agent.records import ProcessRecords
from llmgw.agent.replies import describe, error_type, server_message
from llmgw.agent.supervisor import ShardSupervisor
from llmgw.engine import Engine
from llmgw.models import NodeFacts
from llmgw.serverlist import NotLeaderAnswer, ServerList, raise_for_standby
from llmgw.wire import DesiredShard, ObservedShard, SyncReply, SyncRequest, WireError, from_json, to_json

__all__ = ["Agent"]

log = logging.getLogger("llmgw.agent")


class _Unreachable(Exception):
    """The server could not be reached, or failed (5xx): retry with backoff."""


class _Refused(Exception):
    """The server answered, and refused (4xx): retry slowly; ``revoked``: fence the node too."""

    def __init__(self, message: str, *, revoked: bool = False) -> None:
        super().__init__(message)
        self.revoked = revoked


class Agent:
    """One node's agent: its shards, its facts, and its loop with the server.

    Made by :func:`llmgw.agent.serve_agent`, which hands it to
    ``task_status.started``; tests read :attr:`observed` and :attr:`facts`.
    """

    def __init__(
        self,
        config: AgentConfig,
        engines: Mapping[str, Engine],
        facts: NodeFacts,
        records: ProcessRecords,
        ssl_context: Any,
    ) -> None:
        self.config = config
        self.engines = dict(engines)
        self.facts = facts
        self.records = records
        #: the certificate and key syncs use, reloaded when they change on disk
        self.credentials = Credentials(config.node, config.cert, config.key, config.ca, ssl_context)
        #: shard key -> what this agent reports for it
        self.observed: dict[str, ObservedShard] = {}
        self.supervisors: dict[str, ShardSupervisor] = {}
        #: the revision of the last reply applied; 0 until the first
        self.revision = 0
        #: model sources the server last asked about
        self.check_sources: tuple[str, ...] = ()
        #: the sources the current facts' model_sources were checked against
        self.sources_checked: tuple[str, ...] = ()
        #: set when the server answered at least once since start
        self.connected = trio.Event()
        self._changed = trio.Event()
        self._sources_changed = trio.Event()
        #: where shard supervisors run; set by :meth:`run`
        self.shards_nursery: trio.Nursery | None = None
        #: why the node is fenced (every shard stopped, replies not applied), or None
        self.fenced: str | None = None
        #: this agent process's id in every sync: the server tells a restarted agent by a new one
        self.instance = secrets.token_hex(8)
        #: ``async (source, progress) -> local path`` for distributable sources (None: not staged)
        self.stage: Any = None
        #: copies the server asks for ahead of any shard (:mod:`llmgw.agent.prestage`); None: none made
        self.prestage: Any = None
        #: the agent's metrics (:class:`llmgw.agent.metrics.AgentMetrics`), if served
        self.metrics: Any = None
        #: trio time of the last answer from the server (None: none yet)
        self.last_sync: float | None = None
        #: the share of a model's size eviction keeps free beyond its copy (the server's setting)
        self.disk_headroom = 0.05
        #: the server's ``lost_after`` from its last answer: retries while it is unreachable come at least
        #: four times within it, so a node is never declared lost for sleeping through the server's return
        self.server_lost_after: float | None = None
        #: supervisors of adopted shards, started by :meth:`run`
        self._adopted: list[ShardSupervisor] = []
        #: the LoRA adapters of the replicas whose rank 0 runs here, loaded on the server's word
        self.adapters = AdapterLoader(rank0_of(self.supervisors), self.notify)

    # -- local state ---------------------------------------------------------------------------------

    def notify(self) -> None:
        """Something local changed: sync now (cancels the long-poll in flight)."""
        self._changed.set()
        self._changed = trio.Event()
        self.adapters.poke()

    def report_previous(self, shard_records: list[dict[str, Any]]) -> None:
        """Report the shards an earlier agent ran and this one could not adopt as ``exited``."""
        for shard in previous_exits(shard_records, self.records):
            self.observed[shard.key] = shard
            log.info("shard %s was running under the previous agent: reporting it exited", shard.key)

    def adopt(self, adopted: list[AdoptedShard]) -> None:
        """Take over the shards an earlier agent left running; :meth:`run` watches them from its start.

        They are reported ``running`` from the first sync on: the same shard, the same attempt.
        """
        for shard in adopted:
            supervisor = self._supervisor(shard.desired, shard.engine_version)
            supervisor.adopt(shard)
            self.observed[supervisor.key] = supervisor.observed
            self._record_shard(supervisor)
            self._adopted.append(supervisor)

    def detach(self) -> int:
        """Leave every shard running when the agent stops: their launchers keep them for the next agent.

        :returns: how many shards are left running.
        """
        for supervisor in self.supervisors.values():
            supervisor.detach()
        return len(self.supervisors)

    def set_facts(self, facts: NodeFacts) -> None:
        """Report new facts at the next sync (at once, when they changed)."""
        if facts != self.facts:
            self.facts = facts
            self.notify()

    async def refresh_weights(self, sources: tuple[str, ...] | None = None) -> None:
        """Look at the models directory again (sources present, copies, free bytes): a copy moved on."""
        asked = self.check_sources if sources is None else sources
        models = ModelsDir(self.config.models_dir, self.config.seed_root)
        self.set_facts(await with_weights(self.facts, models, asked))

    def _report(self, key: str, observed: ObservedShard) -> None:
        if key in self.supervisors:
            supervisor = self.supervisors[key]
            if self.metrics is not None:
                self.metrics.shard_changed(supervisor, self.observed.get(key), observed)
            before = self.observed.get(key)
            self.observed[key] = observed
            if observed.state == "running" and (before is None or before.state != "running"):
                self._record_shard(supervisor)  # what the next agent adopts: its command, its copy
            self.notify()

    def _record_shard(self, supervisor: ShardSupervisor) -> None:
        """Write shard ``supervisor``'s record: what a later agent needs to adopt it."""
        shard, observed = supervisor.desired, supervisor.observed
        self.records.add_shard(supervisor.key, {
            "replica_id": shard.replica_id, "attempt": shard.attempt, "rank": shard.rank,
            "port": shard.spec.port, "agent_pid": os.getpid(), "desired": wire.to_json(shard),
            "observed": wire.to_json(observed), "engine_version": observed.engine_version,
        })  # fmt: skip

    def _supervisor(self, shard: DesiredShard, engine_version: str | None) -> ShardSupervisor:
        """A supervisor for ``shard`` reporting to this agent (not started), made known to it."""
        key = shard.key
        supervisor = ShardSupervisor(
            shard,
            self.engines.get(shard.engine),
            self.config,
            lambda observed, key=key: self._report(key, observed),
            on_spawn=lambda child, key=key: self._on_spawn(key, child),
            on_gone=self._on_gone,
            engine_version=engine_version,
        )
        if self.metrics is not None:
            supervisor.on_canary = partial(self.metrics.canary, supervisor)
            self.metrics.started(supervisor)
        self.supervisors[key] = supervisor
        return supervisor

    def _on_spawn(self, key: str, child: Child) -> None:
        if child.pgid is not None:
            self.records.add_group(child.pgid, key, child.name, socket=child.socket, sidecar=child.sidecar)

    def _on_gone(self, child: Child) -> None:
        if child.pgid is not None:
            self.records.remove_group(child.pgid)

    def fence(self, reason: str) -> None:
        """Stop every shard: the server no longer trusts this node (``reason``). Logged once per reason.

        Replies are applied again (from scratch) once a sync is accepted.
        """
        if self.fenced == reason:
            return
        self.fenced = reason
        running = [s for s in self.supervisors.values() if s.observed.state != "stopping"]
        stopping = f"stopping its {len(running)} shards" if running else "no shard left to stop"
        log.error("fencing node %s: %s; %s", self.config.node, reason, stopping)
        for supervisor in running:
            supervisor.stop()
        self.revision = 0

    # -- applying a reply ------------------------------------------------------------------------

    def apply(self, reply: SyncReply) -> None:
        """Start every desired shard not running, stop every shard not desired; synchronous.

        Every desired shard has its ``observed`` entry when this returns.
        """
        assert self.shards_nursery is not None
        desired = {shard.key: shard for shard in reply.shards}
        for key in list(self.observed):
            if key in desired:
                continue
            supervisor = self.supervisors.get(key)
            if supervisor is None:
                del self.observed[key]
                self.records.remove_shard(key)
            elif supervisor.observed.state != "stopping":
                log.info("stopping shard %s: the server no longer wants it", key)
                supervisor.stop()
        for key, shard in desired.items():
            if key in self.observed or shard.stop_after_rank0:
                continue  # running, or a worker of a stopping replica: never started anew
            supervisor = self._supervisor(shard, self.facts.engines.get(shard.engine))
            self.observed[key] = supervisor.observed
            self._record_shard(supervisor)
            # a shard being stopped, held, or lingering may still hold a port or GPU of this one
            blockers = blockers_of(shard, self.supervisors.values())
            wait = f" once {len(blockers)} stopping shards free its ports and GPUs" if blockers else ""
            log.info(
                "starting shard %s (%s, engine %s, port %d)%s",
                key, shard.model, shard.engine, shard.spec.port, wait,
            )
            self.shards_nursery.start_soon(self._supervise, supervisor, blockers)
        self.revision = reply.revision
        self.notify()

    def note_sources(self, reply: SyncReply) -> None:
        """Remember which model sources the server asks about; refresh the facts when that changed."""
        if tuple(reply.check_sources) != self.check_sources:
            self.check_sources = tuple(reply.check_sources)
            self.records.save_check_sources(self.check_sources)
            self._sources_changed.set()

    async def _supervise(self, supervisor: ShardSupervisor, blockers: list[trio.Event]) -> None:
        try:
            await supervisor.run(after=blockers, stage=self.stage)
        except Exception as exc:  # noqa: BLE001 - one shard's failure must not end the agent
            log.exception("shard %s failed in the agent", supervisor.key)
            supervisor.fail(f"the agent could not run it: {exc}")
        finally:
            if supervisor.observed.state == "stopping":
                # stopped because the server no longer wants it: forget it
                self.supervisors.pop(supervisor.key, None)
                self.observed.pop(supervisor.key, None)
                self.records.remove_shard(supervisor.key)
                log.info("shard %s stopped", supervisor.key)
                self.notify()
            supervisor.done.set()

    # -- the loops ---------------------------------------------------------------------------------

    def request(self) -> SyncRequest:
        """The sync request for the current state."""
        return SyncRequest(
            node_id=self.config.node,
            address=self.config.address,
            facts=self.facts,
            port_range=self.config.port_range,
            observed=sorted(self.observed.values(), key=lambda s: s.key),
            revision=self.revision,
            wait=True,
            checked_sources=self.sources_checked,
            instance=self.instance,
            load=[s.load for s in self.supervisors.values() if s.load],
            adapters=self.adapters.report(),
        )

    async def run(self, shards_nursery: trio.Nursery) -> None:
        """Sync with the server forever; shards are supervised in ``shards_nursery``."""
        self.shards_nursery = shards_nursery
        for supervisor in self._adopted:
            shards_nursery.start_soon(self._supervise, supervisor, [])
        self._adopted = []
        self.adapters.stage = self.stage
        shards_nursery.start_soon(self.adapters.run)
        servers = ServerList.parse(self.config.server)
        settings = self.config.sync
        timeout = httpx.Timeout(settings.timeout, connect=min(10.0, settings.timeout))
        async with contextlib.AsyncExitStack() as clients:
            client = httpx.AsyncClient(verify=self.credentials.context, timeout=timeout)
            clients.push_async_callback(client.aclose)
            failures = 0
            outage_since: float | None = None
            refusal: str | None = None
            while True:
                if self.credentials.reload_if_changed():
                    await client.aclose()
                    client = httpx.AsyncClient(verify=self.credentials.context, timeout=timeout)
                    clients.push_async_callback(client.aclose)
                expired = self.credentials.expired()
                if expired is not None:
                    self.fence(expired)
                    await trio.sleep(settings.refused_retry)
                    continue
                server = servers.current
                try:
                    reply = await self._sync_once(client, f"{server}/v1/agent/sync")
                except NotLeaderAnswer as exc:
                    now = servers.not_leader(server, exc.leader)
                    log.info("server %s is a standby (leader: %s); syncing with %s", server, exc.leader, now)
                    await trio.sleep(random.uniform(0.05, 0.25) if exc.leader else settings.backoff_initial)
                    continue
                except _Unreachable as exc:
                    log.debug("server %s unreachable (%s); next: %s", server, exc, servers.failed(server))
                    failures += 1
                    if outage_since is None:
                        outage_since = time.monotonic()
                        log.warning(
                            "server %s unreachable: %s; keeping %d shards running, retrying with backoff",
                            self.config.server,
                            exc,
                            len(self.supervisors),
                        )
                    else:
                        log.debug("server still unreachable (try %d): %s", failures, exc)
                    delay = min(self.retry_ceiling(), settings.backoff_initial * 2 ** min(failures - 1, 30))
                    await trio.sleep(random.uniform(delay / 2, delay))
                    continue
                except _Refused as exc:
                    if str(exc) != refusal:
                        refusal = str(exc)
                        log.error("%s; retrying every %g s", exc, settings.refused_retry)
                    if exc.revoked:
                        self.fence(f"the server refuses its certificate as revoked ({exc})")
                    await trio.sleep(settings.refused_retry)
                    continue
                if reply is None:  # a local change cut the call short: no server answered, nothing learned
                    continue
                if outage_since is not None:
                    log.info(
                        "server %s reachable again after %.1f s (%d failed tries)",
                        self.config.server,
                        time.monotonic() - outage_since,
                        failures,
                    )
                if refusal is not None:
                    log.info("server %s accepts this node again", self.config.server)
                if self.fenced is not None:
                    log.info("node %s no longer fenced: running what the server asks", self.config.node)
                    self.fenced = None
                failures, outage_since, refusal = 0, None, None
                if not self.connected.is_set():
                    log.info("synced with server %s as node %s", self.config.server, self.config.node)
                self.connected.set()
                self.last_sync = trio.current_time()
                if reply.revision != self.revision:
                    self.apply(reply)
                self.adapters.update(reply.adapters)
                self.note_sources(reply)
                self.disk_headroom = reply.disk_headroom
                self.server_lost_after = reply.lost_after
                if self.prestage is not None:
                    self.prestage.update(reply.stage_sources)

    def retry_ceiling(self) -> float:
        """The longest delay between two tries while the server is unreachable, called at each failed try.

        ``--backoff-max``, but never more than a quarter of the server's ``lost_after`` (known from its last
        answer): a server back after an outage hears from every node well before it would declare one lost.
        """
        if self.server_lost_after is None:
            return self.config.sync.backoff_max
        return min(self.config.sync.backoff_max, self.server_lost_after / 4)

    async def _sync_once(self, client: httpx.AsyncClient, url: str) -> SyncReply | None:
        """One sync call; None when a local change cut the long-poll short."""
        changed = self._changed
        body = to_json(self.request())
        outcome: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:

            async def call() -> None:
                try:
                    with trio.fail_after(self.config.sync.timeout + 5):
                        outcome["response"] = await client.post(url, json=body)
                except (httpx.HTTPError, trio.TooSlowError) as exc:
                    outcome["error"] = exc
                nursery.cancel_scope.cancel()

            async def interrupt() -> None:
                await changed.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(call)
            nursery.start_soon(interrupt)
        if "error" in outcome:
            raise _Unreachable(describe(outcome["error"]))
        response: httpx.Response | None = outcome.get("response")
        if response is None:
            return None
        raise_for_standby(url, response.status_code, response.headers, response.json)
        if response.status_code >= 500:
            raise _Unreachable(f"HTTP {response.status_code}: {server_message(response)}")
        if response.status_code != 200:
            raise _Refused(
                f"server {self.config.server} refused node {self.config.node!r} "
                f"(HTTP {response.status_code}): {server_message(response)}",
                revoked=response.status_code == 403 and error_type(response) == "revoked",
            )
        try:
            return from_json(response.json(), SyncReply)
        except (WireError, ValueError) as exc:
            message = f"server {self.config.server} sent a reply this agent cannot read: {exc}"
            raise _Refused(message) from None

    async def watch_facts(self, refresh: Any) -> None:
        """Re-run discovery every ``facts_interval`` seconds; re-check model sources when asked about others.

        :param refresh: ``async (check_sources) -> NodeFacts``, the full discovery.
        """
        next_full = trio.current_time() + self.config.sync.facts_interval
        while True:
            with trio.move_on_at(next_full):
                await self._sources_changed.wait()
            self._sources_changed = trio.Event()
            asked = self.check_sources
            if trio.current_time() < next_full:
                # only the sources to check changed: a quick look at the disk, no discovery
                await self.refresh_weights(asked)
                self.sources_checked = asked
                continue
            next_full = trio.current_time() + self.config.sync.facts_interval
            try:
                facts = await refresh(asked)
            except Exception as exc:  # noqa: BLE001 - keep the last facts; say why in the log
                log.error("refreshing this node's facts failed: %s; reporting the previous ones", exc)
                continue
            self.sources_checked = asked
            self.set_facts(facts)
