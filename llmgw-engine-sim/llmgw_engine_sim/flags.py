"""The sim's option flags: fields of an options class that ``llmgw-sim`` takes as flags, said once.

A field made with :func:`option` names its flag, the check of its value and its help; :func:`add_options`
adds every such field of a class to the parser, with the field's default (``{default}`` in the help shows
it), and :func:`options_from_args` makes the class again from the parsed flags; :func:`option_args` spells
options as flags again, for a command line. The checks are here too,
for the flags :mod:`llmgw_engine_sim.process` adds itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

__all__ = [
    "add_options",
    "non_negative",
    "option",
    "option_args",
    "options_from_args",
    "positive_float",
    "positive_int",
]

T = TypeVar("T")


def non_negative(kind: type) -> Callable[[str], Any]:
    """A flag's check: its text as a ``kind``, at least 0 (argparse names ``kind`` when the text is none)."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def positive_int(text: str) -> int:
    """A flag's check: its text as an int, at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def positive_float(text: str) -> float:
    """A flag's check: its text as a float, above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def option(
    default: Any, flag: str, text: str, check: Callable[[str], Any] | None = None, metavar: str = ""
) -> Any:
    """An attrs field of an options class whose value ``flag`` gives: checked by ``check`` (None: a switch,
    off by default), shown with ``metavar`` and the help ``text`` (``{default}`` in it is the default).

    Called in the class body of the sim's options classes. :returns: the field.
    """
    return attrs.field(default=default, metadata={"flag": (flag, check, metavar, text)})


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add the flag of every :func:`option` field of ``cls`` to ``parser``, in the fields' order.

    Called by :func:`llmgw_engine_sim.process.build_parser`.
    """
    for field in attrs.fields(cls):
        flag, check, metavar, text = field.metadata["flag"]
        shown = text.format(default=field.default)
        if check is None:
            parser.add_argument(flag, action="store_true", help=shown)
        else:
            parser.add_argument(flag, type=check, default=field.default, metavar=metavar, help=shown)


def options_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """``cls`` from the flags :func:`add_options` added and argparse parsed into ``args``.

    Called by the sim's run once it parsed its command line. :returns: the options.
    """
    values = {}
    for field in attrs.fields(cls):  # type: ignore[arg-type]
        flag = field.metadata["flag"][0]
        values[field.name] = getattr(args, flag.removeprefix("--").replace("-", "_"))
    return cls(**values)


def option_args(options: Any, *names: str) -> list[str]:
    """The flags that give the fields ``names`` of ``options`` their values, in the fields' order: a switch's
    flag when it is on, any other flag with its value.

    Called by the sim's plugin as it builds an ``llmgw-sim`` command. :returns: the arguments.
    """
    args: list[str] = []
    for field in attrs.fields(type(options)):
        if field.name not in names:
            continue
        flag, check = field.metadata["flag"][:2]
        value = getattr(options, field.name)
        args += ([flag] if value else []) if check is None else [flag, str(value)]
    return args
