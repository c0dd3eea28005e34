"""The one settings loader: flag > environment variable > config file > default, each value checked.

:func:`load_settings` takes what the command line and the environment gave
(click read them, through the options :mod:`llmgw.settings.options` made)
and a TOML file, and builds the settings class, remembering where each
setting came from for ``--show-config``. A bad value is refused with where it
came from and what was expected: ``server.toml: lost_after: expected a
number, got 'x'``, ``--max-uploads: expected an integer >= 1, got 0``.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

import attrs
from cattrs.errors import BaseValidationError

from llmgw.errors import LlmgwError
from llmgw.settings.fields import bare_type, describe, is_table, problem, settings_fields, spec_of
from llmgw.wire import converter

__all__ = ["Loaded", "SettingsError", "load_settings", "read_settings_file", "where_of"]

S = TypeVar("S")


class SettingsError(LlmgwError):
    """A setting that cannot be used; the message names its flag, variable or file and key, and what fits."""

    exit_code = 2


@attrs.frozen
class Loaded(Generic[S]):
    """Settings in force and, for each, where it came from."""

    settings: S
    #: setting (``health.interval`` in a table) -> ``flag``, ``environment VAR``, ``file PATH`` (else default)
    origins: Mapping[str, str]
    #: the config file read, if any
    file: Path | None = None


def where_of(field: attrs.Attribute, origin: str | None) -> str:
    """How an error names a setting from ``origin``: ``--peer-port``, ``LLMGW_SERVER``, ``FILE: key``."""
    flag = "--" + (spec_of(field).flag or field.name).replace("_", "-")
    if origin is None:
        return f"{flag} (default {spec_of(field).shown_default or field.default})"
    if origin.startswith("environment "):
        return origin.removeprefix("environment ")
    if origin.startswith("file "):
        return f"{origin.removeprefix('file ')}: {field.name}"
    return flag


def _refuse(errors: list[str]) -> None:
    if errors:
        raise SettingsError("; ".join(errors))


def read_settings_file(cls: type, path: Path) -> dict[str, Any]:
    """The settings a TOML file gives, by name (a table as a dict of the keys written), checked.

    Relative paths in it are made relative to its folder.

    :raises SettingsError: the file cannot be read, is not TOML, has a key
        that is no setting of ``cls`` or a value of the wrong type or range
        (every problem of the file in one message).
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    errors: list[str] = []
    values = _read_table(cls, data, path, "", errors)
    _refuse(errors)
    return values


def _read_table(cls: type, data: Mapping[str, Any], path: Path, prefix: str, errors: list[str]) -> dict:
    fields = {f.name: f for f in settings_fields(cls)}
    values = {}
    for key, raw in data.items():
        field = fields.get(key)
        if field is None:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            table = f" of [{prefix[:-1]}]" if prefix else ""
            errors.append(
                f"{path}: unknown key '{prefix}{key}'{hint}; the keys{table} are: {', '.join(fields)}"
            )
            continue
        kind = bare_type(field.type)
        if attrs.has(kind):
            if isinstance(raw, dict):
                values[key] = _read_table(kind, raw, path, f"{prefix}{key}.", errors)
            else:
                errors.append(f"{path}: {prefix}{key}: expected a table ([{prefix}{key}]), got {raw!r}")
            continue
        try:
            value = _read_value(field, raw, f"{path}: {prefix}{key}")
        except SettingsError as exc:
            errors.append(str(exc))
            continue
        if spec_of(field).path or kind is Path:
            value = _rebase(value, path.absolute().parent)
            value = Path(value) if kind is Path else value
        values[key] = value
    return values


def _read_value(field: attrs.Attribute, raw: Any, where: str, *, written: bool = True) -> Any:
    """``raw`` as written in a file (or given by a flag), as ``field``'s value, checked.

    :raises SettingsError: naming ``where``, and what was expected.
    """
    spec, kind = spec_of(field), bare_type(field.type)
    try:
        if spec.read is not None:
            value = spec.read(raw, where)
        elif written:
            value = converter.structure(raw, str if kind is Path else kind)
        else:  # click made it of the field's type
            value = raw
    except (TypeError, ValueError, LlmgwError, BaseValidationError) as exc:
        said = str(exc) if where in str(exc) else f"{where}: expected {describe(field)}, got {raw!r}"
        raise SettingsError(said) from None
    return _in_range(field, value, where)


def _in_range(field: attrs.Attribute, value: Any, where: str) -> Any:
    if isinstance(value, str) and spec_of(field).choices:
        value = value.lower()
    if not is_table(field.type) and not isinstance(value, tuple) and (why := problem(field, value)):
        raise SettingsError(f"{where}: {why}")
    return value


def _rebase(value: Any, base: Path) -> Any:
    """A path (or the paths in a mapping or list) made relative to ``base`` unless absolute."""
    if isinstance(value, Mapping):
        return {key: _rebase(v, base) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_rebase(v, base) for v in value)
    return str(base / Path(value).expanduser())


def _merge(low: Any, high: Any) -> Any:
    """``high`` over ``low``; mappings merged key by key (a flag's engine over the file's)."""
    if isinstance(low, Mapping) and isinstance(high, Mapping):
        return {**low, **{key: _merge(low.get(key), value) for key, value in high.items()}}
    return high


def load_settings(
    cls: type[S],
    *,
    flags: Mapping[str, Any] | None = None,
    environment: Mapping[str, Any] | None = None,
    file: Path | None = None,
) -> Loaded[S]:
    """Build ``cls`` from flags, environment variables, a config file and the defaults, in that order.

    Called by every command :func:`llmgw.settings.options.settings_options`
    made, and by tests with ``flags`` alone. ``flags`` and ``environment`` map
    setting names to values of the setting's type, or, for a setting with a
    ``read``, to what the command line gave; None or ``()`` means "not given".

    :raises SettingsError: a bad file, a value out of range, a required setting missing.
    """
    fields = {f.name: f for f in settings_fields(cls)}
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if file is not None:
        file = Path(file)
        for key, value in read_settings_file(cls, file).items():
            values[key] = value
            subkeys = [f"{key}.{sub}" for sub in value] if attrs.has(bare_type(fields[key].type)) else [key]
            origins.update(dict.fromkeys(subkeys, f"file {file}"))
    errors: list[str] = []
    layers = [(environment or {}, lambda f: f"environment {spec_of(f).env}"), (flags or {}, lambda f: "flag")]
    for given, origin_of in layers:
        for key, raw in given.items():
            field = fields[key]
            if raw is None or raw in ((), {}):
                continue
            where = where_of(field, origin_of(field))
            try:
                value = _read_value(field, raw, where, written=False)
            except SettingsError as exc:
                errors.append(str(exc))
                continue
            values[key] = _merge(values.get(key), value)
            origins[key] = origin_of(field)
    _refuse(errors)
    missing = [f for f in fields.values() if f.default is attrs.NOTHING and not values.get(f.name)]
    if missing:
        names = ", ".join("--" + f.name.replace("_", "-") for f in missing)
        where = f"in {file}" if file is not None else "in a config file (--config)"
        raise SettingsError(f"missing {names}: give each on the command line or {where}")
    for key, value in list(values.items()):
        kind = bare_type(fields[key].type)
        if attrs.has(kind):  # a table: the keys written over its defaults
            values[key] = kind(**value)
    settings = cls(**values)
    checked = {}
    for field in fields.values():
        value, check = getattr(settings, field.name), spec_of(field).check
        if check is not None and value is not None:
            try:
                checked[field.name] = check(value, where_of(field, origins.get(field.name)))
            except ValueError as exc:
                errors.append(str(exc))
    _refuse(errors)
    return Loaded(attrs.evolve(settings, **checked), origins, file)
