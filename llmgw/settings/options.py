"""A command's click options, made from its settings class, and the door that loads them.

``@settings_options(GatewaySettings)`` under ``@click.command`` gives the
command one option per setting (``--max-attempts``, with the range, default
and environment variable the field declares), ``--config PATH``,
``--show-config`` and, for a process that logs, ``-v``. The command's
function receives one argument, the settings in force
(:func:`llmgw.settings.load.load_settings`); with ``--show-config`` they are
printed instead and the function does not run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_origin

import attrs
import click
from click.core import ParameterSource

from llmgw.settings.fields import bare_type, is_table, settings_fields, spec_of
from llmgw.settings.load import load_settings
from llmgw.settings.show import settings_lines

__all__ = ["settings_options"]


def _click_type(field: attrs.Attribute) -> dict[str, Any]:
    """The keyword arguments of ``click.option`` that give ``field``'s type, range and default."""
    spec, kind = spec_of(field), bare_type(field.type)
    default = (
        None if field.default is attrs.NOTHING or isinstance(field.default, attrs.Factory) else field.default
    )
    shown = spec.shown_default or default
    out: dict[str, Any] = {"default": shown if shown not in (None, ()) else None, "show_default": True}
    if kind is bool:
        return {"is_flag": True, "default": None}
    if spec.read is not None or is_table(kind):
        out["multiple"] = get_origin(kind) is not tuple and is_table(kind)
    elif spec.choices:
        out["type"] = click.Choice(spec.choices, case_sensitive=False)
    elif kind in (int, float):
        ranged = click.IntRange if kind is int else click.FloatRange
        bounded = spec.min is not None or spec.max is not None
        out["type"] = ranged(spec.min, spec.max, min_open=spec.min_open) if bounded else kind
    elif kind is Path:
        out["type"] = click.Path(dir_okay=spec.directory, file_okay=not spec.directory, path_type=Path)
    elif get_origin(kind) is tuple:
        out.update(multiple=True, default=None)
    return out


def _option(field: attrs.Attribute) -> Callable[[Any], Any]:
    spec = spec_of(field)
    flag = "--" + (spec.flag or field.name).replace("_", "-")
    return click.option(
        flag,
        field.name,
        envvar=spec.env,
        show_envvar=spec.env is not None,
        metavar=spec.metavar,
        help=spec.help,
        **_click_type(field),
    )


_CONFIG = click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A TOML file of settings: each key a flag's name with _ for - (flags and environment win).",
)
_SHOW = click.option(
    "--show-config",
    is_flag=True,
    help="Print the settings in force (from flags, environment, file, defaults) as TOML, and exit.",
)
_VERBOSE = click.option("-v", "--verbose", is_flag=True, help="Log debug messages (as --log-level debug).")


def _given(ctx: click.Context, params: dict[str, Any], source: ParameterSource) -> dict[str, Any]:
    return {name: value for name, value in params.items() if ctx.get_parameter_source(name) is source}


def settings_options(cls: type, *, logs: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make a click command's options from settings class ``cls``; its function gets the settings.

    Put it under ``@click.command``. With ``logs`` (a class with ``log_format``
    and ``log_level``) it adds ``-v`` and configures logging before the
    function runs (:func:`llmgw.logs.configure_logging`).
    """
    fields = settings_fields(cls)

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def run(*, config: Path | None, show_config: bool, verbose: bool = False, **params: Any) -> Any:
            ctx = click.get_current_context()
            flags = _given(ctx, params, ParameterSource.COMMANDLINE)
            if verbose:
                flags["log_level"] = "debug"
            environment = _given(ctx, params, ParameterSource.ENVIRONMENT)
            loaded = load_settings(cls, flags=flags, environment=environment, file=config)
            if show_config:
                for line in settings_lines(loaded, ctx.command.name or ""):
                    click.echo(line)
                return None
            if logs:
                from llmgw.logs import configure_logging

                configure_logging(loaded.settings.log_format, loaded.settings.log_level)
            return command(loaded.settings)

        options = [_CONFIG, *(_option(f) for f in fields if not attrs.has(bare_type(f.type)))]
        options += [_VERBOSE, _SHOW] if logs else [_SHOW]
        return functools.reduce(lambda f, option: option(f), reversed(options), run)

    return decorate
