"""Options every ``llmgw ctl`` command spells alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

__all__ = ["output_option"]


def output_option(people: str = "A table") -> Callable[[Any], Any]:
    """``-o/--output table|json``; ``people`` names what the table form is (``"Lines"`` for ctl diff)."""
    return click.option(
        "-o",
        "--output",
        type=click.Choice(["table", "json"]),
        default="table",
        show_default=True,
        help=f"{people} for people, or JSON for scripts.",
    )
