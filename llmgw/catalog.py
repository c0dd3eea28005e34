"""Reading the catalog: YAML to frozen records, every mistake named by its path.

Read through llmgw's one converter (:data:`llmgw.wire.converter`), strict about types (``"2"``, ``2.5``
and ``true`` are not integers) and, for the catalog's records, about unknown keys. :func:`load_catalog`
turns its exception groups into one line per problem (``models.llama-70b.replicas: expected an
integer``), then checks what types cannot: cross-references between models, profiles and engines; the
profiles learn from their engines' plugins what they say of them (``adapters_at_start``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from llmgw import catalog_adapters as lora
from llmgw.catalog_adapters import BAD_NAME, NAME, check_adapters, check_lora_engine
from llmgw.engine import Engine
from llmgw.errors import CatalogError
from llmgw.models import Autoscale, Catalog, Model, Profile
from llmgw.weights import check_source
from llmgw.wire import capped, converter

__all__ = [
    "MAX_CATALOG_BYTES",
    "MAX_CATALOG_DEPTH",
    "MAX_CATALOG_VALUES",
    "load_catalog",
    "parse_catalog",
    "read_catalog_text",
    "catalog_summary",
]

#: the largest catalog llmgw reads, in bytes of UTF-8
MAX_CATALOG_BYTES = 1024 * 1024


# ---------------------------------------------------------------------------
# error paths
# ---------------------------------------------------------------------------


def _flatten(exc: BaseException, path: tuple[str, ...]) -> list[str]:
    """One ``path: message`` line per leaf error of a cattrs exception tree."""
    if isinstance(exc, ForbiddenExtraKeysError):
        allowed = ", ".join(a.name for a in attrs.fields(exc.cl) if a.metadata.get("catalog_key", True))
        return [
            f"{_dotted(path + (key,))}: unknown key (expected one of: {allowed})"
            for key in sorted(exc.extra_fields)
        ]
    if isinstance(exc, BaseExceptionGroup):
        lines: list[str] = []
        for sub in exc.exceptions:
            lines.extend(_flatten(sub, path + _step(sub)))
        return lines
    if isinstance(exc, KeyError):
        return [f"{_dotted(path)}: required, missing"]
    if isinstance(exc, ValueError | TypeError):
        field = _field_of(exc)
        return [f"{_dotted(path + ((field,) if field else ()))}: {_plain(exc)}"]
    return [f"{_dotted(path)}: {exc}"]


def _step(exc: BaseException) -> tuple[str, ...]:
    for note in getattr(exc, "__notes__", []):
        name = getattr(note, "name", None)
        if name is not None:  # cattrs AttributeValidationNote
            return (str(name),)
        index = getattr(note, "index", None)
        if isinstance(index, str):  # a mapping's key (cattrs notes it as an index): ``adapters.sql``
            return (index,)
        if index is not None:  # cattrs IterableValidationNote
            return (f"[{index}]",)
    return ()


def _plain(exc: BaseException) -> str:
    text = str(exc)
    if text.startswith("expected"):
        return text
    match = re.match(r"(\w+) must be (>= \d+|at most \d+ \(llmgw's limit\)), got (.*)", text)
    if match:
        return f"expected an integer {match.group(2)}, got {match.group(3)}"
    match = re.match(r"\w+ must be: (expected .*)", text)
    return match.group(1) if match else text


def _dotted(path: tuple[str, ...]) -> str:
    out = ""
    for part in path:
        out += part if part.startswith("[") or not out else f".{part}"
    return out or "(top level)"


# ---------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------


#: how deep a catalog may nest (a real one is about 5 levels deep: models.NAME.sidecars[0].argv[0])
MAX_CATALOG_DEPTH = 32
#: how many values (scalars, lists and mappings) a catalog may hold once its YAML aliases are expanded:
#: ten lists of ten aliases each, eight deep, are 601 bytes that expand to 10**8 values
MAX_CATALOG_VALUES = 100_000


#: libyaml's parser where PyYAML was built with it (three times as fast); the composing stays in Python
_PARSING: tuple[type, ...] = (
    (yaml.cyaml.CParser,)
    if yaml.__with_libyaml__
    else (yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser)
)


class _UniqueKeyLoader(
    yaml.composer.Composer, *_PARSING, yaml.constructor.SafeConstructor, yaml.resolver.Resolver
):
    """A YAML loader that refuses a key given twice, a key that is not a plain value, deep nesting, and
    more than :data:`MAX_CATALOG_VALUES` values with aliases expanded: counted as the nodes are composed,
    before anything is built from them."""

    _depth = 0

    def __init__(self, stream: str) -> None:
        for parsing in _PARSING:  # libyaml's parser, or PyYAML's reader, scanner and parser
            parsing.__init__(self, *((stream,) if parsing is _PARSING[0] else ()))
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        #: id of each node composed -> how many values it holds, its aliases expanded
        self._values: dict[int, int] = {}
        #: the values composed so far, aliases expanded
        self._total = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_CATALOG_DEPTH:
                self._refuse(f"nested deeper than {MAX_CATALOG_DEPTH} levels")
            alias = self.check_event(yaml.AliasEvent)
            if alias:
                target = self.anchors.get(self.peek_event().anchor)
                if target is not None and id(target) not in self._values:
                    anchor = self.peek_event().anchor
                    self._refuse(f"alias *{anchor} is used inside its own anchor &{anchor}")
            node = super().compose_node(parent, index)
            if alias:
                self._total += self._values[id(node)]
            else:
                self._values[id(node)] = self._count(node)
                self._total += 1  # its children were counted as they were composed
            if self._total > MAX_CATALOG_VALUES:
                self._refuse(
                    f"more than {MAX_CATALOG_VALUES} values, counting each use of an alias as the values of "
                    "its anchor (llmgw's limit)",
                    node.start_mark,
                )
            return node
        finally:
            self._depth -= 1

    def _count(self, node: yaml.Node) -> int:
        """The values ``node`` holds, aliases expanded; its children are composed and counted already."""
        if isinstance(node, yaml.SequenceNode):
            return 1 + sum(self._values[id(child)] for child in node.value)
        if isinstance(node, yaml.MappingNode):
            return 1 + sum(self._values[id(key)] + self._values[id(value)] for key, value in node.value)
        return 1

    def _refuse(self, problem: str, mark: Any = None) -> None:
        raise _Refused(None, None, problem, mark or self.peek_event().start_mark)


class _Refused(yaml.composer.ComposerError):
    """YAML that parses, but that llmgw does not read: too deep, too large once expanded, recursive."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, yaml.Mark] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            kind = "a list" if isinstance(key_node, yaml.SequenceNode) else "a mapping"
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a name, not {kind}", key_node.start_mark
            )
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {key!r} appears twice (first at line {seen[key].line + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_catalog(path: str | Path, engines: Mapping[str, Engine]) -> Catalog:
    """Read and validate a catalog file.

    Called by ``llmgw ctl validate`` and ``llmgw ctl apply`` before anything is sent or stored, so a bad
    catalog changes nothing.

    :param path: the YAML file.
    :param engines: the engines installed plugins provide, by name.
    :returns: the validated :class:`~llmgw.models.Catalog`.
    :raises CatalogError: with every problem found, each naming its path.
    """
    return parse_catalog(read_catalog_text(path), engines, source=str(path))


def read_catalog_text(path: str | Path) -> str:
    """The text of a catalog file, as ``ctl validate`` and ``ctl apply`` read it.

    :raises CatalogError: the file cannot be read, or is not UTF-8 (naming the byte).
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(str(path), [f"cannot read the file: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise CatalogError(str(path), [f"not UTF-8 text: {exc.reason} at byte {exc.start}"]) from None


def parse_catalog(
    text: str, engines: Mapping[str, Engine], *, source: str = "<catalog>", remote: bool = False
) -> Catalog:
    """Validate catalog YAML given as text; see :func:`load_catalog`.

    :param remote: the catalog is checked before it is sent to a server, whose plugins may provide engines
        that ``engines`` lacks: an engine not in ``engines`` is left for the server to check.
    """
    size = len(text.encode())
    if size > MAX_CATALOG_BYTES:
        raise CatalogError(
            source, [f"{size} bytes: a catalog is at most {MAX_CATALOG_BYTES} bytes (llmgw's limit)"]
        )
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        what = "" if isinstance(exc, _Refused) else "invalid YAML: "
        raise CatalogError(source, capped([f"{where}{what}{problem}"])) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise CatalogError(source, ["(top level): expected a mapping with the keys profiles and models"])
    problems: list[str] = []
    for key in sorted(set(data) - {"profiles", "models"}, key=str):
        problems.append(f"{key}: unknown key (expected one of: profiles, models)")
    sections: dict[str, dict[str, Any]] = {}
    for section, kind in (("profiles", Profile), ("models", Model)):
        sections[section], section_problems = _structure_section(data, section, kind)
        problems.extend(section_problems)
    profile_names = set(data.get("profiles") or {}) if isinstance(data.get("profiles"), dict) else set()
    problems.extend(
        _check_references(sections["profiles"], sections["models"], profile_names, engines, remote=remote)
    )
    problems.extend(_check_unstructured(data, sections, profile_names, engines, remote=remote))
    problems.extend(lora.not_catalog_keys(data, {"profiles": Profile}))  # Model's are omitted (wire)
    if problems:
        raise CatalogError(source, capped(problems))
    profiles = lora.with_adapters_at_start(sections["profiles"], engines)
    return Catalog(profiles=profiles, models=sections["models"])


def _structure_section(data: dict, section: str, kind: type) -> tuple[dict[str, Any], list[str]]:
    """Structure every entry of one section on its own, so one bad entry hides no other."""
    raw = data.get(section)
    if raw is None:
        return {}, []
    if not isinstance(raw, dict):
        return {}, [f"{section}: expected a mapping of names to {section}"]
    out: dict[str, Any] = {}
    problems: list[str] = []
    for key, entry in raw.items():
        path = (section, str(key))
        if not isinstance(key, str):
            problems.append(f"{_dotted(path)}: expected a string name")
            continue
        if not isinstance(entry, dict):
            problems.append(f"{_dotted(path)}: expected a mapping")
            continue
        autoscale = None
        if kind is Model and isinstance(entry.get("replicas"), dict):
            entry = dict(entry)
            autoscale, autoscale_problems = _structure(entry.pop("replicas"), Autoscale, (*path, "replicas"))
            if autoscale is None:
                problems.extend(autoscale_problems)
                continue
            entry["replicas"] = autoscale.min
        structured, entry_problems = _structure(entry, kind, path)
        problems.extend(entry_problems)
        if structured is not None:
            out[key] = attrs.evolve(structured, autoscale=autoscale) if autoscale is not None else structured
    return out, problems


def _structure(entry: dict, kind: type, path: tuple[str, ...]) -> tuple[Any, list[str]]:
    """One record from a mapping at ``path``: (the record, []) or (None, its problems)."""
    try:
        return converter.structure(entry, kind), []
    except (ClassValidationError, IterableValidationError) as exc:
        return None, _flatten(exc, path)
    except (ValueError, TypeError) as exc:  # an attrs validator: the invariant's field
        return None, [f"{_dotted(path + (_field_of(exc),))}: {_plain(exc)}"]


def _field_of(exc: BaseException) -> str:
    match = re.match(r"(\w+) must be", str(exc))
    return match.group(1) if match else ""


def _check_unstructured(
    data: dict,
    structured: Mapping[str, Mapping[str, Any]],
    profile_names: set[str],
    engines: Mapping[str, Engine],
    *,
    remote: bool,
) -> list[str]:
    """Entries that failed to structure still get their references checked."""
    problems = []
    known = ", ".join(sorted(engines)) or "none installed"
    defined = ", ".join(sorted(profile_names)) or "none defined"
    checks = [("models", "profile", profile_names, f"no profile named {{!r}} (profiles: {defined})")]
    if not remote:
        checks.append(
            ("profiles", "engine", engines, f"no plugin provides engine {{!r}} (engines there are: {known})")
        )
    for section, field, valid, message in checks:
        raw = data.get(section)
        if not isinstance(raw, dict):
            continue
        for name, entry in raw.items():
            if name in structured[section] or not isinstance(entry, dict):
                continue
            value = entry.get(field)
            if isinstance(value, str) and value not in valid:
                problems.append(f"{section}.{name}.{field}: " + message.format(value))
    return problems


def _check_references(
    profiles: Mapping[str, Profile],
    models: Mapping[str, Model],
    profile_names: set[str],
    engines: Mapping[str, Engine],
    *,
    remote: bool,
) -> list[str]:
    problems: list[str] = []
    known = ", ".join(sorted(engines)) or "none installed"
    for name, profile in profiles.items():
        where = f"profiles.{name}"
        if not NAME.match(name):
            problems.append(f"{where}: {BAD_NAME}")
        engine = engines.get(profile.engine)
        if engine is None and not remote:
            problems.append(
                f"{where}.engine: no plugin provides engine {profile.engine!r} (engines there are: {known})"
            )
        elif profile.nodes > 1 and not engine.multi_node:
            problems.append(
                f"{where}.nodes: engine {profile.engine!r} cannot run one replica on "
                f"{profile.nodes} nodes; use nodes: 1 or a multi-node engine"
            )
        if engine is not None:
            problems.extend(_check_args(where, profile, engine))
        sidecar_names = [s.name for s in profile.sidecars]
        for index, sidecar in enumerate(profile.sidecars):
            if sidecar_names.count(sidecar.name) > 1:
                problems.append(f"{where}.sidecars[{index}].name: {sidecar.name!r} is used twice")
            if not sidecar.argv:
                problems.append(f"{where}.sidecars[{index}].argv: expected a non-empty list")
            if sidecar.ready is not None and not re.match(
                r"^(tcp:(\d+|\{port\})|http:(\d+|\{port\})/.*)$", sidecar.ready
            ):
                problems.append(
                    f"{where}.sidecars[{index}].ready: expected 'tcp:PORT' or 'http:PORT/PATH' (PORT may be "
                    f"{{port}}, the sidecar's own free port), got {sidecar.ready!r}"
                )
    served: dict[str, str] = {}
    for name, model in models.items():
        where = f"models.{name}"
        if not NAME.match(name):
            problems.append(f"{where}: {BAD_NAME}")
        if model.profile not in profile_names:
            defined = ", ".join(sorted(profile_names)) or "none defined"
            problems.append(f"{where}.profile: no profile named {model.profile!r} (profiles: {defined})")
        source_problem = check_source(model.source)
        if source_problem is not None:
            problems.append(f"{where}.source: {source_problem}")
        served_name = model.served_name or name
        if served_name in served:
            problems.append(
                f"{where}.served_name: {served_name!r} is already served by models.{served[served_name]}"
            )
        served[served_name] = name
        problems.extend(_check_scaling(where, model))
        profile = profiles.get(model.profile)
        if model.adapters:
            problems.extend(check_lora_engine(where, model, profile, engines))
        if model.autoscale is not None and profile is not None and profile.engine in engines:
            problems.extend(_check_signals(where, model, engines[profile.engine]))
    problems.extend(check_adapters(models, served))
    return problems


def _check_signals(where: str, model: Model, engine: Engine) -> list[str]:
    """Targets the model's engine reports no gauge for (the autoscaler would never see them); ``ttft_p95``
    is measured by the gateways, whatever the engine."""
    assert model.autoscale is not None
    targets = model.autoscale.target.signals()
    targets.pop("ttft_p95", None)
    load = engine.load_metrics
    if load is None and targets:
        return [
            f"{where}.replicas.target: engine {engine.name!r} reports no load gauges (its plugin names "
            "none), so nothing could be measured against a target; give replicas as a number"
        ]
    if load is not None and "kv_cache_usage" in targets and not load.kv_cache_usage:
        return [f"{where}.replicas.target.kv_cache_usage: engine {engine.name!r} reports no KV-cache usage"]
    return []


def _check_scaling(where: str, model: Model) -> list[str]:
    """What a model's ``replicas:`` mapping and ``idle_after`` ask that makes no sense together."""
    problems = []
    auto = model.autoscale
    if auto is not None:
        if auto.min > auto.max:
            problems.append(f"{where}.replicas.min: {auto.min} is above max ({auto.max})")
        if auto.max < 1:
            problems.append(f"{where}.replicas.max: expected an integer >= 1, got {auto.max}")
        if auto.min == 0 and model.idle_after is None:
            problems.append(
                f"{where}.idle_after: required when replicas.min is 0 (seconds without a request after "
                "which the model goes to zero replicas)"
            )
        if not auto.target.signals() and auto.min < auto.max:
            keys = ", ".join(a.name for a in attrs.fields(type(auto.target)))
            problems.append(
                f"{where}.replicas.target: expected at least one of {keys} when min ({auto.min}) and "
                f"max ({auto.max}) differ: nothing would say when to scale"
            )
    if model.idle_after is not None and (auto is None or auto.min != 0):
        problems.append(
            f"{where}.idle_after: only for a model whose replicas.min is 0 (it says when such a model "
            "goes to zero replicas)"
        )
    return problems


def _check_args(where: str, profile: Profile, engine: Engine) -> list[str]:
    """Refuse extra args that set a flag llmgw itself sets for this engine."""
    try:
        managed = _managed_flags(engine)
    except Exception:  # noqa: BLE001 - a broken engine is reported by engine-check
        return []
    problems = []
    for index, arg in enumerate(profile.args):
        flag = arg.split("=", 1)[0]
        if flag in managed:
            problems.append(
                f"{where}.args[{index}]: {flag} is set by llmgw for engine {engine.name!r}; "
                "remove it from args"
            )
    return problems


def _managed_flags(engine: Engine) -> frozenset[str]:
    widest = attrs.evolve(engine.widest_spec(), extra_args=())
    flags: set[str] = set()
    for rank in range(widest.nnodes):
        command = engine.build_command(attrs.evolve(widest, rank=rank))
        flags.update(a.split("=", 1)[0] for a in engine.option_args(command) if a.startswith("-"))
    return frozenset(flags)


def catalog_summary(catalog: Catalog) -> str:
    """One line saying what a valid catalog holds."""
    replicas = sum(m.replicas for m in catalog.models.values())
    engines = sorted({p.engine for p in catalog.profiles.values()})
    adapters = sum(len(m.adapters) for m in catalog.models.values())
    with_adapters = f", {adapters} adapters" if adapters else ""
    return (
        f"{len(catalog.models)} models, {replicas} replicas{with_adapters}, {len(catalog.profiles)} profiles "
        f"(engines: {', '.join(engines) or 'none'})"
    )
