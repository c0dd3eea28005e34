"""The agent's settings: ``agent.toml``, the ``llmgw agent`` flags, and what the agent runs with.

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
    models_dir = "/var/lib/llmgw/models"  # where copies of distributable models go
    peer_port = 7444                      # serves model files to other nodes (0: any free port)
    max_uploads = 4                       # files served to peers at once
    bandwidth_limit = 0                   # MB/s served to peers in all (0: no limit)
    hub_endpoint = "https://huggingface.co"  # hf:// sources (default: $HF_ENDPOINT, else this)
    hub_token_file = "/etc/llmgw/hf-token"   # the Hub token, read at each use, never logged
    orphan_grace = 300                    # seconds a launcher keeps its engine with no agent attached
    log_format = "json"                   # or "text" (the default)
    log_level = "info"                    # debug, info, warning, error

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

:class:`AgentConfig` is the agent's settings class (:mod:`llmgw.settings`):
its fields make the flags, the keys above, ``--show-config`` and the checks.
A setting comes from the first of: its flag, its environment variable
(``LLMGW_SERVER``, ``LLMGW_LOG_FORMAT``, ``LLMGW_LOG_LEVEL``), this file, the
default; the same order as ``llmgw server`` and ``gateway``. An unknown key is
an error naming the key and the file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs

from llmgw.errors import LlmgwError
from llmgw.models import DiscoverySettings
from llmgw.net._listen import parse_listen
from llmgw.node.fabric import parse_fabric_option
from llmgw.serverlist import parse_servers
from llmgw.settings import LogSettings, SettingsError, load_settings, setting
from llmgw.wire import SHARD_PORTS, converter, valid_port_range

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
DEFAULT_MODELS_DIR = "/var/lib/llmgw/models"
DEFAULT_PEER_PORT = 7444
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
_NODE_ID = re.compile(r"^[a-z0-9][a-z0-9.-]{0,62}$")

#: an ``agent.toml`` or ``llmgw agent`` flag that cannot be used (the name the agent's modules know)
AgentConfigError = SettingsError


def _abs(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().absolute()


@attrs.frozen
class HealthSettings:
    """How rank 0's health path is probed: the ``[health]`` table of ``agent.toml``."""

    interval: float = setting(0.5, min=0, help="seconds between probes")
    timeout: float = setting(2.0, min=0, help="seconds one probe may take before it counts as a failure")
    failures: int = setting(
        3, min=1, help="failures in a row, after being ready, that make the shard unhealthy"
    )


@attrs.frozen
class SyncSettings:
    """How the agent talks to the server: the ``[sync]`` table of ``agent.toml``."""

    timeout: float = setting(
        30.0, min=0, help="seconds a sync call may take, long-poll included (above the server's poll timeout)"
    )
    backoff_initial: float = setting(
        0.25, min=0, help="first retry delay after a failed sync; doubles per failure, with jitter"
    )
    backoff_max: float = setting(5.0, min=0, help="the longest retry delay while the server is unreachable")
    refused_retry: float = setting(
        30.0, min=0, help="seconds between retries while the server refuses this node (403)"
    )
    facts_interval: float = setting(
        60.0, min=0, help="seconds between two runs of discovery (GPUs, fabrics, engines)"
    )


def parse_port_range(text: str, where: str = "--port-range") -> tuple[int, int]:
    """``LO-HI`` as ``(lo, hi)``; raises :class:`AgentConfigError` naming ``where``."""
    lo, sep, hi = text.strip().partition("-")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
        raise AgentConfigError(f"{where} {text!r}: expected LO-HI, e.g. 20000-20999")
    return _check_range(int(lo), int(hi), where)


def _check_range(lo: int, hi: int, where: str) -> tuple[int, int]:
    if not valid_port_range(lo, hi):
        low, high = SHARD_PORTS
        raise AgentConfigError(f"{where} {lo}-{hi}: expected {low} <= LO <= HI <= {high}, e.g. 20000-20999")
    return lo, hi


def _read_port_range(value: Any, where: str) -> tuple[int, int]:
    """``port_range`` as written: ``"LO-HI"`` (a flag or the file) or ``[LO, HI]`` (the file)."""
    if isinstance(value, str):
        return parse_port_range(value, where)
    if isinstance(value, list | tuple) and len(value) == 2 and all(type(v) is int for v in value):
        return _check_range(value[0], value[1], where)
    raise TypeError(f'expected "LO-HI" or [LO, HI], got {value!r}')


def parse_engine_option(text: str) -> tuple[str, str, str]:
    """``NAME:PROGRAM=PATH`` (``--engine vllm:vllm=/opt/vllm/bin/vllm``) as ``(engine, program, path)``."""
    name, colon, rest = text.partition(":")
    program, equals, path = rest.partition("=")
    if not colon or not equals or not name.strip() or not program.strip() or not path.strip():
        raise AgentConfigError(
            f"--engine {text!r}: expected NAME:PROGRAM=PATH, e.g. --engine vllm:vllm=/opt/vllm/bin/vllm"
        )
    return name.strip(), program.strip(), str(_abs(path.strip()))


def _read_engines(value: Any, where: str) -> dict[str, dict[str, str]]:
    """``[engines.NAME]`` tables of ``program = path``, or ``--engine NAME:PROGRAM=PATH`` flags."""
    if isinstance(value, list | tuple):
        engines: dict[str, dict[str, str]] = {}
        for text in value:
            name, program, path = parse_engine_option(text)
            engines.setdefault(name, {})[program] = path
        return engines
    return converter.structure(value, dict[str, dict[str, str]])


def _node_id(node: str, where: str) -> str:
    if not _NODE_ID.match(node):
        raise ValueError(
            f"{where}: node id {node!r}: use lowercase letters, digits, '.' and '-' "
            "(the certificate's common name)"
        )
    return node


def _servers(text: str, where: str) -> str:
    return ",".join(parse_servers(text, where))


def _fabrics(fabrics: tuple[str, ...], _where: str) -> tuple[str, ...]:
    for text in fabrics:
        parse_fabric_option(text)  # a typo is refused (FabricError) before anything starts
    return fabrics


def _listen(text: str, where: str) -> str:
    """``metrics_listen`` as given, once it reads as HOST:PORT."""
    try:
        parse_listen(text, where)
    except LlmgwError as exc:
        raise ValueError(str(exc)) from None
    return text


def _hub_endpoint(text: str, where: str) -> str:
    """``http(s)://HOST[:PORT][/PATH]``, without a trailing ``/``."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"{where}: expected http(s)://HOST[:PORT][/PATH], got {text!r}")
    return text.rstrip("/")


def _token_file(path: Path, where: str) -> Path:
    """A readable file (its content is not looked at here, nor ever logged)."""
    if not path.is_file() or not os.access(path, os.R_OK):
        raise ValueError(f"{where} {path}: expected a readable file holding the Hub token")
    return path


@attrs.frozen(kw_only=True)
class AgentConfig(LogSettings):
    """Everything ``llmgw agent`` runs with; build one with :func:`load_agent_config` or directly."""

    node: str = setting(help="This node's id: the common name of its certificate.", check=_node_id)
    server: str = setting(
        env="LLMGW_SERVER",
        check=_servers,
        help="The server's URL, https://HOST:PORT; several servers comma-separated.",
    )
    address: str = setting(help="The address this node is reached at; engines bind it.")
    cert: Path = setting(converter=_abs, help="This node's certificate (llmgw ca issue-node).")
    key: Path = setting(converter=_abs, help="The certificate's private key.")
    ca: Path = setting(converter=_abs, help="The CA certificate the server's certificate chains to.")
    state_dir: Path = setting(
        converter=_abs, directory=True, help="Where shard logs (logs/) and process records (run/) go."
    )
    nvidia_smi: str = setting(
        "nvidia-smi", metavar="PATH", shown_default="nvidia-smi on PATH", help="The nvidia-smi program."
    )
    ib_root: str = setting("/sys/class/infiniband", metavar="DIR", path=True, help="The sysfs RDMA root.")
    fabrics: tuple[str, ...] = setting(
        (),
        flag="fabric",
        metavar="NAME[:ADAPTER,...]",
        converter=tuple,
        check=_fabrics,
        help="A fabric this node is on (repeatable); replaces the file's list.",
    )
    port_range: tuple[int, int] = setting(
        DEFAULT_PORT_RANGE,
        metavar="LO-HI",
        read=_read_port_range,
        expected='"LO-HI" or [LO, HI]',
        shown_default="20000-20999",
        help="Ports the server may give shards.",
    )
    engines: Mapping[str, Mapping[str, str]] = setting(
        factory=dict,
        flag="engine",
        metavar="NAME:PROGRAM=PATH",
        read=_read_engines,
        path=True,
        expected="tables [engines.NAME] of PROGRAM = PATH",
        converter=lambda m: {k: dict(v) for k, v in (m or {}).items()},
        help="Where an engine's program is, e.g. vllm:vllm=/opt/vllm/bin/vllm (repeatable).",
    )
    stop_grace: float = setting(
        10.0, min=0, metavar="SECONDS", help="Seconds between SIGTERM and SIGKILL when a shard stops."
    )
    sidecar_timeout: float = setting(
        120.0, min=0, metavar="SECONDS", help="Seconds each sidecar may take to become ready."
    )
    orphan_grace: float = setting(
        300.0,
        min=0,
        metavar="SECONDS",
        help="How long a shard's launcher keeps its engine running while no agent is attached; "
        "past it the engine is stopped.",
    )
    health: HealthSettings = setting(factory=HealthSettings, help="How rank 0's health path is probed.")
    sync: SyncSettings = setting(factory=SyncSettings, help="How the agent talks to the server.")
    models_dir: Path = setting(
        Path(DEFAULT_MODELS_DIR),
        converter=_abs,
        directory=True,
        help="Where copies of distributable models go.",
    )
    peer_port: int = setting(
        DEFAULT_PEER_PORT,
        min=0,
        max=65535,
        metavar="PORT",
        expected="a port from 0 to 65535 (0: any free port)",
        help="Serve model files to other nodes on this port (0: any free port).",
    )
    max_uploads: int = setting(4, min=1, metavar="N", help="Files served to peers at once.")
    bandwidth_limit: float = setting(
        0.0,
        min=0,
        metavar="MB/S",
        expected="MB/s >= 0 (0: no limit)",
        converter=float,
        help="MB/s served to peers in all (0: no limit).",
    )
    seed_root: Path = setting(
        Path("/"),
        converter=_abs,
        directory=True,
        help="What stands for / when looking for a seed:///PATH here (simulated nodes).",
    )
    hub_endpoint: str = setting(
        factory=lambda: os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT,
        metavar="URL",
        shown_default=f"$HF_ENDPOINT, else {DEFAULT_HUB_ENDPOINT}",
        check=_hub_endpoint,
        help="The Hugging Face Hub hf:// sources come from.",
    )
    hub_token_file: Path | None = setting(
        None,
        converter=lambda p: None if p is None else _abs(p),
        check=_token_file,
        help="A file holding the Hub token (read at each use, never logged)  [default: no token].",
    )
    metrics_listen: str | None = setting(
        None,
        metavar="HOST:PORT",
        check=_listen,
        help="Serve GET /metrics and /health in plain HTTP on HOST:PORT  [default: not served].",
    )

    @property
    def discovery(self) -> DiscoverySettings:
        """Where discovery looks (``nvidia_smi``, ``ib_root``)."""
        return DiscoverySettings(nvidia_smi=self.nvidia_smi, ib_root=self.ib_root)

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


def load_agent_config(
    flags: Mapping[str, Any] | None = None, config_file: str | os.PathLike | None = None
) -> AgentConfig:
    """Build the agent's configuration from ``agent.toml`` and flag values (by setting name).

    Called by tests and ``llmgw onboard``'s checks; ``llmgw agent`` goes through
    :func:`llmgw.settings.settings_options`. A value of None (or ``()``) means
    "not given", so the file's value stands; ``engines`` from flags are merged
    over the file's, program by program.

    :raises AgentConfigError: a required setting is missing, or a value is invalid.
    :raises FabricError: a ``--fabric`` that is not ``NAME`` or ``NAME:ADAPTER,...``.
    """
    file = Path(config_file) if config_file is not None else None
    return load_settings(AgentConfig, flags=flags, file=file).settings


def _check_server(text: str) -> tuple[str, ...]:
    """The servers of a ``--server`` value (``https://HOST:PORT``, comma-separated), or a clear error."""
    try:
        return parse_servers(text)
    except ValueError as exc:
        raise AgentConfigError(str(exc)) from None
