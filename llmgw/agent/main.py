"""Running the agent: :func:`serve_agent`."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import httpx
import trio

from llmgw.agent.adoption import adopt_running
from llmgw.agent.config import AgentConfig, AgentConfigError
from llmgw.agent.eviction import RoomMaker, weights_in_use
from llmgw.agent.facts import gather_facts
from llmgw.agent.metrics import AgentMetrics
from llmgw.agent.models_dir import ModelsDir
from llmgw.agent.peer_files import PeerFiles
from llmgw.agent.prestage import PreStager
from llmgw.agent.records import ProcessRecords, hold_agent_lock
from llmgw.agent.staging import Stager
from llmgw.agent.sync import Agent
from llmgw.engine import Engine
from llmgw.errors import PluginError
from llmgw.net.metrics import observability_handler
from llmgw.net.server import HttpServer, parse_listen
from llmgw.pki import client_ssl_context, server_ssl_context
from llmgw.plugins import get_plugin_manager
from llmgw.serverlist import ServerList, send_to_leader
from llmgw.wire import to_json

__all__ = ["serve_agent", "say_leaving", "FAREWELL_TIMEOUT"]

log = logging.getLogger("llmgw.agent")

#: seconds a stopping agent gives the server to take its farewell before it stops its shards anyway
FAREWELL_TIMEOUT = 5.0


def _engines(plugins: Any) -> tuple[dict[str, Engine], list[str]]:
    try:
        return {name: record.engine for name, record in plugins.engines().items()}, []
    except PluginError as exc:
        log.error("engine plugins failed to load: %s", exc)
        return {}, [f"engine plugins failed to load: {exc}"]


async def serve_agent(
    config: AgentConfig,
    plugins: Any = None,
    *,
    leave: trio.Event | None = None,
    task_status: trio.TaskStatus[Agent] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the node agent until cancelled.

    At start: takes the state directory's lock, adopts the shards an earlier
    agent left running (:mod:`llmgw.agent.adoption`: the same shards, the
    same attempts, nothing restarts), ends the process groups it cannot adopt
    (and reports their shards as ``exited``), discovers the node's facts,
    then calls ``task_status.started(agent)`` with the
    :class:`~llmgw.agent.sync.Agent` and syncs with the server forever,
    supervising the shards it is given.

    On cancellation every shard is stopped (engine, then sidecars: SIGTERM,
    grace, SIGKILL) before this returns.

    :param plugins: the plugin manager; default :func:`~llmgw.plugins.get_plugin_manager`.
    :param leave: set it to stop on purpose (``llmgw agent`` does on SIGTERM or Ctrl-C). With an
        ``orphan_grace`` the agent leaves every shard running, for the next agent to adopt (an
        upgrade or a restart restarts nothing; past the grace the launchers stop them). With
        ``orphan_grace = 0`` it first tells the server it is leaving (:func:`say_leaving`), so
        its replicas leave the routes and start again once it is back without counting a failure;
        then it stops every shard. Either way it then returns.
    :raises FabricError: a ``--fabric`` this node cannot meet (before ``started``).
    :raises PkiError: the certificate, key or CA cannot be loaded.
    :raises AgentLockError: another agent runs with the same state directory.
    """
    if plugins is None:
        plugins = get_plugin_manager()
    engines, problems = _engines(plugins)
    ssl_context = client_ssl_context(config.cert, config.key, config.ca)
    config.logs_dir.mkdir(parents=True, exist_ok=True)
    with hold_agent_lock(config.runtime_dir):
        records = ProcessRecords(config.runtime_dir)
        adopted, previous, ended = await adopt_running(records, config.logs_dir, config.stop_grace)
        for line in ended:
            log.warning("left by an earlier agent: %s", line)

        peers = PeerFiles(
            ModelsDir(config.models_dir, config.seed_root),
            max_uploads=config.max_uploads,
            bandwidth_limit=config.bandwidth_limit,
        )

        async def refresh(check_sources: tuple[str, ...] = ()) -> Any:
            return await gather_facts(
                config, plugins, engines, check_sources=check_sources, extra_problems=problems,
                peer_port=peers.port,
            )  # fmt: skip

        # the sources the server asked the previous agent about: a first sync that
        # reported none would make the server move replicas off this node
        check_sources = records.check_sources()
        facts = await refresh(check_sources)
        for problem in facts.problems:
            log.warning("node %s: %s", config.node, problem)
        log.info(
            "node %s: %d GPUs, fabrics %s, engines %s",
            config.node,
            len(facts.gpus),
            ", ".join(f.name for f in facts.fabrics) or "none (island)",
            ", ".join(f"{name} {version}" for name, version in sorted(facts.engines.items())) or "none",
        )
        agent = Agent(config, engines, facts, records, ssl_context)
        agent.credentials.read_expiry()  # the certificate loaded: client_ssl_context read it
        agent.check_sources = check_sources
        agent.sources_checked = check_sources
        agent.report_previous(previous)
        async with trio.open_nursery() as nursery:
            if config.metrics_listen is not None:
                await _serve_metrics(nursery, agent, config.metrics_listen)
            agent.adopt(adopted)  # once the metrics are there: adopted shards are counted too
            if adopted:
                log.info("adopted %d shards an earlier agent left running; nothing restarts", len(adopted))
            await _serve_peers(nursery, agent, peers)
            syncing = trio.CancelScope()
            nursery.start_soon(_sync, agent, nursery, syncing)
            nursery.start_soon(agent.watch_facts, refresh)
            nursery.start_soon(_say_when_stopping, agent)
            if leave is not None:
                nursery.start_soon(_leave_when_asked, agent, leave, syncing, nursery.cancel_scope)
            task_status.started(agent)
        left = sum(s.detached for s in agent.supervisors.values())
        log.info("agent stopped: %s", f"{left} shards left running" if left else "every shard ended")


async def _serve_peers(nursery: trio.Nursery, agent: Agent, peers: PeerFiles) -> None:
    """Serve model files to peers, and stage distributable sources for shards; a port in use is a problem."""
    config = agent.config
    try:
        context = server_ssl_context(config.cert, config.key, config.ca)
        await nursery.start(peers.serve, context, config.address, config.peer_port)
    except OSError as exc:
        where = f"{config.address}:{config.peer_port}"
        problem = f"peer port {where}: cannot serve model files: {exc.strerror or exc}"
        log.error("node %s: %s", config.node, problem)
        agent.facts = attrs.evolve(agent.facts, problems=[*agent.facts.problems, problem])
    else:
        agent.facts = attrs.evolve(agent.facts, peer_port=peers.port)
        log.info("node %s: serving model files to peers on %s:%s", config.node, config.address, peers.port)
    stager = Stager(config, peers, lambda: agent.credentials.context, agent.refresh_weights)
    room = RoomMaker(
        stager.models,
        peers,
        server=config.server,
        server_context=lambda: agent.credentials.context,
        in_use=lambda: weights_in_use(agent),
        report=stager.report,
        copies_changed=agent.refresh_weights,
        node=config.node,
        headroom=lambda: agent.disk_headroom,
    )
    agent.stage = room.wrap(stager.stage)
    agent.prestage = PreStager(nursery, agent.stage)
    nursery.start_soon(stager.watch_seeds, lambda: agent.check_sources)


async def _serve_metrics(nursery: trio.Nursery, agent: Agent, listen: str) -> None:
    """Serve ``/metrics`` and ``/health`` in plain HTTP on ``listen`` (``--metrics-listen``)."""
    metrics = AgentMetrics()
    metrics.agent, agent.metrics = agent, metrics
    host, port = parse_listen(listen, "--metrics-listen")
    handler = observability_handler(lambda: metrics.registry, metrics.health)
    try:
        metrics.listen_address = await nursery.start(HttpServer(handler).serve, host, port)
    except OSError as exc:
        raise AgentConfigError(f"--metrics-listen {listen}: cannot listen: {exc.strerror or exc}") from None
    log.info("node %s: metrics on http://%s:%s/metrics", agent.config.node, *metrics.listen_address)


async def _say_when_stopping(agent: Agent) -> None:
    try:
        await trio.sleep_forever()
    finally:
        stopping = [s for s in agent.supervisors.values() if not s.detached]
        if stopping:
            log.info(
                "agent stopping: ending %d shards (SIGTERM, then SIGKILL after %g s)",
                len(stopping),
                agent.config.stop_grace,
            )


async def _sync(agent: Agent, nursery: trio.Nursery, syncing: trio.CancelScope) -> None:
    with syncing:
        await agent.run(nursery)


async def _leave_when_asked(
    agent: Agent, leave: trio.Event, syncing: trio.CancelScope, scope: trio.CancelScope
) -> None:
    await leave.wait()
    syncing.cancel()  # a leaving agent starts no more shards, whatever the server hands out next
    grace = agent.config.orphan_grace
    if grace > 0:
        log.info(
            "leaving %d shards running: the next agent adopts them (their launchers stop them "
            "if none does within %g s)",
            agent.detach(),
            grace,
        )
    else:
        with trio.move_on_after(FAREWELL_TIMEOUT):
            await say_leaving(agent)
    scope.cancel()


async def say_leaving(agent: Agent) -> bool:
    """Tell the server this agent stops on purpose; called before it stops any shard.

    With shards running it waits for the answer to change what this node
    should run (the server started their replicas again: they left the routes),
    or for the server's poll timeout. Callers own the deadline.

    :returns: whether the server took it (else its replicas count a failure, as for a crash).
    """
    request = attrs.evolve(agent.request(), leaving=True, wait=bool(agent.supervisors))
    servers = ServerList.parse(agent.config.server)  # the leader takes it; standbys name it
    try:
        async with httpx.AsyncClient(verify=agent.credentials.context, timeout=FAREWELL_TIMEOUT) as client:
            response = await send_to_leader(client, servers, "POST", "/v1/agent/sync", json=to_json(request))
    except httpx.HTTPError as exc:
        log.warning("could not tell the server this agent is leaving: %s", exc)
        return False
    if response.status_code != 200:
        log.warning("the server did not take this agent's leaving: HTTP %d", response.status_code)
        return False
    log.info("told the server this agent is leaving: its replicas start again once it is back")
    return True
