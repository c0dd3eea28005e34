"""What applying a catalog would change: pure functions over two catalogs and the replicas that exist.

Called by the server for ``ctl diff`` (``POST /v1/admin/catalog/diff``) and
for every ``ctl apply``, which shows the diff and is refused when it removes
models without ``--prune``.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from llmgw.models import Catalog, Model, Profile
from llmgw.server.state.records import Launch
from llmgw.wire import CatalogChange, CatalogDiff

__all__ = ["LAUNCH_FIELDS", "catalog_diff", "field_changes"]

#: fields that change the command a replica's shards run: a running replica
#: with a change here is outdated (the rest change placement or timings only).
#: ``adapters`` is not one (adapters are loaded on the running engine) unless a model
#: gains its first or loses its last; ``max_adapters`` and ``max_adapter_rank`` are the
#: engine's LoRA flags, so they count for a model with adapters
#: (:attr:`llmgw.server.state.records.Launch.command` decides, the same for the reconciler)
LAUNCH_FIELDS = frozenset(
    {
        "source", "profile", "served_name", "engine", "nodes", "gpus_per_node", "args", "sidecars",
        "max_adapters", "max_adapter_rank",
    }
)


def catalog_diff(old: Catalog, new: Catalog, running: Mapping[str, int], revision: int = 0) -> CatalogDiff:
    """The changes from ``old`` to ``new``: models (with replicas to add, stop, and outdated), then profiles.

    :param running: model -> replicas that exist now (placed, replacements not counted).
    :param revision: the revision ``old`` is stored as.
    :returns: a :class:`~llmgw.wire.CatalogDiff`; no change at all gives an empty ``changes``.
    """
    changes: list[CatalogChange] = []
    for name in sorted(set(old.models) | set(new.models)):
        before, after = old.models.get(name), new.models.get(name)
        have = running.get(name, 0)
        if before is None and after is not None:
            changes.append(CatalogChange("model", name, "added", add=after.replicas))
        elif after is None:
            changes.append(CatalogChange("model", name, "removed", stop=have))
        elif before is not None:
            fields = _model_fields(old, new, before, after)
            if fields:
                launch = _launch_changed(old, new, name, fields)
                changes.append(
                    CatalogChange(
                        "model",
                        name,
                        "changed",
                        tuple(fields),
                        add=max(0, after.replicas - have),
                        stop=max(0, have - after.replicas),
                        outdated=min(have, after.replicas) if launch else 0,
                    )
                )
    for name in sorted(set(old.profiles) | set(new.profiles)):
        was, now = old.profiles.get(name), new.profiles.get(name)
        if was is None:
            changes.append(CatalogChange("profile", name, "added"))
        elif now is None:
            changes.append(CatalogChange("profile", name, "removed"))
        else:
            fields = field_changes(was, now)
            if fields:
                changes.append(CatalogChange("profile", name, "changed", tuple(fields)))
    return CatalogDiff(revision=revision, changes=tuple(changes))


def _launch_changed(old: Catalog, new: Catalog, name: str, fields: list[str]) -> bool:
    """Whether model ``name``'s replicas would run another command: what the reconciler judges outdated."""
    was, now = Launch.of(old, name), Launch.of(new, name)
    if was is None or now is None:  # a profile missing: judged by the fields' names
        return any(_name_of(line) in LAUNCH_FIELDS for line in fields)
    return was.command != now.command


def _model_fields(old: Catalog, new: Catalog, before: Model, after: Model) -> list[str]:
    """A model's own changed fields, then its profile's (``profile NAME: args: ...``)."""
    fields = field_changes(before, after)
    if before.profile == after.profile:
        was, now = old.profiles.get(before.profile), new.profiles.get(after.profile)
        if was is not None and now is not None:
            fields += [f"profile {after.profile}: {line}" for line in field_changes(was, now)]
    return fields


def _name_of(line: str) -> str:
    """The field a change line is about: ``args`` for ``profile tp8: args: [] -> [--x]``."""
    parts = line.split(": ")
    return parts[1] if line.startswith("profile ") and len(parts) > 2 else parts[0]


def field_changes(before: Model | Profile, after: Model | Profile) -> list[str]:
    """One ``field: old -> new`` line per field of two records of one kind that differs; a mapping
    (a model's ``adapters``) gives one ``field.KEY: old -> new`` line per key that differs, ``(none)``
    standing for a key added or removed."""
    lines = []
    for field in attrs.fields(type(before)):
        was, now = getattr(before, field.name), getattr(after, field.name)
        if was == now:
            continue
        if isinstance(was, Mapping) and isinstance(now, Mapping):  # one line per key: ``adapters.sql: ...``
            for key in sorted(set(was) | set(now)):
                if was.get(key) != now.get(key):
                    lines.append(f"{field.name}.{key}: {was.get(key, '(none)')} -> {now.get(key, '(none)')}")
        else:
            lines.append(f"{field.name}: {_shown(was)} -> {_shown(now)}")
    return lines


def _shown(value: object) -> str:
    if value is None:
        text = "(default)"
    elif isinstance(value, tuple):
        text = "[" + ", ".join(_shown(v) if attrs.has(type(v)) else str(v) for v in value) + "]"
    elif attrs.has(type(value)):
        text = (
            "{"
            + ", ".join(f"{f.name}: {_shown(getattr(value, f.name))}" for f in attrs.fields(type(value)))
            + "}"
        )
    else:
        text = str(value)
    return text  # whole, however long: ``ctl diff`` wraps it, ``-o json`` has it as it is
