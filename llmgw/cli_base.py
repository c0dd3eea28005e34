"""What every ``llmgw`` command group shares: errors shown as messages, never tracebacks."""

from __future__ import annotations

from typing import Any

import click

from llmgw.errors import LlmgwError

__all__ = ["Group"]


class Group(click.Group):
    """A click group that shows llmgw errors as ``error: message`` with their exit code.

    Exception groups from trio are unwrapped: their llmgw errors are shown one
    per line; anything else in them is a bug and propagates.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LlmgwError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except BaseExceptionGroup as group:
            leaves = _leaves(group)
            user_errors = [e for e in leaves if isinstance(e, LlmgwError)]
            if not user_errors or len(user_errors) != len(leaves):
                raise
            for exc in user_errors:
                click.echo(f"error: {exc}", err=True)
            ctx.exit(user_errors[0].exit_code)


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
