"""``llmgw ctl apply``, ``diff`` and ``catalog``: change the catalog in force, see what changes, read it back.

``apply`` shows what changed, refuses to remove models unless ``--prune``,
and with ``--wait`` returns once every replica the applied revision asks for
(per model, from the catalog) exists, is ready and is not outdated.
"""

from __future__ import annotations

import shutil
import textwrap
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from pathlib import Path

import click
from tabulate import tabulate

from llmgw.catalog import parse_catalog, read_catalog_text
from llmgw.ctl.client import AdminClient, CtlError
from llmgw.ctl.options import output_option
from llmgw.ctl.output import show, show_admin
from llmgw.engine import Engine
from llmgw.plugins import get_plugin_manager
from llmgw.wire import (
    ApplyCatalog,
    CatalogApplied,
    CatalogChange,
    CatalogDiff,
    CatalogHistory,
    CatalogText,
    ReplicaList,
    to_json,
)

__all__ = [
    "apply", "diff", "catalog", "diff_lines", "installed_engines", "replica_progress", "wait_for_revision",
]  # fmt: skip

_CATALOG_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
#: seconds between two looks at the replicas while ``apply --wait`` waits
WAIT_POLL = 0.5


def _client(ctx: click.Context) -> AdminClient:
    return AdminClient.for_command(ctx)


def _read(catalog: Path) -> str:
    """The catalog's text, checked here as ``ctl validate`` checks it, so a bad catalog is never sent.

    Engines the plugins installed here lack are left for the server to check (its plugins may have them).

    :raises CatalogError: the file cannot be read, or the catalog is invalid (every problem named).
    """
    text = read_catalog_text(catalog)
    parse_catalog(text, installed_engines(), source=str(catalog), remote=True)
    return text


def installed_engines() -> dict[str, Engine]:
    """The engines the plugins installed here provide, by name: what ``ctl validate`` checks against."""
    return {name: r.engine for name, r in get_plugin_manager().engines().items()}


# -- showing a diff ---------------------------------------------------------------------------------


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _effects(change: CatalogChange) -> str:
    parts = []
    if change.add:
        parts.append(f"{_plural(change.add, 'replica')} to place")
    if change.stop:
        parts.append(f"{_plural(change.stop, 'replica')} to stop")
    if change.outdated:
        parts.append(f"{change.outdated} outdated (to roll: each replaced once its replacement is ready)")
    return f": {', '.join(parts)}" if parts else ""


def _wrapped(field: str, width: int) -> list[str]:
    """A changed field's line, whole, wrapped at ``width``: spaces at a break go, continuations indented."""
    return textwrap.wrap(
        field, width, initial_indent="      ", subsequent_indent="          ", break_on_hyphens=False
    )


def diff_lines(diff: CatalogDiff, width: int | None = None) -> list[str]:
    """The lines ``ctl diff`` and ``ctl apply`` print for ``diff``: models, then profiles, fields indented.

    Values are shown whole, a long one wrapped at ``width`` columns (default: the terminal's, at least 60).
    """
    width = width or max(60, shutil.get_terminal_size().columns)
    if not diff.changes:
        return [f"no change against catalog revision {diff.revision}"]
    lines = [f"against catalog revision {diff.revision}:"]
    marks = {"added": "+", "removed": "-", "changed": "~"}
    for section in ("model", "profile"):
        for change in (c for c in diff.changes if c.section == section):
            mark = marks.get(change.change, "?")
            lines.append(f"  {mark} {section} {change.name}: {change.change}{_effects(change)}")
            for field in change.fields:
                lines.extend(_wrapped(field, width))
    return lines


@click.command()
@click.argument("catalog", type=_CATALOG_FILE)
@output_option("Lines")
@click.pass_context
def diff(ctx: click.Context, catalog: Path, output: str) -> None:
    """Show what applying CATALOG would change: models and profiles added, removed, changed (with the
    fields), replicas to place, stop, and those left outdated. Changes nothing."""
    body = ApplyCatalog(text=_read(catalog), name=str(catalog))
    client = _client(ctx)
    fetch = lambda: client.request("POST", "/v1/admin/catalog/diff", CatalogDiff, body=body)  # noqa: E731
    show(output, fetch, to_json, lambda result, _wide: diff_lines(result))


# -- applying ---------------------------------------------------------------------------------------


@click.command()
@click.argument("catalog", type=_CATALOG_FILE)
@click.option("--prune", is_flag=True, help="Remove the models CATALOG no longer has (refused without it).")
@click.option(
    "--wait", is_flag=True, help="Wait until every replica the catalog asks for is ready (rollouts done)."
)
@click.option("--timeout", type=float, default=600, show_default=True, help="Seconds --wait waits at most.")
@click.pass_context
def apply(ctx: click.Context, catalog: Path, prune: bool, wait: bool, timeout: float) -> None:
    """Make CATALOG the desired state: all of it, or nothing if any part is invalid.

    Prints what changed. A catalog that removes models is refused (nothing
    changes) unless --prune is given. With --wait, returns once every replica
    the catalog asks for is ready and runs its command (outdated ones rolled),
    and exits 1 with the reason when a rollout pauses or --timeout passes first.
    """
    text = _read(catalog)
    client = _client(ctx)
    body = ApplyCatalog(text=text, name=str(catalog), prune=prune)
    try:
        result = client.request("POST", "/v1/admin/catalog", CatalogApplied, body=body)
    except CtlError as refused:
        if refused.status == HTTPStatus.CONFLICT:  # it removes models: show every change it would make
            for line in diff_lines(client.request("POST", "/v1/admin/catalog/diff", CatalogDiff, body=body)):
                click.echo(line)
        raise
    if result.diff is not None:
        for line in diff_lines(result.diff):
            click.echo(line)
    click.echo(f"applied {catalog} as revision {result.revision}: {result.summary}")
    if wait:
        wait_for_revision(client, result.revision, result.wanted, timeout, click.echo)


def replica_progress(data: ReplicaList, wanted: Mapping[str, int]) -> tuple[list[str], list[str]]:
    """Per model, replicas ready out of those ``wanted``; the lines of the models not done yet.

    Counts come from the catalog (``wanted``), not from the replicas that
    exist: a replica not placed yet counts as not ready. Replicas of models
    the catalog no longer has must be gone too. Called on every poll of
    ``apply --wait``; returns (one line per model, the lines still waiting):
    done when the second is empty.
    """
    lines, waiting = [], []
    for model in sorted(wanted):
        mine = [r for r in data.replicas if r.model == model and not r.replaces]
        ready = sum(r.state == "ready" and not r.outdated for r in mine)
        unplaced = sum(u.model == model and not u.replaces for u in data.unplaced)
        missing = max(0, wanted[model] - len(mine) - unplaced)
        notes = [
            f"{n} {what}"
            for n, what in (
                (sum(r.outdated for r in mine), "outdated, rolling"),
                (sum(r.state == "starting" and not r.outdated for r in mine), "starting"),
                (sum(r.state == "backoff" for r in mine), "failed, rebuilding"),
                (unplaced, "cannot be placed"),
                (missing, "not placed yet"),
                (max(0, len(mine) - wanted[model]), "to stop"),
            )
            if n
        ]
        lines.append(f"{model}: {ready}/{wanted[model]} ready" + (f" ({', '.join(notes)})" if notes else ""))
        if not ready == wanted[model] == len(mine):
            waiting.append(lines[-1])
    leaving = sorted({r.model for r in data.replicas if r.model not in wanted})
    for model in leaving:
        count = sum(r.model == model for r in data.replicas)
        lines.append(f"{model}: removed, {_plural(count, 'replica')} still stopping")
        waiting.append(lines[-1])
    return lines, waiting


def wait_for_revision(
    client: AdminClient,
    revision: int,
    wanted: Mapping[str, int],
    timeout: float,
    echo: Callable[[str], object],
) -> None:
    """Return once every replica of catalog ``revision`` is ready; print each model's progress as it moves.

    :raises CtlError: ``timeout`` seconds passed first (naming what is not
        ready and why), or another catalog revision was applied meanwhile.
    """
    deadline = time.monotonic() + timeout
    last: list[str] = []
    while True:
        data = client.request("GET", "/v1/admin/replicas", ReplicaList)
        if data.catalog_revision not in (0, revision):
            raise CtlError(
                f"catalog revision {data.catalog_revision} was applied while waiting for revision "
                f"{revision}; stopped waiting (see ctl catalog history)"
            )
        lines, waiting = replica_progress(data, wanted)
        for line in lines:
            if line not in last:  # only the models whose progress moved
                echo(line)
        last = lines
        paused = [f"rollout of {r.model} {r.reason}" for r in data.rollouts if r.state == "paused"]
        if paused:
            raise CtlError("; ".join(paused) + " (see ctl rollout status)")
        if not waiting:
            total = sum(wanted.values())
            echo(f"revision {revision}: all {_plural(total, 'replica')} ready")
            return
        if time.monotonic() > deadline:
            raise CtlError(f"not every replica was ready within {timeout:g} s: {_why(data, wanted, waiting)}")
        time.sleep(WAIT_POLL)


def _why(data: ReplicaList, wanted: Mapping[str, int], waiting: list[str]) -> str:
    """What is not ready, and the reasons the server gives."""
    reasons = [f"{u.id}: {u.reason}" for u in data.unplaced]
    reasons += [f"{r.id}: {r.reason}" for r in data.replicas if r.state != "ready" and r.reason]
    reasons += [
        f"{r.id} r{s.rank} on {s.node}: {s.state}" + (f" ({s.detail})" if s.detail else "")
        for r in data.replicas
        if r.state == "starting" and r.model in wanted
        for s in r.shards
        if s.state not in ("ready", "running")
    ]
    return "; ".join(waiting + reasons[:10]) + "; see ctl replicas and ctl events"


# -- reading the stored catalog ----------------------------------------------------------------------


@click.group(invoke_without_command=True)
@click.option("--revision", type=click.IntRange(min=1), help="Print this stored revision instead.")
@click.pass_context
def catalog(ctx: click.Context, revision: int | None) -> None:
    """Print the catalog in force as it was applied (or revision N), ready to edit and apply again.

    Which revision it is, when and by whom it was applied go to stderr.
    `ctl catalog history` lists every revision.
    """
    if ctx.invoked_subcommand is not None:
        if revision is not None:
            raise click.UsageError("--revision prints one revision; it does not go with a subcommand")
        return
    params = {"revision": revision} if revision is not None else {}
    stored = _client(ctx).request("GET", "/v1/admin/catalog", CatalogText, params=params)
    if stored.revision == 0:
        raise CtlError("no catalog applied yet; apply one with `llmgw ctl apply CATALOG`")
    click.echo(
        f"# revision {stored.revision}, applied {_when(stored.applied_at)}{_by(stored.author)}", err=True
    )
    click.echo(stored.text, nl=not stored.text.endswith("\n"))


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if stamp else "-"


def _by(author: str) -> str:
    return f" by {author}" if author else ""


@catalog.command("history")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="At most this many revisions, newest last.",
)
@output_option()
@click.pass_context
def catalog_history(ctx: click.Context, limit: int, output: str) -> None:
    """List stored catalog revisions: when each was applied and by whom (the admin certificate's name)."""
    def lines(data: CatalogHistory, _wide: bool) -> list[str]:
        rows = [[r.revision, _when(r.applied_at), r.author or "-"] for r in data.revisions]
        if not rows:
            return ["(no catalog applied yet)"]
        return [tabulate(rows, headers=["revision", "applied", "by"], tablefmt="simple")]

    params = {"limit": limit}
    show_admin(
        ctx, "/v1/admin/catalog/history", CatalogHistory, lines, output,
        params=params, doc=lambda data: to_json(data.revisions),
    )
