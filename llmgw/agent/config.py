"""The agent's configuration: ``agent.toml`` and the ``llmgw agent`` flags.

Every setting has one name, used both as a TOML key and (with ``-`` for
``_``) as a flag; flags override the file. An example ``agent.toml``::

    node = "gpu-17"
    server = "https://llmgw.example.net:7443"
    address = "10.0.0.17"
    cert = "/etc/llmgw/node.pem"          # relative paths are relative to this file
    key = "/etc/llmgw/node.key"
    ca = "/etc/llmgw/ca.pem"
    state_dir = "/var/lib/llmgw-agent"
    nvidia_smi = "/usr/bin/nvidia-smi"
    ib_root = "/sys/class/infiniband"
    fabrics = ["ib-a:mlx5_0,mlx5_1"]
    port_range = "20000-20999"            # or [20000, 20999]
    stop_grace = 10.0                     # seconds between SIGTERM and SIGKILL

    [engines.vllm]                        # engine name -> program name -> path
    vllm = "/opt/vllm/bin/vllm"

    [health]
    interval = 0.5
    timeout = 2.0
    failures = 3

    [sync]
    timeout = 30.0                        # must exceed the server's --poll-timeout
    backoff_max = 5.0
    refused_retry = 30.0

An unknown key is an error naming the key and the file.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs

from llmgw.errors import LlmgwError
from llmgw.models import DiscoverySettings
from llmgw.node.fabric import parse_fabric_option

__all__ = [
    "AgentConfig",
    "AgentConfigError",
    "HealthSettings",
    "SyncSettings",
    "DEFAULT_PORT_RANGE",
    "load_agent_config",
    "parse_engine_option",
    "parse_port_range",
]

DEFAULT_PORT_RANGE = (20000, 20999)


class AgentConfigError(LlmgwError):
    """An ``agent.toml`` or ``llmgw agent`` flag that cannot be used; the message says which and why."""

    exit_code = 2


@attrs.frozen
class HealthSettings:
    """How rank 0's health path is probed."""

    #: seconds between probes
    interval: float = 0.5
    #: seconds one probe may take before it counts as a failure
    timeout: float = 2.0
    #: failures in a row, after being ready, that make the shard ``unhealthy``
    failures: int = 3


@attrs.frozen
class SyncSettings:
    """How the agent talks to the server."""

    #: seconds a sync call may take, long-poll included (above the server's poll timeout)
    timeout: float = 30.0
    #: first retry delay after a failed sync; doubles per failure, with jitter
    backoff_initial: float = 0.25
    #: the longest retry delay while the server is unreachable
    backoff_max: float = 5.0
    #: seconds between retries while the server refuses this node (403)
    refused_retry: float = 30.0
    #: seconds between two runs of discovery (GPUs, fabrics, engines)
    facts_interval: float = 60.0


def _abs(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().absolute()


@attrs.frozen
class AgentConfig:
    """Everything ``llmgw agent`` runs with; build one with :func:`load_agent_config` or directly."""

    #: this node's id: the common name of its certificate
    node: str
    #: the server's base URL, ``https://host:port``
    server: str
    #: the address this node is reached at; engines bind it
    address: str
    cert: Path = attrs.field(converter=_abs)
    key: Path = attrs.field(converter=_abs)
    ca: Path = attrs.field(converter=_abs)
    #: shard logs go to ``logs/``, process records to ``run/``
    state_dir: Path = attrs.field(converter=_abs)
    discovery: DiscoverySettings = DiscoverySettings()
    #: ``--fabric`` declarations, as given
    fabrics: tuple[str, ...] = attrs.field(converter=tuple, default=())
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE
    #: engine name -> program name -> path on this node
    engines: Mapping[str, Mapping[str, str]] = attrs.field(
        factory=dict, converter=lambda m: {k: dict(v) for k, v in (m or {}).items()}
    )
    #: seconds between SIGTERM and SIGKILL when a shard's process group is stopped
    stop_grace: float = 10.0
    #: seconds each sidecar may take to become ready
    sidecar_timeout: float = 120.0
    health: HealthSettings = HealthSettings()
    sync: SyncSettings = SyncSettings()

    @property
    def logs_dir(self) -> Path:
        """Where each shard's log goes: ``<state_dir>/logs``."""
        return self.state_dir / "logs"

    @property
    def runtime_dir(self) -> Path:
        """Where the agent records the process groups it started: ``<state_dir>/run``."""
        return self.state_dir / "run"

    def programs(self, engine: str) -> dict[str, str]:
        """Program name -> configured path for ``engine`` (empty when none is configured)."""
        return dict(self.engines.get(engine, {}))


# -- parsing -----------------------------------------------------------------------------------------

_TOP_KEYS = {
    "node": str,
    "server": str,
    "address": str,
    "cert": "path",
    "key": "path",
    "ca": "path",
    "state_dir": "path",
    "nvidia_smi": str,
    "ib_root": "path",
    "fabrics": list,
    "port_range": "port_range",
    "engines": dict,
    "stop_grace": float,
    "sidecar_timeout": float,
    "health": dict,
    "sync": dict,
}
_SECTIONS: dict[str, dict[str, type]] = {
    "health": {"interval": float, "timeout": float, "failures": int},
    "sync": {
        "timeout": float,
        "backoff_initial": float,
        "backoff_max": float,
        "refused_retry": float,
        "facts_interval": float,
    },
}
_REQUIRED = ("node", "server", "address", "cert", "key", "ca", "state_dir")
_NODE_ID = re.compile(r"^[a-z0-9][a-z0-9.-]{0,62}$")


def parse_port_range(text: str, where: str = "--port-range") -> tuple[int, int]:
    """``LO-HI`` as ``(lo, hi)``; raises :class:`AgentConfigError` naming ``where``."""
    lo, sep, hi = text.strip().partition("-")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
        raise AgentConfigError(f"{where} {text!r}: expected LO-HI, e.g. 20000-20999")
    return _check_range(int(lo), int(hi), where)


def _check_range(lo: int, hi: int, where: str) -> tuple[int, int]:
    if not 1024 <= lo <= hi <= 65535:
        raise AgentConfigError(f"{where} {lo}-{hi}: expected 1024 <= LO <= HI <= 65535, e.g. 20000-20999")
    return lo, hi


def parse_engine_option(text: str) -> tuple[str, str, str]:
    """``NAME:PROGRAM=PATH`` (``--engine vllm:vllm=/opt/vllm/bin/vllm``) as ``(engine, program, path)``."""
    name, colon, rest = text.partition(":")
    program, equals, path = rest.partition("=")
    if not colon or not equals or not name.strip() or not program.strip() or not path.strip():
        raise AgentConfigError(
            f"--engine {text!r}: expected NAME:PROGRAM=PATH, e.g. --engine vllm:vllm=/opt/vllm/bin/vllm"
        )
    return name.strip(), program.strip(), str(_abs(path.strip()))


def _typed(value: Any, kind: Any, where: str, base: Path | None) -> Any:
    if kind is float:
        if type(value) not in (int, float):
            raise AgentConfigError(f"{where}: expected a number, got {value!r}")
        if value < 0:
            raise AgentConfigError(f"{where}: expected a number >= 0, got {value!r}")
        return float(value)
    if kind is int:
        if type(value) is not int or value < 1:
            raise AgentConfigError(f"{where}: expected an integer >= 1, got {value!r}")
        return value
    if kind is str or kind == "path":
        if type(value) is not str or not value:
            raise AgentConfigError(f"{where}: expected a non-empty string, got {value!r}")
        if kind == "path" and base is not None:
            return str(base / Path(value).expanduser())
        return value
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise AgentConfigError(f"{where}: expected a list of strings, got {value!r}")
        return tuple(value)
    if kind == "port_range":
        if isinstance(value, str):
            return parse_port_range(value, where)
        if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
            return _check_range(value[0], value[1], where)
        raise AgentConfigError(f'{where}: expected "LO-HI" or [LO, HI], got {value!r}')
    if kind is dict:
        if not isinstance(value, dict):
            raise AgentConfigError(f"{where}: expected a table, got {value!r}")
        return value
    raise AssertionError(kind)


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read ``agent.toml`` into flat setting names (``health`` and ``sync`` stay tables).

    Relative paths in it are made relative to the file's directory.

    :raises AgentConfigError: the file cannot be read, is not TOML, has an
        unknown key (named with the file) or a value of the wrong type.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AgentConfigError(f"cannot read agent config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise AgentConfigError(f"{path}: not valid TOML: {exc}") from None
    base = path.absolute().parent
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _TOP_KEYS:
            known = ", ".join(sorted(_TOP_KEYS))
            raise AgentConfigError(f"{path}: unknown key {key!r} (known keys: {known})")
        values[key] = _typed(value, _TOP_KEYS[key], f"{path}: {key}", base)
    for section, fields in _SECTIONS.items():
        table = values.get(section)
        if table is None:
            continue
        for key, value in table.items():
            if key not in fields:
                known = ", ".join(sorted(fields))
                raise AgentConfigError(f"{path}: unknown key '{section}.{key}' (known keys: {known})")
            table[key] = _typed(value, fields[key], f"{path}: {section}.{key}", base)
    engines = values.get("engines")
    if engines is not None:
        parsed: dict[str, dict[str, str]] = {}
        for name, programs in engines.items():
            where = f"{path}: engines.{name}"
            if not isinstance(programs, dict):
                raise AgentConfigError(f'{where}: expected a table of program = "PATH", got {programs!r}')
            parsed[name] = {
                program: _typed(p, "path", f"{where}.{program}", base) for program, p in programs.items()
            }
        values["engines"] = parsed
    return values


def load_agent_config(
    flags: Mapping[str, Any] | None = None, config_file: str | os.PathLike | None = None
) -> AgentConfig:
    """Build the agent's configuration from ``agent.toml`` and command-line values.

    Called by ``llmgw agent``. ``flags`` uses the TOML names; a value of
    ``None`` (or an empty tuple for ``fabrics``) means "not given", so the
    file's value stands. ``engines`` from flags are merged over the file's,
    program by program.

    :returns: an :class:`AgentConfig`.
    :raises AgentConfigError: a required setting is missing, or a value is invalid.
    :raises FabricError: a ``--fabric`` that is not ``NAME`` or ``NAME:ADAPTER,...``.
    """
    values = read_config_file(config_file) if config_file is not None else {}
    flags = dict(flags or {})
    flag_engines = flags.pop("engines", None) or {}
    for key, value in flags.items():
        if key not in _TOP_KEYS:
            raise AssertionError(f"unknown flag setting {key}")
        if value is None or value == ():
            continue
        if key in _SECTIONS:
            values[key] = {**values.get(key, {}), **value}
        else:
            values[key] = value
    engines = {name: dict(programs) for name, programs in values.get("engines", {}).items()}
    for name, programs in flag_engines.items():
        engines.setdefault(name, {}).update(programs)
    missing = [key for key in _REQUIRED if not values.get(key)]
    if missing:
        where = f" or in {config_file}" if config_file is not None else " or in agent.toml (--config)"
        names = ", ".join(f"--{key.replace('_', '-')}" for key in missing)
        raise AgentConfigError(f"missing {names}: give it on the command line{where}")
    node = values["node"]
    if not _NODE_ID.match(node):
        raise AgentConfigError(
            f"node id {node!r}: use lowercase letters, digits, '.' and '-' (the certificate's common name)"
        )
    _check_server(values["server"])
    for name in ("stop_grace", "sidecar_timeout"):
        if name in values:
            values[name] = _typed(values[name], float, f"--{name.replace('_', '-')}", None)
    for text in values.get("fabrics", ()):
        parse_fabric_option(text)  # a typo is refused before anything starts
    discovery = DiscoverySettings(**{key: values[key] for key in ("nvidia_smi", "ib_root") if key in values})
    return AgentConfig(
        node=node,
        server=values["server"].rstrip("/"),
        address=values["address"],
        cert=values["cert"],
        key=values["key"],
        ca=values["ca"],
        state_dir=values["state_dir"],
        discovery=discovery,
        fabrics=values.get("fabrics", ()),
        port_range=values.get("port_range", DEFAULT_PORT_RANGE),
        engines=engines,
        stop_grace=values.get("stop_grace", 10.0),
        sidecar_timeout=values.get("sidecar_timeout", 120.0),
        health=HealthSettings(**values.get("health", {})),
        sync=SyncSettings(**values.get("sync", {})),
    )


def _check_server(url: str) -> None:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "https" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise AgentConfigError(
            f"--server {url!r}: expected https://HOST:PORT, e.g. https://llmgw.example.net:7443"
        )
