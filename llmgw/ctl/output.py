"""How ``ctl`` listings print: a table (``wide``: more columns), JSON or YAML, once or again and again.

Every listing is three functions: ``fetch()`` asks the server, ``doc(data)``
is what ``-o json`` and ``-o yaml`` print, ``table(data, wide)`` the lines
for people. :func:`show` prints it once or, with ``--watch``, until Ctrl-C;
:func:`show_admin` does so for what one ``GET`` of the admin API answers, and
:func:`model_listing` makes the command of such a listing, of every model or one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import click
import yaml
from tabulate import tabulate

from llmgw.ctl.client import AdminClient, CtlError
from llmgw.ctl.options import output_option, watch_options
from llmgw.wire import to_json

__all__ = ["follow", "model_listing", "show", "show_admin", "structured", "table"]

T = TypeVar("T")


def table(rows: list[list[Any]], headers: list[str]) -> str:
    """Rows under their headers, or ``(none)``."""
    return tabulate(rows, headers=headers, tablefmt="simple") if rows else "(none)"


def structured(output: str, doc: Any, *, stream: bool = False) -> str:
    """``doc`` as JSON or YAML; ``stream``: one JSON object a line, YAML documents each opened by ``---``."""
    if output == "json":
        return json.dumps(doc) if stream else json.dumps(doc, indent=2)
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).rstrip("\n")
    return f"---\n{text}" if stream else text


def _render(
    output: str, data: T, doc: Callable[[T], Any], lines: Callable[[T, bool], Iterable[str]], stream: bool
) -> str:
    if output in ("json", "yaml"):
        return structured(output, doc(data), stream=stream)
    return "\n".join(lines(data, output == "wide"))


def show(
    output: str,
    fetch: Callable[[], T],
    doc: Callable[[T], Any],
    lines: Callable[[T, bool], Iterable[str]],
    *,
    watch: bool = False,
    interval: float = 2.0,
) -> None:
    """Print a listing in ``output``; with ``watch``, again every ``interval`` seconds until Ctrl-C.

    Watching on a terminal redraws the screen under a line naming the command
    and the time; otherwise (a pipe, a file) each look is appended: tables
    under a ``--- TIME`` line, JSON one object per line, YAML one document
    each. An error on the first look ends the command; later ones are shown
    in place of the listing and the watch goes on (a server restarting).
    """
    if not watch:
        click.echo(_render(output, fetch(), doc, lines, stream=False))
        return
    on_terminal = sys.stdout.isatty()
    title = click.get_current_context().command_path
    first = True
    with _ctrl_c_ends_it():
        try:
            while True:
                try:
                    text = _render(output, fetch(), doc, lines, stream=not on_terminal)
                except CtlError as exc:
                    if first:
                        raise
                    text = f"error: {exc}"
                first = False
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                if on_terminal:
                    click.clear()
                    click.echo(f"every {interval:g}s: {title}    {stamp}\n")
                elif output not in ("json", "yaml"):
                    click.echo(f"--- {stamp}")
                click.echo(text)
                sys.stdout.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            return
        except BrokenPipeError:  # `... --watch | head`: the reader is gone
            _reader_gone()



def show_admin(
    ctx: click.Context,
    path: str,
    reply: type[T],
    lines: Callable[[T, bool], Iterable[str]],
    output: str,
    *,
    params: Mapping[str, Any] | None = None,
    doc: Callable[[T], Any] = to_json,
    watch: bool = False,
    interval: float = 2.0,
) -> None:
    """:func:`show` of what ``GET path`` (with ``params``) of the admin API answers, read as a ``reply``.

    ``doc`` is what ``-o json`` and ``-o yaml`` print (the whole answer by default).
    """
    client = AdminClient.for_command(ctx)
    show(
        output,
        lambda: client.request("GET", path, reply, params=params),
        doc,
        lines,
        watch=watch,
        interval=interval,
    )


def model_listing(
    name: str, path: str, reply: type[T], lines: Callable[[T, bool], Iterable[str]], help: str
) -> click.Command:
    """The ``ctl`` command ``name [MODEL]`` that shows (:func:`show_admin`) what ``GET path`` answers, for
    every model or MODEL's (``?model=``), with ``-o`` and ``--watch``; ``help`` is its ``--help`` text.

    Called once per such listing, when its module is imported; :returns: the command, to add to a group.
    """

    @click.command(name, help=help)
    @click.argument("model", required=False)
    @output_option()
    @watch_options()
    @click.pass_context
    def listing(ctx: click.Context, model: str | None, output: str, watch: bool, interval: float) -> None:
        params = {"model": model} if model else {}
        show_admin(ctx, path, reply, lines, output, params=params, watch=watch, interval=interval)

    return listing


def follow(
    fetch: Callable[[int], list[T]],
    key: Callable[[T], int],
    render: Callable[[T], str],
    since: int,
    interval: float,
) -> None:
    """Print what ``fetch(since)`` returns, then every ``interval`` seconds what came after, until Ctrl-C.

    ``key`` gives an item's increasing id (the next ``since``). Used by ``ctl events --follow``.
    """
    first = True
    with _ctrl_c_ends_it():
        try:
            while True:
                try:
                    items = fetch(since)
                except CtlError as exc:
                    if first:
                        raise
                    click.echo(f"error: {exc}", err=True)
                    items = []
                first = False
                for item in items:
                    click.echo(render(item))
                    since = max(since, key(item))
                sys.stdout.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            return
        except BrokenPipeError:
            _reader_gone()


@contextlib.contextmanager
def _ctrl_c_ends_it() -> Iterator[None]:
    """Within the block SIGINT raises KeyboardInterrupt, even when this process inherited it ignored (a job
    a script put in the background with ``&``: its ``kill -INT`` must still end a watch, as ``llmgw dev``'s
    does). Called by :func:`show` and :func:`follow`; off the main thread (tests) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _reader_gone() -> None:
    """stdout's reader went away: point stdout at /dev/null so that nothing fails flushing it at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
