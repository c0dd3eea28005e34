"""The ``llmgw`` command line: the root group, ``llmgw plugins``, and the one error door.

Each subsystem keeps its commands in its own ``cli.py``; the root group loads
them by name when they are asked for (:data:`COMMANDS`), so ``llmgw plugins``
does not import the gateway and no subsystem imports another's commands.

Errors an operator can fix (:class:`~llmgw.errors.LlmgwError`) are shown by
:func:`show_error` as ``error: ...`` on stderr with their exit code; no
traceback, no exception group. ``llmgw`` (:class:`Group`),
``llmgw-provision-node`` and ``llmgw-onboard-node`` (:class:`Command`) and the
long-running ``llmgw server``, ``agent`` and ``gateway``
(:func:`serve_until_signalled`) all go through it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import click
from tabulate import tabulate

import llmgw
from llmgw.errors import LlmgwError
from llmgw.logs import TEXT_FORMAT, configure_logging, configured, current_format
from llmgw.plugins import get_plugin_manager

__all__ = [
    "COMMANDS",
    "Command",
    "Group",
    "cli",
    "error_leaves",
    "main",
    "serve_until_signalled",
    "show_error",
]

#: root command name -> "module:attribute" of its click command
COMMANDS = {
    "agent": "llmgw.agent.cli:agent",
    "ca": "llmgw.pki.cli:ca",
    "ctl": "llmgw.ctl.cli:ctl",
    "dev": "llmgw.dev.cli:dev",
    "discover": "llmgw.node.cli:discover",
    "gateway": "llmgw.gateway.cli:gateway_command",
    "server": "llmgw.server.cli:server_command",
    "version": "llmgw.version:version",
}


def error_leaves(error: BaseException) -> list[BaseException]:
    """Every exception inside ``error``, exception groups flattened (``error`` itself if it is not one)."""
    if not isinstance(error, BaseExceptionGroup):
        return [error]
    out: list[BaseException] = []
    for exc in error.exceptions:
        out.extend(error_leaves(exc))
    return out


def show_error(error: BaseException) -> int | None:
    """Print ``error`` for an operator if it is theirs to fix, and return its exit code.

    Called by every console script's door (:class:`Group`, the long-running
    commands). An :class:`LlmgwError`, or an exception group whose leaves are
    all ``LlmgwError``, is printed as ``error: message`` (one line per leaf)
    on stderr (a JSON log line, level error, in a process logging JSON) and its
    (first) exit code returned. Anything else is a bug: nothing is printed and
    None is returned, so the caller re-raises it.
    """
    leaves = error_leaves(error)
    if not leaves or not all(isinstance(e, LlmgwError) for e in leaves):
        return None
    for exc in leaves:
        if current_format() == "json":  # a process logging JSON ends with a JSON line too
            logging.getLogger("llmgw").error(str(exc), extra={"error": type(exc).__name__})
        else:
            click.echo(f"error: {exc}", err=True)
    return leaves[0].exit_code  # type: ignore[attr-defined]


@contextlib.contextmanager
def _door() -> Iterator[None]:
    """llmgw errors raised inside leave through :func:`show_error`, as :class:`SystemExit` with their code."""
    try:
        yield
    except (LlmgwError, BaseExceptionGroup) as exc:
        code = show_error(exc)
        if code is None:
            raise
        raise SystemExit(code) from None


class _Door:
    """What :class:`Group` and :class:`Command` share: their commands run inside :func:`_door`."""

    def invoke(self, ctx: click.Context) -> Any:
        with _door():
            return super().invoke(ctx)  # type: ignore[misc]


class Group(_Door, click.Group):
    """A click group whose commands' llmgw errors reach the operator through :func:`show_error`."""


class Command(_Door, click.Command):
    """A click command run as its own console script, its llmgw errors shown by :func:`show_error`."""


#: the log line of every llmgw process (in text; see llmgw.logs)
LOG_FORMAT = TEXT_FORMAT


def serve_until_signalled(
    serve: Callable[[], Awaitable[object]],
    *,
    log: logging.Logger,
    stop: Callable[[], object] | None = None,
    stopping: str = "stopping",
    stopping_again: str = "stopping now",
    log_level: int = logging.INFO,
) -> None:
    """Run ``serve()`` under trio until it returns, or until SIGTERM or SIGINT (Ctrl-C) stops it.

    Logging is the command's (``--log-format``, ``--log-level``: :mod:`llmgw.logs`); a caller
    that did not configure it gets text on stderr from ``log_level`` up.

    Called by ``llmgw server``, ``llmgw agent`` and ``llmgw gateway`` once
    their configuration is read. On the first signal (logged with
    ``stopping``) ``stop()`` is called if given, a graceful stop after which
    ``serve`` returns by itself; without ``stop``, ``serve`` is cancelled and
    does its own cleanup (the agent stops its shards, the server closes its
    store). A second signal while stopping is logged with ``stopping_again``
    and cancels ``serve``: it cuts a graceful stop short, and changes nothing
    for a ``serve`` already cancelled.

    Returns normally (exit status 0) after a signal stop or when ``serve``
    returns. An :class:`LlmgwError` raised by ``serve`` (alone or in an
    exception group) is shown by :func:`show_error` and ends the process with
    its exit code (:class:`SystemExit`); anything else propagates.
    """
    import trio

    async def run() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                serving = trio.CancelScope()

                async def serve_then_stop_listening() -> None:
                    with serving:
                        await serve()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(serve_then_stop_listening)
                signalled = False
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if not signalled:
                        signalled = True
                        log.info("%s: %s", name, stopping)
                        if stop is not None:
                            stop()
                        else:
                            serving.cancel()
                    else:
                        log.warning("%s while stopping: %s", name, stopping_again)
                        serving.cancel()

    if not configured():
        configure_logging("text", logging.getLevelName(log_level).lower())
    with _door():
        trio.run(run)


class _RootGroup(Group):
    """The root group: subsystem commands are imported when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands or name not in COMMANDS:
            return super().get_command(ctx, name)
        module, _, attribute = COMMANDS[name].partition(":")
        command = getattr(importlib.import_module(module), attribute)
        self.add_command(command, name)
        return command


@click.group(cls=_RootGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(llmgw.__version__, prog_name="llmgw")
def cli() -> None:
    """llmgw: run large language models on a fleet of GPU machines."""


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON records instead of a table.")
def plugins(as_json: bool) -> None:
    """List every plugin: distribution, version, hooks, engines, load errors.

    Exits 1 when any plugin failed to load, after listing them all.
    """
    manager = get_plugin_manager()
    records = manager.records()
    if as_json:
        click.echo(json.dumps([r.to_json() for r in records], indent=2))
    else:
        rows = [
            [
                r.name,
                r.distribution or "-",
                r.version or "-",
                r.status,
                ", ".join(h.removeprefix("llmgw_") for h in r.hooks) or "-",
                ", ".join(r.engines + r.provisioners) or "-",
            ]
            for r in records
        ]
        headers = ["plugin", "distribution", "version", "status", "hooks", "provides"]
        click.echo(tabulate(rows, headers=headers, tablefmt="simple"))
        for r in records:
            if r.error:
                click.echo(f"{r.name}: {r.error}", err=True)
    if any(r.status == "failed" for r in records):
        sys.exit(1)


def main() -> None:
    """Entry point of the ``llmgw`` console script."""
    cli(prog_name="llmgw")
