"""``--show-config``: the settings in force as the lines of a config file, each saying where it came from.

What it prints is itself a valid config file for the same command.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from llmgw.settings.fields import bare_type, settings_fields
from llmgw.settings.load import Loaded

__all__ = ["settings_lines", "toml_value"]


def toml_value(value: Any) -> str:
    """``value`` written as TOML (what ``--show-config`` prints after ``key =``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value) if isinstance(value, Path) else value)


def settings_lines(loaded: Loaded, command: str) -> list[str]:
    """``loaded`` as TOML lines: ``key = value  # flag``, ``# key = ...  (not set)``, tables last.

    Called by ``--show-config`` of ``llmgw COMMAND``.
    """
    where = loaded.file or "file"
    lines = [f"# llmgw {command}: settings in force (flag > environment > {where} > default)"]
    tables = []
    for field in settings_fields(type(loaded.settings)):
        value, origin = getattr(loaded.settings, field.name), loaded.origins.get(field.name, "default")
        kind = bare_type(field.type)
        if attrs.has(kind):
            tables += ["", f"[{field.name}]"]
            for sub in settings_fields(kind):
                key = f"{field.name}.{sub.name}"
                line = f"{sub.name} = {toml_value(getattr(value, sub.name))}"
                tables.append(f"{line}  # {loaded.origins.get(key, 'default')}")
        elif isinstance(value, Mapping):
            for name, table in sorted(value.items()):
                tables += ["", f"[{field.name}.{name}]  # {origin}"]
                tables += [f"{key} = {toml_value(v)}" for key, v in sorted(table.items())]
        elif value is None or value == ():
            lines.append(f"# {field.name} = ...  (not set)")
        else:
            lines.append(f"{field.name} = {toml_value(value)}  # {origin}")
    return lines + tables
