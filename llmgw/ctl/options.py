"""Options every ``llmgw ctl`` command spells alike: ``-o`` (output), ``--watch`` (listings that change)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

__all__ = ["OUTPUTS", "interval_option", "output_option", "watch_options"]

#: what ``-o`` takes on every listing: ``wide`` is the table with more columns (the same where none help)
OUTPUTS = ("table", "wide", "json", "yaml")


def output_option(people: str = "A table") -> Callable[[Any], Any]:
    """``-o/--output table|wide|json|yaml``; ``people`` names the table form (``"Lines"`` for ctl diff).

    The command receives ``output``, one of :data:`OUTPUTS`; :func:`llmgw.ctl.output.show` prints it.
    """
    return click.option(
        "-o",
        "--output",
        type=click.Choice(OUTPUTS),
        default="table",
        show_default=True,
        help=f"{people} for people (wide: with more columns), or JSON or YAML for scripts.",
    )


def watch_options(what: str = "Print the listing again") -> Callable[[Any], Any]:
    """``-w/--watch`` and ``--interval SECONDS``: the command receives ``watch`` and ``interval``."""
    options = [
        click.option(
            "-w",
            "--watch",
            is_flag=True,
            help=f"{what} every --interval seconds until Ctrl-C (on a terminal the screen is redrawn; "
            "otherwise each is appended, JSON one object per line).",
        ),
        interval_option("--watch", 2.0),
    ]
    return lambda command: functools.reduce(lambda f, option: option(f), reversed(options), command)


def interval_option(flag: str, default: float) -> Callable[[Any], Any]:
    """``--interval SECONDS`` (at least 0.1): the seconds between two looks with ``flag``."""
    return click.option(
        "--interval",
        type=click.FloatRange(min=0.1),
        metavar="SECONDS",
        default=default,
        show_default=True,
        help=f"Seconds between two looks with {flag}.",
    )
