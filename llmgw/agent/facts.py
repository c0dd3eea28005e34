"""What the agent reports about its node: GPUs, fabrics, engines, model sources, problems.

:func:`gather_facts` runs discovery (in a worker thread: the hooks run
``nvidia-smi``), checks each engine's program by running it with
``--version``, and checks which model sources exist on disk. Anything that
is wrong becomes one line in ``facts.problems`` for ``ctl nodes``, except a
``--fabric`` that cannot be met, which refuses the start
(:class:`~llmgw.errors.FabricError`).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

import llmgw
from llmgw.agent.config import AgentConfig
from llmgw.agent.models_dir import ModelsDir, seed_has_files
from llmgw.engine import Engine, help_and_version_of
from llmgw.models import NodeFacts
from llmgw.node.discovery import discover_node
from llmgw.weights import is_distributable, seed_path

__all__ = [
    "gather_facts", "check_engines", "present_sources", "weights_facts", "with_weights", "parse_version",
    "VERSION_TIMEOUT",
]  # fmt: skip

log = logging.getLogger("llmgw.agent")

#: seconds an engine's ``--version`` may take
VERSION_TIMEOUT = 30.0


def parse_version(output: str) -> str | None:
    """The version in what ``PROGRAM --version`` printed: the last word of its first non-empty line.

    ``llmgw-sim 0.1.0`` gives ``0.1.0``; ``0.6.3`` gives ``0.6.3``. An engine
    sets ``version_args`` in its ``help_and_version`` fact (the arguments after
    the program's path; default ``("--version",)``) and overrides
    ``parse_version(text) -> str | None`` to ask and read its own way (an
    engine whose program is ``python`` must: ``python --version`` is Python's).
    """
    for line in output.splitlines():
        words = line.split()
        if words:
            return words[-1]
    return None


def present_sources(sources: Iterable[str], models: ModelsDir | None = None) -> tuple[str, ...]:
    """The model sources this node has: absolute paths that exist, and every hub-style name.

    A name that is not an absolute path is one the engine resolves itself
    (a hub id such as ``meta-llama/Llama-3.1-8B``), so it counts as present.
    A distributable source (``seed:///PATH``) is present when its directory
    exists here with files in it or ``models`` holds a complete copy of it; an ``hf://`` source
    only when ``models`` holds a complete copy.
    """
    present = []
    copied = {c.source for c in models.copies() if c.complete} if models is not None else set()
    for source in set(sources):
        if is_distributable(source):
            seed = models.seed_dir(source) if models is not None else None
            if seed is None and models is None and seed_path(source) is not None:
                seed = Path(seed_path(source) or "")
            if (seed is not None and seed.is_dir() and seed_has_files(seed)) or source in copied:
                present.append(source)
        elif not os.path.isabs(source) or os.path.exists(source):
            present.append(source)
    return tuple(sorted(present))


def weights_facts(models: ModelsDir, sources: tuple[str, ...]) -> dict[str, Any]:
    """The facts about model weights: sources present, copies, free bytes; blocking (run it in a thread).

    Called with every discovery, and when the sources to check or a copy changed.
    """
    problem = models.prepare()
    copies = [] if problem else [*models.seed_copies(sources), *models.copies()]
    return {
        "model_sources": present_sources(sources, None if problem else models),
        "model_copies": copies,
        "models_free_bytes": models.free_bytes(),
        "problems": [problem] if problem else [],
    }


async def with_weights(facts: NodeFacts, models: ModelsDir, sources: Iterable[str]) -> NodeFacts:
    """``facts`` with the weights' part (:func:`weights_facts`) looked at again, off the event loop."""
    found = await trio.to_thread.run_sync(
        weights_facts, models, tuple(sources), abandon_on_cancel=True
    )
    problems = [p for p in facts.problems if not p.startswith("models dir ")] + found.pop("problems")
    return attrs.evolve(facts, problems=problems, **found)


async def _kill_group(process: trio.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _version_of(name: str, engine: Engine, path: str) -> tuple[str | None, str | None]:
    """(version, None) or (None, problem) for one engine's program at ``path``."""
    argv = [path, *help_and_version_of(engine, engine.programs[0]).version_args]
    shown = " ".join(argv)
    with trio.move_on_after(VERSION_TIMEOUT):
        try:
            result = await trio.run_process(
                argv,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                stdin=b"",
                start_new_session=True,
                deliver_cancel=_kill_group,
            )
        except OSError as exc:
            return None, f"engine {name}: cannot run {path}: {exc.strerror or exc}"
        stdout = result.stdout.decode(errors="replace")
        stderr = result.stderr.decode(errors="replace")
        if result.returncode != 0:
            last = next((ln.strip() for ln in reversed((stderr or stdout).splitlines()) if ln.strip()), "")
            return None, f"engine {name}: {shown} exited with code {result.returncode}" + (
                f": {last[:200]}" if last else ""
            )
        text = stdout if stdout.strip() else stderr
        version = engine.parse_version(text)
        if not version:
            return None, f"engine {name}: {shown} printed no version"
        return str(version), None
    return None, f"engine {name}: {shown} did not answer within {VERSION_TIMEOUT:g} s"


def _locate(name: str, program: str, configured: Mapping[str, str]) -> tuple[str | None, str]:
    """(path, "") of an engine's program, or (None, problem): configured, else on PATH."""
    path = configured.get(program)
    if path is not None:
        return (path, "") if os.path.exists(path) else (None, f"engine {name}: {path} not found")
    path = shutil.which(program)
    if path is None:
        return None, (
            f"engine {name}: {program} not found on PATH; install it or configure its path "
            f"(--engine {name}:{program}=PATH)"
        )
    return path, ""


async def check_engines(
    config: AgentConfig, engines: Mapping[str, Engine]
) -> tuple[dict[str, str], list[str]]:
    """Which engines are installed here, and their versions.

    An engine is installed when its plugin is (it is in ``engines``) and its
    first program (the configured path, or the program's name on PATH) exists
    and ``PROGRAM --version`` exits 0.

    :returns: (engine name -> version, problem lines for the others and for
        configured paths no engine uses).
    """
    installed: dict[str, str] = {}
    problems: list[str] = []
    for name in sorted(set(config.engines) - set(engines)):
        known = ", ".join(sorted(engines)) or "none"
        problems.append(f"engine {name}: paths are configured but no plugin provides it (engines: {known})")

    async def check(name: str, engine: Engine) -> None:
        configured = config.programs(name)
        for program in sorted(set(configured) - set(engine.programs)):
            problems.append(
                f"engine {name}: program {program!r} is configured but the engine runs only "
                f"{', '.join(engine.programs)}"
            )
        path, problem = _locate(name, engine.programs[0], configured)
        if path is None:
            problems.append(problem)
            return
        version, problem = await _version_of(name, engine, path)
        if problem is not None:
            problems.append(problem)
            return
        check_problems, usable = await _engine_check(name, engine, configured, path, version)
        problems.extend(check_problems)
        if usable:
            installed[name] = version

    async with trio.open_nursery() as nursery:
        for name, engine in engines.items():
            nursery.start_soon(check, name, engine)
    return installed, sorted(problems)


#: (engine, program paths, version) -> (problems, usable): help is read once per installed version
_CHECKED: dict[tuple[str, tuple[tuple[str, str], ...], str], tuple[list[str], bool]] = {}


async def _engine_check(
    name: str, engine: Engine, configured: Mapping[str, str], path: str, version: str
) -> tuple[list[str], bool]:
    """Run engine-check on the installed engine, as ``llmgw ctl engine-check`` does.

    :returns: (problem lines, whether the engine may be used). An engine whose
        help lacks a flag llmgw passes is not reported as installed, so no
        replica is placed where it would fail to start; a help that cannot be
        read or looks cut short is a warning only.
    """
    from llmgw.enginecheck import check_installed

    key = (name, tuple(sorted(configured.items())), version)
    if key not in _CHECKED:
        try:
            report = await trio.to_thread.run_sync(
                functools.partial(check_installed, engine, configured, timeout=VERSION_TIMEOUT)
            )
        except Exception as exc:  # noqa: BLE001 - a plugin bug: reported, the engine still used
            _CHECKED[key] = ([f"engine {name}: engine-check failed in its plugin: {exc!r}"], True)
            return _CHECKED[key]
        problems = []
        hint = f"see: llmgw ctl engine-check {name} --binary {path}"
        if report.missing:
            flags = ", ".join(sorted({check.flag for check in report.missing}))
            problems.append(f"engine {name} {version} would reject llmgw's flags ({flags}): not used; {hint}")
        for failed in report.failures:
            problems.append(
                f"engine {name}: the help of {failed.program} could not be read to check llmgw's flags: "
                f"{failed.failure}"
            )
        for warning in report.warnings:
            problems.append(f"engine {name}: {warning}")
        _CHECKED[key] = (problems, not report.missing)
    return _CHECKED[key]


async def gather_facts(
    config: AgentConfig,
    plugins: Any,
    engines: Mapping[str, Engine],
    *,
    check_sources: Iterable[str] = (),
    extra_problems: Iterable[str] = (),
    peer_port: int | None = None,
) -> NodeFacts:
    """Discover this node's facts, as the agent reports them at every sync.

    Called by the agent at start and every ``sync.facts_interval`` seconds.

    :param plugins: the plugin manager (discovery hooks).
    :param check_sources: the model sources the server asked about.
    :param extra_problems: lines to add (e.g. a plugin that failed to load).
    :param peer_port: the port this node serves model files on (None: none).
    :returns: the node's :class:`~llmgw.models.NodeFacts`.
    :raises FabricError: a ``--fabric`` declaration this node cannot meet.
    """
    discovery = await trio.to_thread.run_sync(
        functools.partial(discover_node, plugins, config.discovery, config.fabrics), abandon_on_cancel=True
    )
    installed, engine_problems = await check_engines(config, engines)
    models = ModelsDir(config.models_dir, config.seed_root)
    sources = tuple(check_sources)
    weights = await trio.to_thread.run_sync(weights_facts, models, sources, abandon_on_cancel=True)
    return NodeFacts(
        node_id=config.node,
        agent_version=llmgw.__version__,
        gpus=discovery.gpus,
        fabrics=discovery.fabrics,
        engines=installed,
        model_sources=weights["model_sources"],
        problems=[*extra_problems, *discovery.problems, *engine_problems, *weights["problems"]],
        model_copies=weights["model_copies"],
        models_free_bytes=weights["models_free_bytes"],
        peer_port=peer_port,
    )
