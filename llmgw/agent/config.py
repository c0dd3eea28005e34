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
    orphan_grace = 300.0                  # seconds engines outlive their agent, for the next to adopt
    models_dir = "/var/lib/llmgw/models"  # where copies of distributable models go
    peer_port = 7444                      # serves model files to other nodes (0: any free port)
    max_uploads = 4                       # files served to peers at once
    bandwidth_limit = 0                   # MB/s served to peers in all (0: no limit)
    hub_endpoint = "https://huggingface.co"  # hf:// sources (default: $HF_ENDPOINT, else this)
    hub_token_file = "/etc/llmgw/hf-token"   # the Hub token, read at each use, never logged
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

A setting comes from the first of: its flag, its environment variable
(``LLMGW_SERVER``, ``LLMGW_LOG_FORMAT``, ``LLMGW_LOG_LEVEL``), this file, the
default; the same order as ``llmgw server`` and ``gateway`` (:mod:`llmgw.configfile`).
An unknown key is an error naming the key and the file. The file is read
through llmgw's one converter (:data:`llmgw.wire.converter`).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NewType
from urllib.parse import urlsplit

import attrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn

from llmgw.errors import LlmgwError
from llmgw.models import DiscoverySettings
from llmgw.net._listen import parse_listen
from llmgw.node.fabric import parse_fabric_option
from llmgw.serverlist import parse_servers
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
    #: the servers' base URLs, ``https://host:port``, comma-separated (llmgw.serverlist)
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
    #: seconds a shard's launcher keeps its engine running with no agent attached (0: it ends with the agent)
    orphan_grace: float = 300.0
    #: seconds each sidecar may take to become ready
    sidecar_timeout: float = 120.0
    health: HealthSettings = HealthSettings()
    sync: SyncSettings = SyncSettings()
    #: copies of distributable models (``seed://`` sources) go here, one directory per manifest digest
    models_dir: Path = attrs.field(converter=_abs, default=Path(DEFAULT_MODELS_DIR))
    #: the port model files are served to other nodes on (mutual TLS, node certificates only); 0: any
    peer_port: int = DEFAULT_PEER_PORT
    #: files served to peers at once; a peer asking for more is told to try another node
    max_uploads: int = 4
    #: MB/s served to peers in all; 0: no limit
    bandwidth_limit: float = 0.0
    #: what stands for ``/`` when this node looks for a ``seed:///PATH`` (simulated nodes get their own)
    seed_root: Path = attrs.field(converter=_abs, default=Path("/"))
    #: the Hugging Face Hub ``hf://`` sources are downloaded from (a mirror works)
    hub_endpoint: str = DEFAULT_HUB_ENDPOINT
    #: a file holding the Hub token (read at each use, never logged); None: no token is sent
    hub_token_file: Path | None = attrs.field(
        default=None, converter=lambda p: None if p is None else _abs(p)
    )
    #: ``HOST:PORT`` to serve ``/metrics`` and ``/health`` on in plain HTTP; None: not served
    metrics_listen: str | None = None
    #: log lines as ``text`` or ``json`` (llmgw.logs)
    log_format: str = "text"
    #: log from this level up: debug, info, warning, error
    log_level: str = "info"

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

#: ``port_range`` as written: ``"LO-HI"`` or ``[LO, HI]``
_PortRange = NewType("_PortRange", tuple)


@attrs.frozen
class _AgentFile:
    """``agent.toml`` as written, read through :data:`llmgw.wire.converter`; every key is optional."""

    node: str | None = None
    server: str | None = None
    address: str | None = None
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    state_dir: str | None = None
    nvidia_smi: str | None = None
    ib_root: str | None = None
    fabrics: tuple[str, ...] | None = None
    port_range: _PortRange | None = None
    engines: dict[str, dict[str, str]] | None = None
    stop_grace: float | None = None
    orphan_grace: float | None = None
    sidecar_timeout: float | None = None
    health: HealthSettings | None = None
    sync: SyncSettings | None = None
    models_dir: str | None = None
    peer_port: int | None = None
    max_uploads: int | None = None
    bandwidth_limit: float | None = None
    seed_root: str | None = None
    hub_endpoint: str | None = None
    hub_token_file: str | None = None
    metrics_listen: str | None = None
    log_format: str | None = None
    log_level: str | None = None


#: settings that name a file: relative paths in ``agent.toml`` are relative to it
_PATHS = ("cert", "key", "ca", "state_dir", "ib_root", "models_dir", "seed_root", "hub_token_file")
_TOP_KEYS = frozenset(a.name for a in attrs.fields(_AgentFile))
_SECTIONS = ("health", "sync")
_REQUIRED = ("node", "server", "address", "cert", "key", "ca", "state_dir")
_NODE_ID = re.compile(r"^[a-z0-9][a-z0-9.-]{0,62}$")


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


def _structure_port_range(value: Any, _: type) -> tuple[int, int]:
    if isinstance(value, str):
        return parse_port_range(value, "port_range")
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
        return _check_range(value[0], value[1], "port_range")
    raise TypeError(f'expected "LO-HI" or [LO, HI], got {value!r}')


converter.register_structure_hook(_PortRange, _structure_port_range)
for _kind in (_AgentFile, HealthSettings, SyncSettings):  # a typo in agent.toml is an error, not ignored
    converter.register_structure_hook(
        _kind, make_dict_structure_fn(_kind, converter, _cattrs_forbid_extra_keys=True)
    )


def parse_engine_option(text: str) -> tuple[str, str, str]:
    """``NAME:PROGRAM=PATH`` (``--engine vllm:vllm=/opt/vllm/bin/vllm``) as ``(engine, program, path)``."""
    name, colon, rest = text.partition(":")
    program, equals, path = rest.partition("=")
    if not colon or not equals or not name.strip() or not program.strip() or not path.strip():
        raise AgentConfigError(
            f"--engine {text!r}: expected NAME:PROGRAM=PATH, e.g. --engine vllm:vllm=/opt/vllm/bin/vllm"
        )
    return name.strip(), program.strip(), str(_abs(path.strip()))


def _problems(exc: BaseException, path: tuple[str, ...] = ()) -> list[str]:
    """One ``key: what is wrong`` line per leaf of a cattrs error tree (path dotted: ``sync.timeout``)."""
    if isinstance(exc, ForbiddenExtraKeysError):
        known = ", ".join(sorted(a.name for a in attrs.fields(exc.cl)))
        prefix = "".join(f"{p}." for p in path)
        return [f"unknown key '{prefix}{key}' (known keys: {known})" for key in sorted(exc.extra_fields)]
    if isinstance(exc, BaseExceptionGroup):
        lines = []
        for sub in exc.exceptions:
            step = [
                str(n.name) for n in getattr(sub, "__notes__", []) if getattr(n, "name", None) is not None
            ]
            step += [
                str(n.index) for n in getattr(sub, "__notes__", []) if getattr(n, "index", None) is not None
            ]
            lines.extend(_problems(sub, path + tuple(step[:1])))
        return lines
    if isinstance(exc, AgentConfigError):
        return [str(exc)]
    message = str(exc) if isinstance(exc, TypeError | ValueError) and str(exc) else "required, missing"
    return [f"{'.'.join(path)}: {message}"]


def _check_values(values: Mapping[str, Any], where: str) -> None:
    """What types cannot say: numbers >= 0 (failures >= 1), strings not empty."""
    checks = [(k, v) for k, v in values.items() if k not in (*_SECTIONS, "engines")]
    checks += [(f"{s}.{k}", v) for s in _SECTIONS for k, v in values.get(s, {}).items()]
    checks += [
        (f"engines.{engine}.{program}", path)
        for engine, programs in values.get("engines", {}).items()
        for program, path in programs.items()
    ]
    for name, value in checks:
        if name == "health.failures" and value < 1:
            raise AgentConfigError(f"{where}{name}: expected an integer >= 1, got {value!r}")
        if isinstance(value, float) and value < 0:
            raise AgentConfigError(f"{where}{name}: expected a number >= 0, got {value!r}")
        if value == "":
            raise AgentConfigError(f"{where}{name}: expected a non-empty string, got {value!r}")


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
    try:
        written = converter.structure(data, _AgentFile)
    except (ClassValidationError, ForbiddenExtraKeysError) as exc:
        raise AgentConfigError(f"{path}: " + f"; {path}: ".join(_problems(exc))) from None
    given = {name: value for name, value in attrs.asdict(written, recurse=False).items() if value is not None}
    for section in _SECTIONS:
        if section in given:  # only the keys written, so flags and defaults fill the rest
            given[section] = {key: getattr(given[section], key) for key in data[section]}
    _check_values(given, f"{path}: ")
    _check_logging(given, f"{path}: ")
    base = path.absolute().parent
    for name in _PATHS:
        if name in given:
            given[name] = str(base / Path(given[name]).expanduser())
    if "engines" in given:
        given["engines"] = {
            engine: {program: str(base / Path(p).expanduser()) for program, p in programs.items()}
            for engine, programs in given["engines"].items()
        }
    return given


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
    servers = _check_server(values["server"])
    for name in ("stop_grace", "orphan_grace", "sidecar_timeout"):
        if name in values and (type(values[name]) not in (int, float) or values[name] < 0):
            raise AgentConfigError(
                f"--{name.replace('_', '-')}: expected a number >= 0, got {values[name]!r}"
            )
        if name in values:
            values[name] = float(values[name])
    _check_weights(values)
    for text in values.get("fabrics", ()):
        parse_fabric_option(text)  # a typo is refused before anything starts
    discovery = DiscoverySettings(**{key: values[key] for key in ("nvidia_smi", "ib_root") if key in values})
    return AgentConfig(
        node=node,
        server=",".join(servers),
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
        orphan_grace=values.get("orphan_grace", 300.0),
        sidecar_timeout=values.get("sidecar_timeout", 120.0),
        health=HealthSettings(**values.get("health", {})),
        sync=SyncSettings(**values.get("sync", {})),
        models_dir=values.get("models_dir", DEFAULT_MODELS_DIR),
        peer_port=values.get("peer_port", DEFAULT_PEER_PORT),
        max_uploads=values.get("max_uploads", 4),
        bandwidth_limit=float(values.get("bandwidth_limit", 0.0)),
        seed_root=values.get("seed_root", "/"),
        hub_endpoint=_hub_endpoint(values.get("hub_endpoint")),
        hub_token_file=_hub_token_file(values.get("hub_token_file")),
        metrics_listen=_check_listen(values.get("metrics_listen")),
        log_format=values.get("log_format", "text"),
        log_level=values.get("log_level", "info").lower(),
    )


def _check_listen(text: str | None) -> str | None:
    """``metrics_listen`` as given, once it reads as HOST:PORT (else an error naming the flag)."""
    if text is not None:
        try:
            parse_listen(text, "--metrics-listen")
        except LlmgwError as exc:
            raise AgentConfigError(str(exc)) from None
    return text


def _hub_endpoint(given: str | None) -> str:
    """``--hub-endpoint``, else ``$HF_ENDPOINT``, else the public Hub; ``http(s)://HOST[:PORT][/PATH]``."""
    where = "--hub-endpoint" if given else "HF_ENDPOINT (the default of --hub-endpoint)"
    text = given or os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise AgentConfigError(f"{where}: expected http(s)://HOST[:PORT][/PATH], got {text!r}")
    return text.rstrip("/")


def _hub_token_file(given: str | None) -> str | None:
    """``--hub-token-file``: a readable file (its content is not looked at here, nor ever logged)."""
    if given is None:
        return None
    if not os.path.isfile(given) or not os.access(given, os.R_OK):
        raise AgentConfigError(f"--hub-token-file {given}: expected a readable file holding the Hub token")
    return given


def _check_weights(values: Mapping[str, Any]) -> None:
    """The model-copy settings: a port, at least one upload, a limit >= 0."""
    port = values.get("peer_port")
    if port is not None and (type(port) is not int or not 0 <= port <= 65535):
        raise AgentConfigError(
            f"--peer-port: expected a port from 0 to 65535 (0: any free port), got {port!r}"
        )
    uploads = values.get("max_uploads")
    if uploads is not None and (type(uploads) is not int or uploads < 1):
        raise AgentConfigError(f"--max-uploads: expected an integer >= 1, got {uploads!r}")
    limit = values.get("bandwidth_limit")
    if limit is not None and (type(limit) not in (int, float) or limit < 0):
        raise AgentConfigError(f"--bandwidth-limit: expected MB/s >= 0 (0: no limit), got {limit!r}")


def _check_logging(values: Mapping[str, Any], where: str) -> None:
    """``log_format`` and ``log_level``: names llmgw.logs knows."""
    from llmgw.logs import LOG_FORMATS, LOG_LEVELS

    for key, known in (("log_format", LOG_FORMATS), ("log_level", LOG_LEVELS)):
        value = values.get(key)
        if value is not None and str(value).lower() not in known:
            raise AgentConfigError(f"{where}{key}: expected one of {', '.join(known)}, got {value!r}")


def _check_server(text: str) -> tuple[str, ...]:
    """The servers of a ``--server`` value (``https://HOST:PORT``, comma-separated), or a clear error."""
    try:
        return parse_servers(text)
    except ValueError as exc:
        raise AgentConfigError(str(exc)) from None
