"""``llmgw ctl rollout status [MODEL]`` and ``ctl rollout undo MODEL``: how outdated replicas are replaced.

A replica is outdated when the catalog in force asks its model for another
command than the one it runs; the server replaces it (see the README's
"Rollouts"). ``status`` shows each model's progress and, when a rollout
waits or paused, why and what failed; ``undo`` re-applies the previous
catalog revision when only that model differs in it.
"""

from __future__ import annotations

import click
from tabulate import tabulate

from llmgw.ctl.client import AdminClient
from llmgw.ctl.output import model_listing
from llmgw.wire import RolloutList, RolloutStatus, RolloutUndone

__all__ = ["rollout", "rollout_lines"]


def rollout_lines(data: RolloutList, wide: bool = False) -> list[str]:
    """What ``ctl rollout status`` prints: a table of models, then the reason and failure of each not done.

    The table is the same in ``wide`` (the reasons below it are whole already).
    """
    if not data.rollouts:
        return ["(no model in the catalog)"]
    rows = [
        [r.model, r.state, f"{r.updated}/{r.replicas}", r.outdated, r.max_surge, r.max_unavailable]
        for r in data.rollouts
    ]
    headers = ["model", "rollout", "updated", "outdated", "max_surge", "max_unavailable"]
    lines = tabulate(rows, headers=headers, tablefmt="simple").splitlines()
    for r in data.rollouts:
        lines.extend(_explained(r))
    return lines


def _explained(status: RolloutStatus) -> list[str]:
    out = []
    if status.reason:
        out.append(f"{status.model}: {status.reason}")
    if status.failure:
        out.append(f"{status.model}: failed: {status.failure}")
    return out


@click.group()
def rollout() -> None:
    """See and undo rollouts: outdated replicas being replaced after a catalog change."""


rollout.add_command(
    model_listing(
        "status",
        "/v1/admin/rollouts",
        RolloutList,
        rollout_lines,
        help=(
            "Show each model's rollout (or MODEL's): replicas updated and outdated, and why it waits or "
            "paused (what failed, on which node, the shard's exit code and the last log line its agent "
            "reported)."
        ),
    )
)


@rollout.command("undo")
@click.argument("model")
@click.pass_context
def rollout_undo(ctx: click.Context, model: str) -> None:
    """Return MODEL to the previous catalog revision: re-apply it as a new revision.

    Refused (nothing changes) when that revision also differs in other models
    or in profiles they use: edit and apply the catalog instead.
    """
    path = f"/v1/admin/rollouts/{model}/undo"
    result = AdminClient.for_command(ctx).request("POST", path, RolloutUndone)
    click.echo(
        f"re-applied catalog revision {result.restored} as revision {result.revision} "
        f"to undo the rollout of {model}: {result.summary}"
    )
