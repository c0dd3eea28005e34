"""Building the plugin manager, and what it knows about each plugin.

:func:`get_plugin_manager` is the only way in: it is a function, never an
import side effect, so tests build their own with explicit plugins.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Iterable, Mapping
from importlib import metadata
from types import ModuleType
from typing import Any

import attrs
import pluggy

from llmgw import hookspecs
from llmgw.engine import Engine, old_api_uses
from llmgw.errors import DuplicateEngineError, PluginError, UnknownEngineError
from llmgw.provision import Provisioner

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "PluginRecord",
    "EngineRecord",
    "Plugins",
    "get_plugin_manager",
    "hookimpl",
]

from llmgw import hookimpl  # noqa: E402  (re-exported)

ENTRY_POINT_GROUP = "llmgw"

#: Built-in plugins shipped in the llmgw distribution (``plugins/``).
BUILTIN_PLUGINS: tuple[str, ...] = ("llmgw_nvidia", "llmgw_infiniband", "llmgw_proxmox")

#: ``LLMGW_LOAD_PLUGINS``: comma-separated names (entry point or
#: distribution) of the installed plugins to load; set but empty loads none.
#: Built-ins always load.
LOAD_ENV = "LLMGW_LOAD_PLUGINS"
#: ``LLMGW_TRACE_PLUGINS``: when set (not empty), print every hook call.
TRACE_ENV = "LLMGW_TRACE_PLUGINS"


@attrs.frozen
class PluginRecord:
    """One plugin as ``llmgw plugins`` shows it."""

    name: str
    distribution: str | None
    version: str | None
    #: ``loaded``, ``failed`` (see ``error``) or ``disabled`` (by LLMGW_LOAD_PLUGINS)
    status: str
    builtin: bool = False
    module: str | None = None
    hooks: tuple[str, ...] = attrs.field(converter=tuple, default=())
    engines: tuple[str, ...] = attrs.field(converter=tuple, default=())
    provisioners: tuple[str, ...] = attrs.field(converter=tuple, default=())
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as the JSON object ``llmgw plugins --json`` prints."""
        return attrs.asdict(self, recurse=False, value_serializer=_json_value)


@attrs.frozen
class EngineRecord:
    """One engine with the plugin that registered it."""

    name: str
    plugin: str
    distribution: str | None
    version: str | None
    checked_versions: tuple[str, ...]
    multi_node: bool
    engine: Engine = attrs.field(eq=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object (without the engine instance)."""
        data = attrs.asdict(
            self, recurse=False, value_serializer=_json_value, filter=lambda a, _: a.name != "engine"
        )
        return data


def _json_value(instance: object, field: attrs.Attribute, value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@attrs.define
class _Origin:
    name: str
    distribution: str | None
    version: str | None
    builtin: bool
    module: str | None


class Plugins:
    """The plugin manager together with what was learnt loading it."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self._origins: dict[int, _Origin] = {}
        self._failures: list[PluginRecord] = []
        self._engine_cache: tuple[dict[str, EngineRecord], list[_Problem]] | None = None
        self.trace: Any = None

    def enable_tracing(self, write: Any) -> None:
        """Write one line per hook call and its result with ``write``."""
        self.trace = write

        def before(hook_name: str, impls: list, kwargs: dict) -> None:
            names = ", ".join(impl.plugin_name for impl in impls)
            write(f"llmgw: {hook_name}({_kwargs(kwargs)}) -> plugins [{names}]\n")

        def after(outcome: Any, hook_name: str, impls: list, kwargs: dict) -> None:
            write(f"llmgw: {hook_name} returned {outcome.get_result()!r}\n")

        self.pm.add_hookcall_monitoring(before, after)

    @property
    def hook(self) -> Any:
        """The pluggy hook relay (``plugins.hook.llmgw_discover_gpus(...)``)."""
        return self.pm.hook

    # -- loading -----------------------------------------------------------

    def add(self, plugin: object, origin: _Origin) -> None:
        """Register one plugin object, recording a failure instead of raising."""
        try:
            self.pm.register(plugin, name=origin.name)
        except Exception as exc:  # noqa: BLE001 - any plugin failure is recorded
            self._record_failure(origin, _describe(exc))
            return
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(plugin)
            self._record_failure(origin, _describe(exc))
            return
        self._origins[id(plugin)] = origin
        self._engine_cache = None

    def _record_failure(self, origin: _Origin, error: str, status: str = "failed") -> None:
        self._failures.append(
            PluginRecord(
                name=origin.name,
                distribution=origin.distribution,
                version=origin.version,
                status=status,
                builtin=origin.builtin,
                module=origin.module,
                error=error,
            )
        )

    def call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every implementation of a hook on its own, newest registration last.

        Unlike ``plugins.hook.NAME(...)``, one plugin raising does not stop the
        others: its entry holds the exception instead of a result. Traced
        like any hook call when ``LLMGW_TRACE_PLUGINS`` is set.

        :returns: ``(plugin name, result or exception)`` per implementation.
        """
        results: list[tuple[str, Any]] = []
        for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
            if impl.hookwrapper or impl.wrapper:
                continue
            try:
                result = impl.function(*(kwargs[name] for name in impl.argnames))
            except Exception as exc:  # noqa: BLE001 - returned for the caller to attribute
                result = exc
            if self.trace:
                self.trace(f"llmgw: {hook_name}({_kwargs(kwargs)}) on {impl.plugin_name} -> {result!r}\n")
            results.append((impl.plugin_name, result))
        return results

    # -- introspection -----------------------------------------------------

    def records(self) -> list[PluginRecord]:
        """Every plugin, loaded or not, sorted by name."""
        engines, engine_errors = self._collect_engines()
        provisioners, provisioner_errors, _ = self._collect_named("llmgw_register_provisioners", Provisioner)
        errors_by_plugin = engine_errors + provisioner_errors
        records = list(self._failures)
        for name, plugin in self.pm.list_name_plugin():
            origin = self._origins.get(id(plugin))
            if origin is None:
                continue
            hooks = sorted(
                caller.name
                for caller in (self.pm.get_hookcallers(plugin) or [])
                if caller.name.startswith("llmgw_")
            )
            error = "; ".join(e.message for e in errors_by_plugin if e.plugin == name) or None
            records.append(
                PluginRecord(
                    name=name,
                    distribution=origin.distribution,
                    version=origin.version,
                    status="failed" if error else "loaded",
                    builtin=origin.builtin,
                    module=origin.module,
                    hooks=hooks,
                    engines=sorted(r.name for r in engines.values() if r.plugin == name),
                    provisioners=sorted(n for n, p in provisioners.items() if p == name),
                    error=error,
                )
            )
        return sorted(records, key=lambda r: (not r.builtin, r.name))

    def engines(self) -> dict[str, EngineRecord]:
        """Every registered engine by name.

        :raises DuplicateEngineError: two plugins registered one engine name.
        :raises PluginError: a plugin's ``llmgw_register_engines`` failed.
        """
        engines, errors = self._collect_engines()
        if errors:
            raise _first_error(errors)
        return engines

    def engine(self, name: str) -> Engine:
        """The engine called ``name``.

        :raises UnknownEngineError: no plugin provides it; lists those there are.
        """
        engines = self.engines()
        if name not in engines:
            known = ", ".join(sorted(engines)) or "none"
            raise UnknownEngineError(
                f"no plugin provides engine {name!r} (engines there are: {known}); "
                "install its distribution, e.g. pip install llmgw-engine-" + name
            )
        return engines[name].engine

    def provisioners(self) -> dict[str, Provisioner]:
        """Every registered provisioner by name; raises like :meth:`engines`."""
        _, errors, instances = self._collect_named("llmgw_register_provisioners", Provisioner)
        if errors:
            raise _first_error(errors)
        return instances

    def _collect_engines(self) -> tuple[dict[str, EngineRecord], list[_Problem]]:
        if self._engine_cache is None:
            by_plugin, errors, instances = self._collect_named("llmgw_register_engines", Engine)
            engines = {}
            for name, engine in instances.items():
                plugin = by_plugin[name]
                origin = self._origin_by_name(plugin)
                engines[name] = EngineRecord(
                    name=name,
                    plugin=plugin,
                    distribution=origin.distribution if origin else None,
                    version=origin.version if origin else None,
                    checked_versions=tuple(getattr(engine, "checked_versions", ())),
                    multi_node=bool(getattr(engine, "multi_node", False)),
                    engine=engine,
                )
            self._engine_cache = (engines, errors)
        return self._engine_cache

    def _collect_named(
        self, hook_name: str, kind: type
    ) -> tuple[dict[str, str], list[_Problem], dict[str, Any]]:
        """Call one register hook per plugin, keeping who registered what."""
        owner: dict[str, str] = {}
        instances: dict[str, Any] = {}
        errors: list[_Problem] = []
        for plugin, result in self.call_each(hook_name):
            if isinstance(result, Exception):
                errors.append(_Problem(plugin, f"{hook_name} raised {_describe(result)}"))
                continue
            result = result or []
            for item in result:
                if not isinstance(item, kind):
                    errors.append(
                        _Problem(plugin, f"{hook_name} returned {item!r}, not a {kind.__name__} instance")
                    )
                    continue
                name = getattr(item, "name", None)
                outdated = old_api_uses(item) if kind is Engine else []
                if outdated:
                    errors.append(_Problem(plugin, self._outdated_engine(plugin, name, outdated)))
                    continue
                if name in owner:
                    first, second = self._origin_label(owner[name]), self._origin_label(plugin)
                    errors.append(
                        _Problem(
                            plugin,
                            f"{kind.__name__.lower()} {name!r} is registered twice: "
                            f"by {first} and by {second}; uninstall one of them",
                            DuplicateEngineError if kind is Engine else PluginError,
                        )
                    )
                    continue
                owner[name] = plugin
                instances[name] = item
        return owner, errors, instances

    def _outdated_engine(self, plugin_name: str, engine_name: str | None, outdated: list[str]) -> str:
        """The error of an engine written against llmgw 0.1's Engine API: what to change, each."""
        origin = self._origin_by_name(plugin_name)
        dist = f" (dist {origin.distribution})" if origin and origin.distribution else ""
        return f"engine {engine_name!r}{dist}: " + "; ".join(outdated) + "; see docs/plugins.md"

    def _origin_by_name(self, plugin_name: str) -> _Origin | None:
        plugin = self.pm.get_plugin(plugin_name)
        return self._origins.get(id(plugin)) if plugin is not None else None

    def _origin_label(self, plugin_name: str) -> str:
        origin = self._origin_by_name(plugin_name)
        if origin is None or origin.distribution is None:
            return f"plugin {plugin_name!r}"
        return f"{origin.distribution} {origin.version} (plugin {plugin_name!r})"


def _kwargs(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


@attrs.frozen
class _Problem:
    """A plugin's registration problem: the plugin, the message, and the error it raises as."""

    plugin: str
    message: str
    #: a duplicate name raises this with the message as is; None: PluginError naming the plugin
    duplicate: type[PluginError] | None = None


def _first_error(errors: list[_Problem]) -> PluginError:
    first = errors[0]
    if first.duplicate is not None:
        return first.duplicate(first.message)
    return PluginError(f"plugin {first.plugin!r}: {first.message}")


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def _llmgw_version() -> str | None:
    try:
        return metadata.version("llmgw")
    except metadata.PackageNotFoundError:
        return None


def _allowlist(environ: Mapping[str, str]) -> set[str] | None:
    raw = environ.get(LOAD_ENV)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def get_plugin_manager(
    *,
    builtins: Iterable[str] | None = None,
    plugins: Iterable[object] = (),
    entry_points: bool = True,
    environ: Mapping[str, str] | None = None,
) -> Plugins:
    """Build a plugin manager: the specs, the built-ins, then installed plugins.

    Called once by each process (agent, server, gateway, ctl) at start. Each
    plugin loads on its own: one that fails to import or register is recorded
    with its entry point, distribution, version and error, and the others
    still load.

    :param builtins: module names of the built-in plugins; default
        :data:`BUILTIN_PLUGINS`.
    :param plugins: extra plugin objects (modules or instances) registered
        after the built-ins, for tests and embedding.
    :param entry_points: whether to load the ``llmgw`` entry point group.
    :param environ: the environment to read ``LLMGW_LOAD_PLUGINS`` and
        ``LLMGW_TRACE_PLUGINS`` from; default ``os.environ``.
    :returns: a :class:`Plugins`.
    """
    environ = os.environ if environ is None else environ
    pm = pluggy.PluginManager("llmgw")
    pm.add_hookspecs(hookspecs)
    result = Plugins(pm)
    version = _llmgw_version()

    for module_name in BUILTIN_PLUGINS if builtins is None else builtins:
        origin = _Origin(module_name, "llmgw", version, True, module_name)
        module = _import(result, module_name, origin)
        if module is not None:
            result.add(module, origin)

    for plugin in plugins:
        base = getattr(plugin, "__name__", None) or type(plugin).__name__
        name, count = base, 1
        while pm.has_plugin(name):
            count += 1
            name = f"{base}-{count}"
        module = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__module__
        result.add(plugin, _Origin(name, None, None, False, module))

    if entry_points:
        _load_entry_points(result, _allowlist(environ))

    if environ.get(TRACE_ENV):
        result.enable_tracing(sys.stderr.write)
    return result


def _import(result: Plugins, module_name: str, origin: _Origin) -> ModuleType | None:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - recorded, the others still load
        result._record_failure(origin, _import_error(exc))
        return None


def _import_error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return _describe(exc) + where


def _load_entry_points(result: Plugins, allow: set[str] | None) -> None:
    seen: set[str] = set()
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist
        dist_name = dist.name if dist is not None else None
        dist_version = dist.version if dist is not None else None
        origin = _Origin(ep.name, dist_name, dist_version, False, ep.value)
        seen.update({ep.name, dist_name or ""})
        if allow is not None and not ({ep.name, dist_name} & allow):
            result._record_failure(
                origin, f"not in {LOAD_ENV}; add {dist_name or ep.name} to load it", "disabled"
            )
            continue
        if result.pm.get_plugin(ep.name) is not None:
            result._record_failure(
                origin, f"another plugin is already registered as {ep.name!r}; rename this one"
            )
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - recorded, the others still load
            result._record_failure(origin, _import_error(exc))
            continue
        result.add(plugin, origin)
    for name in sorted((allow or set()) - seen):
        result._record_failure(
            _Origin(name, None, None, False, None),
            f"{LOAD_ENV} names {name!r} but no installed plugin has that name",
        )
