"""LoRA adapters on the engines this node runs rank 0 of: loaded and unloaded on the server's word.

Every sync answer says which adapters each replica whose rank 0 runs here should keep loaded
(:class:`~llmgw.wire.DesiredAdapters`). :class:`AdapterLoader` makes the engines match: an adapter no
longer wanted is unloaded (:meth:`llmgw.engine.Engine.lora_unload`), a new one staged when its source is
distributable (the agent's ``Staging.stage``, as weights are; a local path is used as it is) and loaded
(:meth:`llmgw.engine.Engine.lora_load`), once rank 0 is ready. Loads run at once, side by side (an
engine loads while it serves); a load waits only for the unloads decided before it on its replica, so a
full engine has its slot free first.

An engine that loads adapters only at start (llama.cpp) gets every adapter of its model in its launch
spec (:attr:`~llmgw.models.LoraSpec.at_start`): :func:`stage_at_start` stages each one before the shard's
engine starts, as its weights are, and the server routes them once the replica is ready, with no call here.

Each adapter is reported in every sync (:class:`~llmgw.wire.ObservedAdapter`): ``loading``, then
``loaded`` or ``failed`` with an :class:`~llmgw.wire.AdapterCause` and the engine's answer as detail; a
change syncs at once. A failed adapter is not tried again until the server asks anew.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from llmgw.engine import Engine, HttpCall
from llmgw.models import LaunchSpec
from llmgw.weights import is_distributable
from llmgw.wire import AdapterCause, AdapterState, DesiredAdapters, ObservedAdapter, shard_key

__all__ = ["AdapterLoader", "Rank0", "adapter_file", "rank0_of", "stage_at_start"]

log = logging.getLogger("llmgw.agent")

#: characters of an engine's error answer kept as a failure's detail
DETAIL_LIMIT = 500


@attrs.frozen
class Rank0:
    """What the loader needs of a replica's rank 0 on this node: its engine, address, and readiness."""

    engine: Engine | None
    url: str
    ready: bool
    #: the engine was started by an agent before this one (adopted at start): it may still hold
    #: adapters that agent loaded, which this agent has no record of
    adopted: bool = False


class AdapterLoader:
    """The adapters of this node's rank-0 engines; see the module docstring.

    :param rank0: ``(replica id, attempt) -> Rank0 | None``: the rank 0 of that attempt on this node.
    :param notify: called when a report changed (the agent syncs at once).
    """

    def __init__(
        self,
        rank0: Callable[[str, int], Rank0 | None],
        notify: Callable[[], None],
    ) -> None:
        self.rank0 = rank0
        self.notify = notify
        #: ``async (source, progress) -> local path`` for distributable sources (the agent's staging)
        self.stage: Callable[[str, Callable[[str], None]], Awaitable[str]] | None = None
        #: replica id -> what the server last asked
        self.desired: dict[str, DesiredAdapters] = {}
        #: (replica id, adapter) -> what is reported
        self.observed: dict[tuple[str, str], ObservedAdapter] = {}
        self._tasks: dict[tuple[str, str], trio.CancelScope] = {}
        #: replica id -> the unloads under way on it (each load started after one waits for it)
        self._unloading: dict[str, set[trio.Event]] = {}
        self._poked = trio.Event()
        #: (replica id, attempt, adapter) unloaded once before this agent's first load of it on an
        #: adopted engine: an engine answers a load of a name it holds with an error (vLLM: 400)
        self._cleared: set[tuple[str, int, str]] = set()

    def report(self) -> tuple[ObservedAdapter, ...]:
        """What the next sync reports; called as each sync request is made."""
        return tuple(self.observed[key] for key in sorted(self.observed))

    def update(self, desired: tuple[DesiredAdapters, ...]) -> None:
        """Take the adapters the server's answer asks for; called with every sync answer."""
        wanted = {d.replica_id: d for d in desired}
        if wanted != self.desired:
            self.desired = wanted
            # an attempt the server no longer names is gone: its engine holds nothing to clear
            attempts = {(d.replica_id, d.attempt) for d in desired}
            self._cleared = {key for key in self._cleared if key[:2] in attempts}
            self.poke()

    def poke(self) -> None:
        """Look again (the server's word or a shard's state changed)."""
        self._poked.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Make the engines match the server's word whenever poked; runs until cancelled."""
        async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                await self._poked.wait()
                self._poked = trio.Event()
                self._pass(nursery, client)

    def _pass(self, nursery: trio.Nursery, client: httpx.AsyncClient) -> None:
        """Unload what is not wanted, then start loading what is wanted and not there."""
        for key, seen in list(self.observed.items()):
            replica, name = key
            want = self.desired.get(replica)
            if want is not None and want.attempt == seen.attempt and name in want.adapters:
                continue
            scope = self._tasks.pop(key, None)
            if scope is not None:
                scope.cancel()
            del self.observed[key]
            self.notify()
            target = self.rank0(replica, seen.attempt)
            if seen.state == AdapterState.LOADED and target is not None and target.engine is not None:
                done = trio.Event()
                self._unloading.setdefault(replica, set()).add(done)
                nursery.start_soon(self._unload, client, replica, name, target, done)
        for replica, want in self.desired.items():
            target = self.rank0(replica, want.attempt)
            if target is None or not target.ready:
                continue  # not running here, or not ready yet: a shard's change pokes again
            for name, source in want.adapters.items():
                key = (replica, name)
                if key in self.observed:
                    continue
                self.observed[key] = ObservedAdapter(replica, want.attempt, name, AdapterState.LOADING)
                self.notify()
                scope = trio.CancelScope()
                self._tasks[key] = scope
                after = tuple(self._unloading.get(replica, ()))  # a full engine frees its slot first
                nursery.start_soon(
                    self._load, client, replica, want.attempt, name, source, target, scope, after
                )

    async def _unload(
        self, client: httpx.AsyncClient, replica: str, name: str, target: Rank0, done: trio.Event
    ) -> None:
        try:
            await self._unload_now(client, replica, name, target)
        finally:
            done.set()
            self._unloading.get(replica, set()).discard(done)

    async def _unload_now(
        self, client: httpx.AsyncClient, replica: str, name: str, target: Rank0, quiet: bool = False
    ) -> None:
        """Send the engine's unload call; ``quiet``: the adapter may not be loaded, a refusal is expected."""
        if target.engine is None or not target.engine.serves_lora:
            return
        try:
            call = target.engine.lora_unload(name)
        except NotImplementedError:
            return
        if call is None:
            return
        failed = await _send(client, target.url, call)
        if failed is not None and quiet:
            log.debug("adapter %s was not loaded on adopted replica %s: %s", name, replica, failed[1])
        elif failed is not None:
            log.warning("unloading adapter %s from replica %s failed: %s", name, replica, failed[1])
        else:
            log.info("adapter %s unloaded from replica %s", name, replica)

    async def _load(
        self,
        client: httpx.AsyncClient,
        replica: str,
        attempt: int,
        name: str,
        source: str,
        target: Rank0,
        scope: trio.CancelScope,
        after: tuple[trio.Event, ...] = (),
    ) -> None:
        key = (replica, name)
        with scope:
            for unloaded in after:
                await unloaded.wait()
            began = trio.current_time()
            if target.adopted and (replica, attempt, name) not in self._cleared:
                self._cleared.add((replica, attempt, name))
                await self._unload_now(client, replica, name, target, quiet=True)
            outcome = await self._loaded(client, name, source, target)
            took = trio.current_time() - began
            if outcome is None:
                log.info("adapter %s loaded on replica %s in %.2f s", name, replica, took)
                seen = ObservedAdapter(replica, attempt, name, AdapterState.LOADED, seconds=took)
            else:
                cause, detail = outcome
                log.warning(
                    "adapter %s could not be loaded on replica %s: %s: %s", name, replica, cause, detail
                )
                seen = ObservedAdapter(
                    replica, attempt, name, AdapterState.FAILED, cause, detail[:DETAIL_LIMIT], took
                )
            if self.observed.get(key) is not None:
                self.observed[key] = seen
                self.notify()
        if self._tasks.get(key) is scope:
            del self._tasks[key]

    async def _loaded(
        self, client: httpx.AsyncClient, name: str, source: str, target: Rank0
    ) -> tuple[AdapterCause, str] | None:
        """Stage and load one adapter: None once loaded, else (cause, detail)."""
        if target.engine is None or not target.engine.serves_lora:
            engine = target.engine.name if target.engine is not None else "unknown"
            return AdapterCause.UNSUPPORTED, f"engine {engine} does not serve LoRA adapters"
        path = source
        if is_distributable(source):
            if self.stage is None:
                return AdapterCause.STAGING, f"{source}: this agent stages no distributable sources"
            try:
                path = await self.stage(source, lambda _line: None)
            except Exception as exc:  # noqa: BLE001 - any staging failure is the load's failure, reported
                return AdapterCause.STAGING, f"{source}: {exc}"
        call = target.engine.lora_load(name, path)
        if call is None:
            return None
        return await _send(client, target.url, call)


async def _send(client: httpx.AsyncClient, url: str, call: HttpCall) -> tuple[AdapterCause, str] | None:
    """Send ``call`` to the engine at ``url``: None on a 2xx answer, else (cause, what was answered)."""
    try:
        with trio.fail_after(call.timeout):
            response = await client.request(
                call.method, url + call.path, json=call.body if call.body is not None else None
            )
    except trio.TooSlowError:
        return AdapterCause.UNREACHABLE, f"the engine did not answer {call.path} within {call.timeout:g} s"
    except httpx.HTTPError as exc:
        return AdapterCause.UNREACHABLE, f"{call.path}: {type(exc).__name__}: {exc}"
    if 200 <= response.status_code < 300:
        return None
    return AdapterCause.REFUSED, f"{call.path} answered {response.status_code}: {_message(response)}"


def _message(response: httpx.Response) -> str:
    """The error message of an engine's answer (OpenAI's ``error.message`` when there is one)."""
    try:
        data: Any = response.json()
    except (ValueError, json.JSONDecodeError):
        return response.text[:DETAIL_LIMIT]
    if isinstance(data, Mapping):
        error = data.get("error")
        if isinstance(error, Mapping) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(data.get("message"), str):
            return data["message"]
        if isinstance(data.get("detail"), str):
            return data["detail"]
    return response.text[:DETAIL_LIMIT]


async def stage_at_start(
    spec: LaunchSpec,
    stage: Callable[[str, Callable[..., None]], Awaitable[str]] | None,
    progress: Callable[..., None],
) -> LaunchSpec | str:
    """``spec`` with the path on this node of each LoRA adapter its engine loads at start
    (``spec.lora.at_start``, sources from the server); called by a shard's supervisor before the engine of
    an engine with :attr:`~llmgw.engine.Engine.lora_at_start` starts.

    A distributable source is staged as weights are (``stage``; its ``progress`` lines read
    ``LoRA adapter NAME: ...``); the engine gets the staged directory's only file when it holds one (a
    GGUF adapter), else the directory (:func:`adapter_file`). A path on the node is used as it is.

    Only rank 0 loads adapters: a worker's spec is returned as it is (llama.cpp's RPC workers hold none).

    :returns: the new spec, or the problem (a string) when an adapter is not on this node.
    """
    lora = spec.lora
    if lora is None or not lora.at_start or spec.rank > 0:
        return spec
    paths = []
    for name, source in lora.at_start:
        path = source
        if is_distributable(source):
            if stage is None:
                return f"LoRA adapter {name}: {source} is not a path on this node, and this agent stages none"

            def said(detail: str, staged: object = None, name: str = name) -> None:
                progress(f"LoRA adapter {name}: {detail}", staged)

            path = await stage(source, said)
        found = await trio.to_thread.run_sync(adapter_file, path)
        if found is None:
            return f"LoRA adapter {name}: nothing at {path} on this node (its engine loads adapters at start)"
        paths.append((name, found))
    return attrs.evolve(spec, lora=attrs.evolve(lora, at_start=tuple(paths)))


def adapter_file(path: str) -> str | None:
    """What an engine loading adapters at start gets for an adapter at ``path``: the file itself, or a
    directory's only file (a staged GGUF adapter; llmgw's ``.llmgw*`` bookkeeping aside), else the
    directory; None when nothing is at ``path``. Blocking: run it in a thread."""
    folder = Path(path)
    if folder.is_file():
        return path
    if not folder.is_dir():
        return None
    files = [f for f in folder.iterdir() if f.is_file() and not f.name.startswith(".llmgw")]
    return str(files[0]) if len(files) == 1 else path


def rank0_of(supervisors: Mapping[str, Any]) -> Callable[[str, int], Rank0 | None]:
    """The loader's ``rank0`` over the agent's shard supervisors (shard key -> supervisor)."""

    def find(replica: str, attempt: int) -> Rank0 | None:
        supervisor = supervisors.get(shard_key(replica, attempt, 0))
        if supervisor is None:
            return None
        spec = supervisor.desired.spec
        ready = supervisor.observed.state == "ready"
        adopted = supervisor.adopted is not None
        return Rank0(supervisor.engine, f"http://{spec.host}:{spec.port}", ready, adopted)

    return find
