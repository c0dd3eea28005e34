"""``llmgw ctl keys``: the API keys clients send to the gateway, and the limits each one carries.

``create NAME [limits]`` prints the secret once; ``update NAME [limits]`` changes
some limits and leaves the others; ``list`` shows names, dates and limits;
``revoke NAME``. A limit given a bad value is refused before anything is sent,
naming its flag; the server checks again and changes nothing on a refusal.
"""

from __future__ import annotations

import time
from typing import Any

import click

from llmgw.ctl.client import AdminClient, segment
from llmgw.ctl.options import output_option
from llmgw.ctl.output import show, table
from llmgw.wire import (
    MAX_LIMIT,
    ApiKey,
    CreatedKey,
    CreateKey,
    KeyLimits,
    KeyList,
    Priority,
    RevokedKey,
    UpdateKey,
    to_json,
)

__all__ = ["keys", "LIFT", "key_lines"]

#: what ``update --rpm`` (and ``--tpm``, ``--concurrency``) takes to lift a limit
LIFT = "unlimited"
#: what ``update --models`` takes to allow every model again
ALL_MODELS = "*"


class _Count(click.ParamType):
    """A positive integer; on ``update``, also :data:`LIFT`."""

    name = "count"

    def __init__(self, liftable: bool) -> None:
        self.liftable = liftable

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) or (self.liftable and value == LIFT):
            return value
        text = str(value).strip()
        if text.isdigit() and 1 <= int(text) <= MAX_LIMIT:
            return int(text)
        also = f" or {LIFT!r}" if self.liftable else ""
        self.fail(f"expected a positive integer (at most {MAX_LIMIT}){also}, got {value!r}", param, ctx)


class _Models(click.ParamType):
    """Comma-separated model names; on ``update``, also :data:`ALL_MODELS`."""

    name = "models"

    def __init__(self, liftable: bool) -> None:
        self.liftable = liftable

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple) or (self.liftable and value == ALL_MODELS):
            return value
        names = tuple(name.strip() for name in str(value).split(","))
        also = f", or {ALL_MODELS!r} for every model" if self.liftable else ""
        if not all(names):
            self.fail(f"expected model names separated by commas{also}, got {value!r}", param, ctx)
        if len(set(names)) != len(names):
            self.fail(f"a model is named twice in {value!r}", param, ctx)
        return names


def _limit_options(liftable: bool) -> Any:
    """The limit flags of ``create`` (``liftable`` False) and ``update`` (True: a limit can be lifted)."""
    lift = f" ('{LIFT}' lifts it)" if liftable else " (default: unlimited)"
    count = _Count(liftable)
    options = [
        click.option("--rpm", type=count, metavar="N", help=f"Requests per minute{lift}."),
        click.option("--tpm", type=count, metavar="N", help=f"Prompt + completion tokens per minute{lift}."),
        click.option("--concurrency", type=count, metavar="N", help=f"Requests in flight at once{lift}."),
        click.option(
            "--models",
            type=_Models(liftable),
            metavar="A,B",
            help="The models it may use"
            + (f" ('{ALL_MODELS}': every model)." if liftable else " (default: every model)."),
        ),
        click.option(
            "--priority",
            type=click.Choice([p.value for p in Priority]),
            help="Its priority class" + ("." if liftable else " (default: standard)."),
        ),
    ]

    def decorate(command: Any) -> Any:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


@click.group()
def keys() -> None:
    """API keys clients send as `Authorization: Bearer KEY` to the gateway, and their limits."""


def _client(ctx: click.Context) -> AdminClient:
    return AdminClient.for_command(ctx)


@keys.command("create")
@click.argument("name")
@_limit_options(liftable=False)
@click.pass_context
def keys_create(ctx: click.Context, name: str, priority: str | None, **limits: Any) -> None:
    """Create API key NAME and print its secret: it is shown this once, only a hash is stored.

    NAME is 1-63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit. Without limits the key
    is unlimited; a gateway answers a request over a limit with 429 and Retry-After, and one for a
    model not allowed with 403.
    """
    chosen = KeyLimits(**limits, priority=Priority(priority or Priority.STANDARD))
    result = _client(ctx).request("POST", "/v1/admin/keys", CreatedKey, body=CreateKey(name, chosen))
    click.echo(result.secret)
    if result.limits != chosen:  # a server from before limits ignores them
        click.echo(
            f"warning: the server did not store the limits asked ({chosen.summary()}); is it an older "
            f"llmgw? `llmgw ctl keys list` shows what the key carries",
            err=True,
        )
    shown = "" if result.limits.is_default() else f" ({result.limits.summary()})"
    click.echo(
        f"API key {name!r} created{shown}; the secret above is not stored and cannot be shown again",
        err=True,
    )


@keys.command("update")
@click.argument("name")
@_limit_options(liftable=True)
@click.pass_context
def keys_update(ctx: click.Context, name: str, priority: str | None, **given: Any) -> None:
    """Change the limits of API key NAME; the ones not given stay as they are.

    All or nothing: a refused value changes none of them. Gateways apply the new limits within a second.
    """
    if priority is None and all(value is None for value in given.values()):
        raise click.UsageError("give at least one of --rpm, --tpm, --concurrency, --models, --priority")
    lifted = tuple(field for field, value in given.items() if value in (LIFT, ALL_MODELS))
    values = {field: value for field, value in given.items() if value not in (LIFT, ALL_MODELS)}
    update = UpdateKey(**values, priority=Priority(priority) if priority else None, unlimited=lifted)
    result = _client(ctx).request("PATCH", f"/v1/admin/keys/{segment(name)}", ApiKey, body=update)
    click.echo(f"API key {name!r}: {result.limits.summary()}")


def key_lines(data: KeyList, _wide: bool) -> list[str]:
    """What ``ctl keys list`` prints: a row per key with its dates and limits (``-`` is unlimited)."""

    def when(stamp: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp)) if stamp else "-"

    def count(value: int | None) -> str:
        return "-" if value is None else str(value)

    rows = []
    for k in data.keys:
        # a name from before names were checked whole may hold a newline: show it escaped
        row = [k.name if k.name.isprintable() else repr(k.name), when(k.created_at), when(k.revoked_at)]
        limits = k.limits
        models = ",".join(limits.models) if limits.models is not None else ALL_MODELS
        row += [count(limits.rpm), count(limits.tpm), count(limits.concurrency), models, limits.priority]
        rows.append(row)
    headers = ["name", "created", "revoked", "rpm", "tpm", "concurrency", "models", "priority"]
    return [table(rows, headers)]


@keys.command("list")
@output_option()
@click.pass_context
def keys_list(ctx: click.Context, output: str) -> None:
    """List API keys: names, dates and limits ('-': unlimited; secrets are never stored)."""
    client = _client(ctx)
    show(
        output, lambda: client.request("GET", "/v1/admin/keys", KeyList), lambda d: to_json(d.keys), key_lines
    )


@keys.command("revoke")
@click.argument("name")
@click.pass_context
def keys_revoke(ctx: click.Context, name: str) -> None:
    """Revoke API key NAME: gateways refuse it within a second."""
    _client(ctx).request("DELETE", f"/v1/admin/keys/{segment(name)}", RevokedKey)
    click.echo(f"API key {name!r} revoked")
