"""``llmgw agent --show-config``: the settings in force as ``agent.toml``, each with where it came from.

The same order as ``llmgw server`` and ``gateway`` (:mod:`llmgw.configfile`):
flag, environment variable, ``agent.toml``, default.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from llmgw.agent.config import AgentConfig, _AgentFile, read_config_file
from llmgw.configfile import toml_value

__all__ = ["config_lines"]

#: the top-level keys of agent.toml, in the order they are printed (a new setting shows up by itself)
_KEYS = tuple(a.name for a in attrs.fields(_AgentFile) if a.name not in ("engines", "health", "sync"))


def _value(config: AgentConfig, key: str) -> Any:
    if key in ("nvidia_smi", "ib_root"):
        return getattr(config.discovery, key)
    if key == "port_range":
        return f"{config.port_range[0]}-{config.port_range[1]}"
    return getattr(config, key, None)


def config_lines(config: AgentConfig, given: Mapping[str, str], config_file: Path | None) -> list[str]:
    """``config`` as the lines of an ``agent.toml``, each key with a comment saying where it came from.

    ``given`` maps the settings a flag or an environment variable gave to
    ``"flag"`` or ``"environment NAME"``; the rest came from ``config_file``
    if it has them, else from the defaults.
    """
    written = read_config_file(config_file) if config_file is not None else {}
    where = config_file or "agent.toml"
    lines = [f"# llmgw agent: settings in force (flag > environment > {where} > default)"]

    def origin(key: str) -> str:
        if key in given:
            return given[key]
        return f"file {config_file}" if key in written else "default"

    for key in _KEYS:
        value = _value(config, key)
        if value is None:
            lines.append(f"# {key} = ...  (not set)")
        else:
            lines.append(f"{key} = {toml_value(value)}  # {origin(key)}")
    for engine, programs in sorted(config.engines.items()):
        lines += ["", f"[engines.{engine}]  # {origin('engines')}"]
        lines += [f"{program} = {toml_value(path)}" for program, path in sorted(programs.items())]
    for section in ("health", "sync"):
        lines += ["", f"[{section}]"]
        from_file = written.get(section, {})
        for name, value in attrs.asdict(getattr(config, section)).items():
            lines.append(
                f"{name} = {toml_value(value)}  # {f'file {config_file}' if name in from_file else 'default'}"
            )
    return lines
