"""One setting's declaration: an attrs field whose metadata says its help, variable, range and readers.

A process's settings class (``ServerSettings``, ``GatewaySettings``,
``AgentConfig``, ``DevSettings``) declares each setting once with
:func:`setting`; its flag, its key in the config file, its environment
variable and its line of ``--show-config`` are made from that declaration by
:mod:`llmgw.settings.options` and :mod:`llmgw.settings.load`. The field's
name is the key, and, with ``-`` for ``_``, the flag.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import attrs

__all__ = ["Setting", "setting", "spec_of", "settings_fields", "bare_type", "describe", "problem"]

_KEY = "llmgw.setting"


@attrs.frozen
class Setting:
    """What a settings field's metadata says about it (see :func:`setting` for each part)."""

    help: str
    env: str | None = None
    metavar: str | None = None
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    choices: tuple[str, ...] = ()
    expected: str | None = None
    flag: str | None = None
    directory: bool = False
    path: bool = False
    shown_default: str | None = None
    read: Callable[[Any, str], Any] | None = None
    check: Callable[[Any, str], Any] | None = None


def setting(
    default: Any = attrs.NOTHING,
    *,
    help: str,  # noqa: A002 - the name click gives it
    env: str | None = None,
    metavar: str | None = None,
    min: float | None = None,  # noqa: A002
    max: float | None = None,  # noqa: A002
    min_open: bool = False,
    choices: tuple[str, ...] = (),
    expected: str | None = None,
    flag: str | None = None,
    directory: bool = False,
    path: bool = False,
    shown_default: str | None = None,
    read: Callable[[Any, str], Any] | None = None,
    check: Callable[[Any, str], Any] | None = None,
    converter: Callable[[Any], Any] | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """Declare a setting as a field of an attrs settings class; no ``default`` (nor ``factory``): required.

    :param help: its ``--help`` line (the default, range and variable are added).
    :param env: the environment variable that gives it (below the flag, above the file).
    :param min, max, min_open: the range of a number; ``choices``: the strings it may be.
    :param expected: what the value must be, in words, when the type and range do not say it well.
    :param flag: the flag's name where it is not the field's: only a repeatable flag, named
        for one item (``--fabric``) while its key holds the list (``fabrics``).
    :param directory: a path to a directory (else to a file); ``path``: a string or a mapping
        of strings that are paths (a ``Path`` field is one anyway), relative to the config file.
    :param shown_default: the default as ``--help`` shows it, where the value does not say it.
    :param read: turns what a file or a flag gives (text, list or table) into the value;
        called as ``read(raw, where)``, raises ``ValueError`` or :class:`SettingsError` naming ``where``.
    :param check: checks (and may normalize) the value in force, whichever layer gave it:
        ``check(value, where) -> value``, raising as ``read`` does.
    """
    spec = Setting(
        help, env, metavar, min, max, min_open, choices, expected, flag, directory, path, shown_default,
        read, check,
    )  # fmt: skip
    if factory is not None:
        default = attrs.Factory(factory)
    return attrs.field(default=default, converter=converter, metadata={_KEY: spec})


def spec_of(field: attrs.Attribute) -> Setting:
    """The :class:`Setting` of a settings field."""
    return field.metadata[_KEY]


@functools.cache
def settings_fields(cls: type) -> tuple[attrs.Attribute, ...]:
    """The settings of ``cls`` in the order ``--help`` and ``--show-config`` list them.

    Types resolved; fields without :func:`setting` metadata are not settings;
    settings inherited from a base class (the log settings) come last.
    """
    attrs.resolve_types(cls)
    found = [f for f in attrs.fields(cls) if _KEY in f.metadata]
    return tuple(sorted(found, key=lambda f: f.inherited))


def bare_type(kind: Any) -> Any:
    """``kind`` without ``| None``."""
    if get_origin(kind) in (Union, types.UnionType):
        args = [a for a in get_args(kind) if a is not type(None)]
        return args[0] if len(args) == 1 else kind
    return kind


def is_table(kind: Any) -> bool:
    """Whether a setting of type ``kind`` is a TOML table of settings (``[health]``) or of tables."""
    kind = bare_type(kind)
    return attrs.has(kind) or get_origin(kind) in (dict, Mapping)


def describe(field: attrs.Attribute) -> str:
    """What a value of ``field`` must be, in words: ``an integer from 1 to 10``, ``one of text, json``."""
    spec, kind = spec_of(field), bare_type(field.type)
    if spec.expected:
        return spec.expected
    if spec.choices:
        return "one of " + ", ".join(spec.choices)
    if kind is bool:
        return "true or false"
    if kind in (int, float):
        noun = "an integer" if kind is int else "a number"
        if spec.min is not None and spec.max is not None and not spec.min_open:
            return f"{noun} from {spec.min:g} to {spec.max:g}"
        if spec.min is not None:
            return f"{noun} {'>' if spec.min_open else '>='} {spec.min:g}"
        return noun
    if kind is Path:
        return "a path (a string)"
    if get_origin(kind) is tuple:
        return "a list of strings"
    return "a non-empty string"


def problem(field: attrs.Attribute, value: Any) -> str | None:
    """Why ``value`` (of the right type) is out of ``field``'s range or choices; None when it is not."""
    spec = spec_of(field)
    wrong = (
        (spec.choices and str(value).lower() not in spec.choices)
        or (spec.min is not None and (value <= spec.min if spec.min_open else value < spec.min))
        or (spec.max is not None and value > spec.max)
        or value == ""
    )
    return f"expected {describe(field)}, got {value!r}" if wrong else None
