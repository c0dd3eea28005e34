"""``llmgw ctl keys``: the API keys clients send to the gateway, and the limits each one carries.

``create NAME [limits]`` prints the secret once; ``update NAME [limits]`` changes
some limits and leaves the others; ``list`` shows names, dates and limits;
``usage [NAME]`` what keys used this period, per model, against their budget;
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
    BudgetPeriod,
    CreatedKey,
    CreateKey,
    KeyLimits,
    KeyList,
    Priority,
    RevokedKey,
    UpdateKey,
    UsageList,
    to_json,
)

__all__ = ["keys", "LIFT", "key_lines", "usage_lines"]

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
        click.option(
            "--budget",
            type=count,
            metavar="N",
            help=f"Prompt + completion tokens per --budget-period, for the whole fleet{lift}.",
        ),
        click.option(
            "--budget-period",
            type=click.Choice([p.value for p in BudgetPeriod]),
            help="The UTC period the budget is counted over" + ("." if liftable else " (default: day)."),
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
def keys_create(
    ctx: click.Context, name: str, priority: str | None, budget_period: str | None, **limits: Any
) -> None:
    """Create API key NAME and print its secret: it is shown this once, only a hash is stored.

    NAME is 1-63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit. Without limits the key
    is unlimited; a gateway answers a request over a limit with 429 and Retry-After, and one for a
    model not allowed with 403.
    """
    period = BudgetPeriod(budget_period or BudgetPeriod.DAY)
    chosen = KeyLimits(**limits, priority=Priority(priority or Priority.STANDARD), budget_period=period)
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
def keys_update(
    ctx: click.Context, name: str, priority: str | None, budget_period: str | None, **given: Any
) -> None:
    """Change the limits of API key NAME; the ones not given stay as they are.

    All or nothing: a refused value changes none of them. Gateways apply the new limits within a second.
    """
    if priority is None and budget_period is None and all(value is None for value in given.values()):
        flags = "--rpm, --tpm, --concurrency, --models, --priority, --budget, --budget-period"
        raise click.UsageError(f"give at least one of {flags}")
    lifted = tuple(field for field, value in given.items() if value in (LIFT, ALL_MODELS))
    values = {field: value for field, value in given.items() if value not in (LIFT, ALL_MODELS)}
    update = UpdateKey(
        **values,
        priority=Priority(priority) if priority else None,
        budget_period=BudgetPeriod(budget_period) if budget_period else None,
        unlimited=lifted,
    )
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
        row += [count(limits.rpm), count(limits.tpm), count(limits.concurrency), limits.budget_shown()]
        rows.append([*row, models, limits.priority])
    headers = ["name", "created", "revoked", "rpm", "tpm", "concurrency", "budget", "models", "priority"]
    return [table(rows, headers)]


def usage_lines(data: UsageList, _wide: bool) -> list[str]:
    """What ``ctl keys usage`` prints: a row per key and model this period, then the key's total against its
    budget (model ``*``)."""
    rows = []
    for k in data.keys:
        name = k.name if k.name.isprintable() else repr(k.name)
        since = f"{k.period} from {k.since}"
        for m in k.models:
            tokens = m.prompt_tokens + m.completion_tokens
            rows.append([name, m.model, since, m.requests, m.prompt_tokens, m.completion_tokens, tokens, ""])
        budget = k.limits.budget
        share = "-" if budget is None else f"{k.tokens}/{budget} ({100 * k.tokens / budget:.0f}%)"
        requests = sum(m.requests for m in k.models)
        prompt = sum(m.prompt_tokens for m in k.models)
        completion = sum(m.completion_tokens for m in k.models)
        rows.append([name, ALL_MODELS, since, requests, prompt, completion, k.tokens, share])
    headers = ["name", "model", "period", "requests", "prompt", "completion", "tokens", "budget"]
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


@keys.command("usage")
@click.argument("name", required=False)
@output_option()
@click.pass_context
def keys_usage(ctx: click.Context, name: str | None, output: str) -> None:
    """Show what API key NAME (or every key) used this period, per model, against its budget.

    The period is the key's budget period (a UTC day or month; a day for a key without budget). Gateways
    report usage every second; the server stores it every few seconds.
    """
    client = _client(ctx)
    params = {"name": name} if name else {}
    show(
        output,
        lambda: client.request("GET", "/v1/admin/keys/usage", UsageList, params=params),
        lambda d: to_json(d.keys),
        usage_lines,
    )


@keys.command("revoke")
@click.argument("name")
@click.pass_context
def keys_revoke(ctx: click.Context, name: str) -> None:
    """Revoke API key NAME: gateways refuse it within a second."""
    _client(ctx).request("DELETE", f"/v1/admin/keys/{segment(name)}", RevokedKey)
    click.echo(f"API key {name!r} revoked")
