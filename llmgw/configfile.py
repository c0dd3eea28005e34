"""Config files for ``llmgw server`` and ``llmgw gateway``: every flag is a TOML key of the same name.

A key is the flag's long name without ``--``, with ``_`` for ``-``
(``--max-attempts 5`` is ``max_attempts = 5``, ``--no-keys`` is
``no_keys = true``); relative paths are relative to the file. A setting is
taken from the first of: the flag, its environment variable (those ``--help``
shows as ``env var``), the file (``--config PATH``), the default. The agent's
``agent.toml`` (:mod:`llmgw.agent.config`) follows the same order.

The file is read while the command line is parsed, before anything starts:
an unknown key or a value of the wrong type is refused with the file, the key
and what was expected, and the process exits 2. ``--show-config`` prints the
settings in force, each with where it came from, and exits.
"""

from __future__ import annotations

import difflib
import functools
import json
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from llmgw.errors import LlmgwError
from llmgw.logs import configure_logging, log_options, resolve_log_settings

__all__ = ["ConfigFileError", "config_options", "settings_lines", "toml_value"]

#: options that are not settings: they cannot be keys of the file
_NOT_SETTINGS = frozenset({"config", "show_config", "help", "verbose"})
_META_PATH = "llmgw.config_file"


class ConfigFileError(LlmgwError):
    """A config file that cannot be used; the message names the file, the key and what was expected."""

    exit_code = 2


def _settings(command: click.Command) -> dict[str, click.Parameter]:
    return {
        p.name: p
        for p in command.params
        if isinstance(p, click.Option) and p.name and p.name not in _NOT_SETTINGS and p.expose_value
    }


def _expected(param: click.Parameter) -> str:
    """What a TOML value of ``param`` must be, in words."""
    kind = param.type
    if isinstance(param, click.Option) and param.is_flag:
        return "true or false"
    if isinstance(kind, click.Choice):
        return "one of " + ", ".join(map(str, kind.choices))
    if isinstance(kind, click.IntRange | click.FloatRange):
        noun = "an integer" if isinstance(kind, click.IntRange) else "a number"
        if None not in (kind.min, kind.max) and not (kind.min_open or kind.max_open):
            return f"{noun} from {kind.min:g} to {kind.max:g}"
        low = None if kind.min is None else f"{'>' if kind.min_open else '>='} {kind.min:g}"
        high = None if kind.max is None else f"{'<' if kind.max_open else '<='} {kind.max:g}"
        return " ".join([noun, " and ".join(b for b in (low, high) if b)])
    if isinstance(kind, click.types.IntParamType):
        return "an integer"
    if isinstance(kind, click.types.FloatParamType):
        return "a number"
    if isinstance(kind, click.Path):
        return "a path (a string)"
    return "a string"


def _type_fits(param: click.Parameter, value: Any) -> bool:
    kind = param.type
    if isinstance(param, click.Option) and param.is_flag:
        return type(value) is bool
    if isinstance(kind, click.types.IntParamType):
        return type(value) is int
    if isinstance(kind, click.types.FloatParamType):
        return type(value) in (int, float)
    return type(value) is str


def _value(path: Path, key: str, param: click.Parameter, value: Any, ctx: click.Context) -> Any:
    """``value`` as the command would take it from its flag; refuses a wrong type or range."""
    if param.multiple:
        if not isinstance(value, list):
            raise ConfigFileError(f"{path}: {key}: expected a list of {_expected(param)}, got {value!r}")
        return tuple(_value(path, key, param, v, ctx) for v in value)
    if not _type_fits(param, value):
        raise ConfigFileError(f"{path}: {key}: expected {_expected(param)}, got {value!r}")
    if isinstance(param.type, click.Path):
        value = str(path.absolute().parent / Path(value).expanduser())
    if isinstance(param, click.Option) and param.is_flag:
        return value
    try:
        return param.type.convert(value, param, ctx)
    except click.BadParameter:
        raise ConfigFileError(f"{path}: {key}: expected {_expected(param)}, got {value!r}") from None


def read_config_file(path: Path, command: click.Command, ctx: click.Context) -> dict[str, Any]:
    """The settings a config file for ``command`` gives, by parameter name, checked as its flags would be.

    :raises ConfigFileError: the file cannot be read, is not TOML, has a key
        that is no setting of ``command`` or a value of the wrong type.
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{path}: not valid TOML: {exc}") from None
    settings = _settings(command)
    values = {}
    for key, value in data.items():
        param = settings.get(key)
        if param is None:
            close = difflib.get_close_matches(key, settings, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigFileError(
                f"{path}: unknown key {key!r}{hint}; the keys of `llmgw {command.name}` are its flags "
                f"with _ for -: {', '.join(sorted(settings))}"
            )
        values[key] = _value(path, key, param, value, ctx)
    return values


def _load(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    if value is None:
        return
    values = read_config_file(value, ctx.command, ctx)
    ctx.default_map = {**(ctx.default_map or {}), **values}
    ctx.meta[_META_PATH] = value


def toml_value(value: Any) -> str:
    """``value`` written as TOML (what ``--show-config`` prints after ``key =``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def settings_lines(ctx: click.Context, values: dict[str, Any]) -> list[str]:
    """The settings in force as TOML lines, each with a comment saying where it came from.

    Called by ``--show-config``; what it prints is a valid config file.
    """
    command = ctx.command
    path = ctx.meta.get(_META_PATH)
    lines = [f"# llmgw {command.name}: settings in force (flag > environment > {path or 'file'} > default)"]
    for name, param in sorted(_settings(command).items()):
        source = ctx.get_parameter_source(name)
        value = values.get(name)
        origin = {
            ParameterSource.COMMANDLINE: "flag",
            ParameterSource.ENVIRONMENT: f"environment {getattr(param, 'envvar', '')}",
            ParameterSource.DEFAULT_MAP: f"file {path}",
        }.get(source, "default")
        if value is None or value == ():
            lines.append(f"# {name} = ...  (not set)")
        else:
            lines.append(f"{name} = {toml_value(value)}  # {origin}")
    return lines


def config_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give a long-running click command ``--config``, ``--show-config`` and the log options.

    Put it under ``@click.command`` (above the other options). The command's
    own function does not see them: before it runs, logging is configured
    (:func:`llmgw.logs.configure_logging`), or with ``--show-config`` the
    settings are printed and it does not run.
    """

    @functools.wraps(command)
    def run(
        *args: Any, log_format: str | None, log_level: str | None, verbose: bool, show_config: bool, **kw: Any
    ):
        ctx = click.get_current_context()
        log_format, log_level = resolve_log_settings(log_format, log_level, verbose)
        if show_config:
            shown = {**ctx.params, "log_format": log_format, "log_level": log_level}
            for line in settings_lines(ctx, shown):
                click.echo(line)
            return None
        configure_logging(log_format, log_level)
        return command(*args, **kw)

    run = log_options(run)
    run = click.option(
        "--show-config",
        is_flag=True,
        help="Print the settings in force (from flags, environment, file, defaults) as TOML, and exit.",
    )(run)
    return click.option(
        "--config",
        type=click.Path(dir_okay=False, path_type=Path),
        is_eager=True,
        expose_value=False,
        callback=_load,
        help="A TOML file of settings: each key a flag's name with _ for - (flags and environment win).",
    )(run)
