"""The files onboarding writes on a node besides the release: ``agent.toml`` and the systemd unit.

Also where things go on the node (:data:`ETC`, :data:`OPT`, :data:`STATE_DIR`,
:data:`UNIT_PATH`, the system trust store per OS family in :data:`TRUST`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from llmgw.onboard.remote import UNIT

if TYPE_CHECKING:
    from llmgw.onboard.settings import Settings

__all__ = ["ETC", "MANAGED_KEYS", "OPT", "STATE_DIR", "TRUST", "UNIT_PATH", "agent_toml", "systemd_unit"]

ETC = "/etc/llmgw"
OPT = "/opt/llmgw"
STATE_DIR = "/var/lib/llmgw-agent"
#: copies of distributable models (``llmgw agent --models-dir``)
MODELS_DIR = "/var/lib/llmgw/models"
UNIT_PATH = f"/etc/systemd/system/{UNIT}.service"
TRUST = {
    "debian": ("/usr/local/share/ca-certificates/llmgw-ca.crt", "update-ca-certificates"),
    "rhel": ("/etc/pki/ca-trust/source/anchors/llmgw-ca.pem", "update-ca-trust extract"),
}


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string for these values


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to agent.toml")


def _toml_tables(prefix: str, table: dict) -> list[str]:
    """``[prefix]`` with its plain values, then its sub-tables (``[engines.vllm]``)."""
    plain = {k: v for k, v in table.items() if not isinstance(v, dict)}
    lines = [f"\n[{prefix}]", *(f"{k} = {_toml_value(v)}" for k, v in plain.items())] if plain else []
    for key, value in table.items():
        if isinstance(value, dict):
            lines += _toml_tables(f"{prefix}.{key}", value)
    return lines


#: agent.toml keys onboarding always writes; any other key found on the node is kept as it is.
MANAGED_KEYS = ("node", "server", "address", "cert", "key", "ca", "state_dir", "models_dir", "fabrics")


def agent_toml(settings: Settings, current: dict | None = None) -> tuple[str, list[str]]:
    """The node's ``/etc/llmgw/agent.toml`` and the names of the settings kept from ``current``.

    Paths are prefixed with the remote root, as the agent sees them. Settings
    onboarding does not manage (``[engines]``, ``port_range``, ``[health]``...)
    are kept from the node's ``current`` file, so a re-run does not undo what
    the operator added; ``nvidia_smi`` and ``ib_root`` too, unless given, and
    ``fabrics`` when no ``--fabric`` is given.
    """
    r = settings.remote_root
    current = dict(current or {})
    fabrics = list(settings.fabrics)
    if not fabrics and current.get("fabrics"):
        fabrics = list(current["fabrics"])
    for key in MANAGED_KEYS:
        current.pop(key, None)
    if settings.nvidia_smi:
        current["nvidia_smi"] = settings.nvidia_smi
    if settings.ib_root:
        current["ib_root"] = settings.ib_root
    lines = [
        "# Written by llmgw-onboard-node. A re-run rewrites the settings it manages and keeps the others",
        "# (engines, port_range, health, sync...). See `llmgw agent --help`.",
        f"node = {_toml_string(settings.node)}",
        f"server = {_toml_string(settings.server)}",
        f"address = {_toml_string(settings.address)}",
        f"cert = {_toml_string(r + ETC + '/node.pem')}",
        f"key = {_toml_string(r + ETC + '/node.key')}",
        f"ca = {_toml_string(r + ETC + '/ca.pem')}",
        f"state_dir = {_toml_string(r + STATE_DIR)}",
        f"models_dir = {_toml_string(r + MODELS_DIR)}",
        f"fabrics = {_toml_value(fabrics)}",
    ]
    kept = []
    for key, value in current.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_toml_value(value)}")
            kept.append(key)
    for key, value in current.items():
        if isinstance(value, dict):
            lines += _toml_tables(key, value)
            kept.append(key)
    if settings.nvidia_smi:
        kept.remove("nvidia_smi")
    if settings.ib_root:
        kept.remove("ib_root")
    return "\n".join(lines) + "\n", kept


#: the agent unit's sandbox, as in deploy/systemd/llmgw-agent.service (whose comments say why each
#: relaxation is there: engines need GPUs, RDMA, pinned memory, JIT): `systemd-analyze security` 4.0
AGENT_HARDENING = """\
LimitMEMLOCK=infinity
LimitNOFILE=1048576
StateDirectory=llmgw-agent llmgw/models
CacheDirectory=llmgw-agent
Environment=HOME=/var/cache/llmgw-agent
ConfigurationDirectory=llmgw
UMask=0027
DevicePolicy=closed
DeviceAllow=char-nvidia-frontend rw
DeviceAllow=char-nvidia-uvm rw
DeviceAllow=char-nvidia-caps rw
DeviceAllow=char-infiniband_verbs rw
DeviceAllow=char-infiniband_mad rw
DeviceAllow=/dev/infiniband/rdma_cm rw
NoNewPrivileges=yes
PrivateTmp=yes
ProtectSystem=strict
ProtectHome=read-only
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
KeyringMode=private
SystemCallArchitectures=native
CapabilityBoundingSet=CAP_IPC_LOCK CAP_SYS_NICE
"""


def systemd_unit(settings: Settings) -> str:
    """The node's ``llmgw-agent.service``."""
    r = settings.remote_root
    return f"""\
# Written by llmgw-onboard-node; a re-run rewrites it (and says so).
[Unit]
Description=llmgw node agent ({settings.node})
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
ExecStart={r}{OPT}/venv/bin/llmgw agent --config {r}{ETC}/agent.toml
Environment=PYTHONUNBUFFERED=1
Restart=on-failure
RestartSec=5
# SIGTERM to the agent alone: its engines' launchers keep them for the next agent (--orphan-grace),
# so a restart or an upgrade restarts no engine.
KillMode=process
TimeoutStopSec=120
{AGENT_HARDENING}
[Install]
WantedBy=multi-user.target
"""
