"""``llmgw ctl models``: each catalog model's weights: source, revision, size, holders, copies under way.

A model's LoRA adapters are rows under it, their names marked (``└ sql``);
in ``-o json`` each is an entry like a model's, following its model, with
``adapter_of`` naming the model (null for a model).

``differing`` names the nodes whose seed folder holds other files than the
model's manifest: they are no holders of it (``ctl events`` says which files).
"""

from __future__ import annotations

import click

from llmgw.ctl.options import output_option, watch_options
from llmgw.ctl.output import show_admin, table
from llmgw.scheduler import format_bytes
from llmgw.wire import ModelList, ModelStatus

__all__ = ["models", "model_lines", "model_rows"]

HEADERS = ["model", "source", "revision", "size", "digest", "holders", "copying", "differing"]


def model_rows(data: ModelList) -> list[list[str]]:
    """One table row per model, and one per adapter under its model (what ``ctl models`` prints)."""
    return [_row(m) for m in data.models]


def _row(model: ModelStatus) -> list[str]:
    copying = ", ".join(
        f"{c.node} {100 * c.bytes_present // c.bytes_total if c.bytes_total else 100}%" for c in model.copying
    )
    return [
        f"└ {model.name}" if model.adapter_of else model.name,
        model.source,
        model.revision or "-",
        format_bytes(model.size) if model.size is not None else "-",
        model.digest[:12] if model.digest else "-",
        ", ".join(model.holders) or "none",
        copying or "-",
        ", ".join(model.differing) or "-",
    ]


def model_lines(data: ModelList, wide: bool) -> list[str]:
    """What ``ctl models`` prints (``wide``: the whole digest)."""
    rows = model_rows(data)
    if wide:
        for row, model in zip(rows, data.models, strict=True):
            row[4] = model.digest or "-"
    return [table(rows, HEADERS) if rows else "(no model in the catalog)"]


@click.command()
@output_option()
@watch_options()
@click.pass_context
def models(ctx: click.Context, output: str, watch: bool, interval: float) -> None:
    """List the catalog's models: source, pinned revision, size, digest, nodes holding a verified copy,
    copies under way (node and percent), and nodes whose seed folder differs from the manifest (no
    holders: `ctl events` names the files). Size and digest show once a holder made the manifest.
    A model's LoRA adapters are the rows under it marked └, with the same columns."""
    show_admin(ctx, "/v1/admin/models", ModelList, model_lines, output, watch=watch, interval=interval)
