"""Supervising one shard: its sidecars, then its engine, then rank 0's health.

A :class:`ShardSupervisor` runs one :class:`~llmgw.wire.DesiredShard` until it is cancelled, and
reports every change of its :class:`~llmgw.wire.ObservedShard` through a callback:

``starting`` (sidecars, then the engine, are starting) → ``running`` (the
engine process is up; a worker stays here) → ``ready`` (rank 0 answers 200
on the engine's health path). ``unhealthy`` when a sidecar is not ready in
time or exits, when rank 0 is not ready within ``ready_timeout``, fails
its health check several times in a row after being ready, or is found hung
by the engine's liveness probe (:mod:`llmgw.agent.liveness`); a hung engine
is SIGKILLed :data:`HUNG_STOP_GRACE` seconds after SIGTERM when stopped. ``exited`` when
the engine process ends (with its exit code and the last line of its log).
``stopping`` while it is being stopped. Nothing is restarted here: the
server decides, and hands out a new attempt.

Stopping (cancelling :meth:`ShardSupervisor.run`) ends the engine's process
group first (SIGTERM, grace, SIGKILL), then each sidecar's; after
:meth:`ShardSupervisor.detach` (the agent leaves) it ends nothing: the
launchers keep the processes for the next agent, which :meth:`adopts
<ShardSupervisor.adopt>` them (``running`` at once, the same attempt).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import httpx
import trio

from llmgw.agent.causes import log_cause
from llmgw.agent.config import AgentConfig
from llmgw.agent.liveness import watch_liveness
from llmgw.agent.load import watch_load
from llmgw.agent.lora import stage_at_start
from llmgw.agent.process import Child, describe_exit, keep_child, last_log_line, run_child
from llmgw.agent.records import shard_log_path
from llmgw.agent.sidecar_args import fill_sidecar
from llmgw.engine import Engine, LivenessProbe
from llmgw.models import Command, LaunchSpec, Sidecar
from llmgw.weights import is_distributable
from llmgw.wire import DesiredShard, ObservedShard, ShardLoad
from llmgw.wire.causes import FailureCause

if TYPE_CHECKING:
    from llmgw.agent.adoption import AdoptedShard

__all__ = ["ShardSupervisor", "shard_log_path"]

log = logging.getLogger("llmgw.agent")

#: ``async (source, progress) -> local path``; ``progress(detail, staged=None)`` (a StagingProgress)
Stage = Callable[[str, Callable[..., None]], Awaitable[str]]

#: seconds between two readiness checks of a sidecar
SIDECAR_POLL = 0.1
#: seconds a hung engine (failed health or liveness checks) gets between SIGTERM and SIGKILL:
#: it answers nothing, so it would not finish its requests in the configured grace either
HUNG_STOP_GRACE = 2.0


class ShardSupervisor:
    """Runs one shard; see the module docstring."""

    def __init__(
        self,
        desired: DesiredShard,
        engine: Engine | None,
        config: AgentConfig,
        report: Callable[[ObservedShard], None],
        *,
        on_spawn: Callable[[Child], None] | None = None,
        on_gone: Callable[[Child], None] | None = None,
        engine_version: str | None = None,
    ) -> None:
        """Prepare (not start) the shard ``desired`` with ``engine`` (None: no plugin provides it).

        :param report: called with the new observed state at every change.
        :param engine_version: the engine's version as this node found it (reported with the shard).
        :param on_spawn: called when a process group starts (to record it).
        :param on_gone: called when a process group is gone.
        """
        self.desired = desired
        self.engine = engine
        #: the model source was staged to a local copy (the engine runs with HF_HUB_OFFLINE=1)
        self.staged = False
        self.config = config
        self._report = report
        self._on_spawn = on_spawn
        self._on_gone = on_gone
        self.log_path = shard_log_path(config.logs_dir, desired)
        self.observed = ObservedShard(
            replica_id=desired.replica_id,
            attempt=desired.attempt,
            rank=desired.rank,
            state="starting",
            port=desired.spec.port,
            since=time.time(),
            log_path=str(self.log_path),
            engine_version=engine_version,
        )
        self.engine_child: Child | None = None
        self.sidecars: list[Child] = []
        #: every process this shard started or adopted (see :meth:`detach`)
        self.children: list[Child] = []
        #: set by :meth:`detach`
        self.detached = False
        #: what an earlier agent left running, once :meth:`adopt` took it
        self.adopted: AdoptedShard | None = None
        #: cancel this scope to stop the shard (see :meth:`stop`)
        self.cancel_scope = trio.CancelScope()
        #: set by whoever runs it once :meth:`run` returned (every process gone)
        self.done = trio.Event()
        #: rank 0's last load reading while it is ready (sent with the sync); None: none
        self.load: ShardLoad | None = None
        #: called with each liveness canary's result: ``ok``, ``busy``, ``failed``, ``hung``
        self.on_canary: Callable[[str], None] | None = None

    @property
    def key(self) -> str:
        """The shard's key (``replica/attempt/rRANK``)."""
        return self.desired.key

    @property
    def stop_grace(self) -> float:
        """Seconds between SIGTERM and SIGKILL: the profile's (sent by the server), else the agent's."""
        grace = self.desired.stop_grace
        return self.config.stop_grace if grace is None else grace

    def stop(self) -> None:
        """Report ``stopping`` and cancel :meth:`run`, which returns once every process is gone."""
        self._update(state="stopping", detail=None)
        self.cancel_scope.cancel()

    def detach(self) -> None:
        """Leave every process running when :meth:`run` is cancelled: the agent goes, the next adopts them."""
        self.detached = True
        for child in self.children:
            child.detached = True

    def adopt(self, adopted: AdoptedShard) -> None:
        """Take over the processes an earlier agent ran for this shard; :meth:`run` then watches them.

        Called before :meth:`run`; the shard is ``running`` at once (rank 0 is
        ``ready`` at its first health check), with what the earlier agent reported of it.
        """
        self.adopted = adopted
        self.engine_child = adopted.engine
        self.sidecars = list(adopted.sidecars.values())
        self.children = [adopted.engine, *self.sidecars]
        base = adopted.observed if adopted.observed is not None else self.observed
        self.observed = attrs.evolve(
            base, state="running", pid=adopted.engine.pid, detail=None, staged=None, since=time.time()
        )
        log.info(
            "shard %s adopted: engine pid %s, as the earlier agent left it", self.key, adopted.engine.pid
        )

    def fail(self, detail: str) -> None:
        """Report ``exited`` with ``detail``: the agent itself could not run the shard."""
        self._update(state="exited", detail=detail)

    def _update(self, **changes: object) -> None:
        current = self.observed.state
        new = changes.get("state", current)
        if current == "stopping" or (current == "exited" and new != "stopping"):
            return  # final states: a late probe or watcher says nothing more
        if new != "staging":
            changes["staged"] = None
        if current == "unhealthy" and new in ("starting", "running", "ready"):
            return  # the server tears an unhealthy shard down; it does not come back
        if new in ("exited", "unhealthy") and new != current:
            seen = changes.get("cause") or FailureCause(new)  # exited, unhealthy: a cause of the same name
            # an engine out of GPU memory fails every way at once: its log says so (a small read)
            changes["cause"] = log_cause(self.log_path, seen) if self.engine_child is not None else seen
        if new != current:
            changes["since"] = time.time()
        self.observed = attrs.evolve(self.observed, **changes)
        detail = f": {self.observed.detail}" if self.observed.detail and new != current else ""
        if new != current:
            log.info("shard %s %s%s", self.key, new, detail)
        self._report(self.observed)

    async def run(self, after: Sequence[trio.Event] = (), stage: Stage | None = None) -> None:
        """Run the shard until cancelled (see :meth:`stop`); every process is gone when it returns.

        :param after: events to wait for before starting anything (shards
            being stopped that hold a port this one binds); ``starting`` meanwhile.
        :param stage: ``async (source, progress) -> local path`` for a distributable model source, and for
            the LoRA adapters of an engine loading them at start (:mod:`llmgw.agent.staging`): the shard is
            ``staging`` (``progress`` lines as its detail) until they are, and the engine gets local paths.
        """
        with self.cancel_scope:
            if self.adopted is not None:
                async with trio.open_nursery() as nursery:
                    await self._run_adopted(nursery)
            for event in after:
                await event.wait()
            source = self.desired.spec.model_source
            if stage is not None and is_distributable(source):
                spec = attrs.evolve(self.desired.spec, model_source=await stage(source, self._staging))
                self.staged = True
                self.desired = attrs.evolve(self.desired, spec=spec)
            if self.engine is not None and self.engine.lora_at_start:  # its adapters before it starts
                with_lora = await stage_at_start(self.desired.spec, stage, self._staging)
                if isinstance(with_lora, str):  # an adapter is not on this node: the engine cannot start
                    self._update(state="exited", detail=with_lora)
                    await trio.sleep_forever()
                self.desired = attrs.evolve(self.desired, spec=with_lora)
            if self.observed.state == "staging":
                self._update(state="starting", detail=None)
            async with trio.open_nursery() as nursery:
                await self._run(nursery)

    def _staging(self, detail: str, staged: object = None) -> None:
        """What staging reports: ``detail`` for people, ``staged`` (bytes, rate) for ``ctl replicas``."""
        self._update(state="staging", detail=detail, staged=staged)

    async def _engine_gone(self) -> None:
        """What each sidecar's stop waits for: the engine's process group is gone."""
        engine = self.engine_child
        if engine is not None and engine.process is not None:
            await engine.exited.wait()

    async def _spawn(
        self,
        nursery: trio.Nursery,
        child: Child,
        command: Command,
        stop_after: Callable[[], Awaitable[None]] | None = None,
    ) -> Child:
        """Start ``child`` in ``nursery`` (see :func:`run_child`); returns once its launcher answered."""

        def spawned(c: Child) -> None:
            if self._on_spawn is not None:
                self._on_spawn(c)

        self.children.append(child)
        child.detached = self.detached
        return await nursery.start(
            self._watched,
            child,
            functools.partial(
                run_child,
                child,
                command,
                grace=self.stop_grace,
                orphan_grace=self.config.orphan_grace,
                stop_after=stop_after,
                on_spawn=spawned,
            ),
        )

    async def _watched(self, child: Child, run: Callable[..., Awaitable[Child]], task_status: Any) -> None:
        """Run ``run(task_status=...)``; once it returns, its process group is forgotten (unless detached)."""
        try:
            await run(task_status=task_status)
        finally:
            if self._on_gone is not None and child.process is not None and not child.detached:
                self._on_gone(child)

    async def _run_adopted(self, nursery: trio.Nursery) -> None:
        """Watch what :meth:`adopt` took over (sidecars, then the engine) as :meth:`_run` watches its own."""
        assert self.adopted is not None and self.engine_child is not None
        sidecars = {
            sidecar.name: sidecar
            for sidecar in (
                fill_sidecar(s, self.desired.spec, self.desired.replica_id) for s in self.desired.sidecars
            )
        }
        for name, child in self.adopted.sidecars.items():
            keep = functools.partial(
                keep_child, child, child.process, grace=self.stop_grace, stop_after=self._engine_gone
            )
            await nursery.start(self._watched, child, keep)
            nursery.start_soon(self._watch_sidecar, sidecars[name], child)
        child = self.engine_child
        await nursery.start(
            self._watched, child, functools.partial(keep_child, child, child.process, grace=self.stop_grace)
        )
        await self._watch_engine(child)

    async def _run(self, nursery: trio.Nursery) -> None:
        for sidecar in self.desired.sidecars:
            problem = await self._start_sidecar(nursery, sidecar)
            if problem is not None:
                self._update(state="unhealthy", detail=problem)
                await trio.sleep_forever()
        if self.engine is None:
            missing = f"engine {self.desired.engine} is not installed on this node (no plugin provides it)"
            self._update(state="exited", detail=missing)
            await trio.sleep_forever()
        spec = attrs.evolve(self.desired.spec, executables=self.config.programs(self.desired.engine))
        try:
            command = self.engine.build_command(spec)
        except Exception as exc:  # noqa: BLE001 - a plugin's bug is this shard's failure, not the agent's
            log.exception("engine %s could not build the command of shard %s", self.engine.name, self.key)
            detail = f"engine {self.engine.name} could not build its command: {exc}"
            self._update(state="exited", detail=detail)
            await trio.sleep_forever()
        if self.staged:
            # the engine gets a local copy; it must not look for the model on a hub itself
            command = attrs.evolve(command, env={**command.env, "HF_HUB_OFFLINE": "1"})
        # reported with the next change of state
        self.observed = attrs.evolve(self.observed, argv=command.argv, env=command.env)
        if self.desired.rank == 0 and spec.nnodes > 1 and self.engine.wait_for_workers:
            problem = await self._wait_for_workers(spec)
            if problem is not None:
                self._update(state="unhealthy", detail=problem)
                await trio.sleep_forever()
        self.engine_child = Child("engine of " + self.key, self.log_path)
        child = await self._spawn(nursery, self.engine_child, command)
        if child.start_error is not None:
            await child.exited.wait()
            self._update(state="exited", exit_code=child.returncode, detail=child.start_error)
            await trio.sleep_forever()
        self._update(state="running", pid=child.pid)
        await self._watch_engine(child)

    async def _watch_engine(self, child: Child) -> None:
        """Probe rank 0 while the engine runs; ``exited`` once it ended; then wait to be stopped."""
        async with trio.open_nursery() as probes:
            if self.desired.rank == 0:
                probes.start_soon(self._probe)
            await child.exited.wait()
            probes.cancel_scope.cancel()
        line = await trio.to_thread.run_sync(last_log_line, self.log_path)
        how = describe_exit(child.returncode)
        self._update(state="exited", exit_code=child.returncode, detail=line or how)
        log.warning("shard %s: engine %s (pid %s)", self.key, how, child.pid)
        await trio.sleep_forever()

    # -- sidecars ----------------------------------------------------------------------------------

    async def _start_sidecar(self, nursery: trio.Nursery, sidecar: Sidecar) -> str | None:
        """Start one sidecar and wait until it is ready; the problem, or None when it is ready."""
        sidecar = fill_sidecar(sidecar, self.desired.spec, self.desired.replica_id)
        path = shard_log_path(self.config.logs_dir, self.desired, sidecar.name)
        child = await self._spawn(
            nursery,
            Child(f"sidecar {sidecar.name} of {self.key}", path),
            Command(argv=sidecar.argv),
            stop_after=self._engine_gone,
        )
        self.sidecars.append(child)
        if child.start_error is not None:
            return f"sidecar {sidecar.name}: {child.start_error}"
        if sidecar.ready is not None:
            timeout = self.config.sidecar_timeout
            with trio.move_on_after(timeout):
                while not await self._sidecar_ready(sidecar.ready):
                    if child.exited.is_set():
                        return await self._sidecar_exit(sidecar, child, "before it was ready")
                    await trio.sleep(SIDECAR_POLL)
                nursery.start_soon(self._watch_sidecar, sidecar, child)
                log.info("shard %s: sidecar %s ready (%s)", self.key, sidecar.name, sidecar.ready)
                return None
            return (
                f"sidecar {sidecar.name} not ready within {timeout:g} s "
                f"({sidecar.ready} on {self.config.address})"
            )
        nursery.start_soon(self._watch_sidecar, sidecar, child)
        return None

    async def _sidecar_exit(self, sidecar: Sidecar, child: Child, when: str) -> str:
        await child.exited.wait()
        line = await trio.to_thread.run_sync(last_log_line, child.log_path)
        what = f"sidecar {sidecar.name} {describe_exit(child.returncode)} {when}"
        return f"{what}: {line}" if line else what

    async def _watch_sidecar(self, sidecar: Sidecar, child: Child) -> None:
        await child.exited.wait()
        detail = await self._sidecar_exit(sidecar, child, "while the shard ran")
        self._update(state="unhealthy", detail=detail)

    async def _sidecar_ready(self, ready: str) -> bool:
        kind, _, rest = ready.partition(":")
        port_text, _, path = rest.partition("/")
        port = int(port_text)
        with trio.move_on_after(self.config.health.timeout):
            if kind == "tcp":
                try:
                    stream = await trio.open_tcp_stream(self.config.address, port)
                except OSError:
                    return False
                await stream.aclose()
                return True
            url = f"http://{self.config.address}:{port}/{path}"
            async with httpx.AsyncClient(trust_env=False) as client:
                try:
                    return (await client.get(url)).status_code == 200
                except httpx.HTTPError:
                    return False
        return False

    # -- rank 0's workers and health ---------------------------------------------------------------

    async def _wait_for_workers(self, spec: LaunchSpec) -> str | None:
        """Wait until every other rank's address accepts TCP (engines that dial their workers once).

        :returns: None once all accept, else the problem after the shard's ready timeout.
        """
        workers = list(spec.peer_addrs[1:] if len(spec.peer_addrs) == spec.nnodes else spec.peer_addrs)
        waiting = list(workers)
        timeout = self.desired.ready_timeout
        self._update(detail=f"waiting for workers {', '.join(waiting)}")
        with trio.move_on_after(timeout):
            while waiting:
                for address in list(waiting):
                    host, _, port = address.rpartition(":")
                    with trio.move_on_after(self.config.health.timeout):
                        try:
                            stream = await trio.open_tcp_stream(host, int(port))
                        except OSError:
                            continue
                        await stream.aclose()
                        waiting.remove(address)
                if waiting:
                    await trio.sleep(SIDECAR_POLL)
            log.info("shard %s: workers %s accept connections", self.key, ", ".join(workers))
            return None
        return f"workers not listening within {timeout:g} s: {', '.join(waiting)}"

    # -- rank 0's health ---------------------------------------------------------------------------

    async def _probe(self) -> None:
        assert self.engine is not None
        spec = self.desired.spec
        url = f"http://{spec.host}:{spec.port}{self.engine.health_path}"
        settings = self.config.health
        async with httpx.AsyncClient(trust_env=False) as client:
            last = "no answer yet"
            timeout = self.desired.ready_timeout
            with trio.move_on_after(timeout) as waiting:
                while True:
                    ok, last = await self._probe_once(client, url)
                    if ok:
                        break
                    await trio.sleep(settings.interval)
            if waiting.cancelled_caught:
                self._update(state="unhealthy", detail=f"not ready within {timeout:g} s: GET {url}: {last}")
                return
            self._update(state="ready", detail=None)
            probe = self.engine.liveness_probe
            async with trio.open_nursery() as checks:
                if probe is not None:
                    checks.start_soon(self._liveness, client, probe)
                if self.engine.load_metrics is not None:
                    base, metrics = f"http://{spec.host}:{spec.port}", self.engine.load_metrics
                    shard = (self.desired.replica_id, self.desired.attempt)
                    checks.start_soon(
                        functools.partial(watch_load, client, base, metrics, *shard, self._keep)
                    )
                failures = 0
                while failures < settings.failures:
                    await trio.sleep(settings.interval)
                    ok, last = await self._probe_once(client, url)
                    failures = 0 if ok else failures + 1
                problem = f"health check failed {failures} times in a row: GET {url}: {last}"
                self._hung(problem, FailureCause.UNHEALTHY)
                checks.cancel_scope.cancel()

    async def _liveness(self, client: httpx.AsyncClient, probe: LivenessProbe) -> None:
        spec = self.desired.spec
        await watch_liveness(
            client,
            f"http://{spec.host}:{spec.port}",
            probe,
            spec.served_name,
            self._hung,
            metrics_timeout=max(self.config.health.timeout, probe.timeout),
            shard=self.key,
            outcome=self.on_canary,
        )

    def _keep(self, load: ShardLoad | None) -> None:
        """Keep rank 0's last load reading for the next sync, while it is ready."""
        self.load = load if self.observed.state == "ready" else None

    def _hung(self, detail: str, cause: FailureCause = FailureCause.HUNG) -> None:
        """Report ``unhealthy``: rank 0 stopped answering (its health check, or the liveness canary: hung).
        Its stop will not wait the whole grace."""
        if self.engine_child is not None:
            self.engine_child.kill_after = HUNG_STOP_GRACE
        self._update(state="unhealthy", detail=detail, cause=cause)

    async def _probe_once(self, client: httpx.AsyncClient, url: str) -> tuple[bool, str]:
        """One GET of the health path, within the health timeout: (passed, what it answered)."""
        with trio.move_on_after(self.config.health.timeout):
            try:
                response = await client.get(url)
            except httpx.HTTPError as exc:
                return False, str(exc) or type(exc).__name__
            return response.status_code == 200, f"HTTP {response.status_code}"
        return False, f"no answer within {self.config.health.timeout:g} s"
