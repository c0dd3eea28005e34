"""Onboarding one node: identity, trust, the release, the agent, and the wait until the server sees it.

The steps, each safe to repeat (a re-run changes only what differs and says so):

1. check the release folder (:func:`~llmgw.onboard.release.check_release`);
2. probe the node over ssh: the OS family, the tools, and the checksum, mode
   and owner of every file onboarding manages (an unreachable node stops here,
   before anything is issued);
3. keep the node's certificate from the CA's records when it is still valid
   for a while, else issue one (CN = node id) into ``<ca-dir>/nodes/<node>/``;
4. send only what differs (a tar stream) and install it: the release into
   ``/opt/llmgw/venvs/<release>`` (``/opt/llmgw/venv`` points at it), the
   certificate, key (0600, root) and CA root under ``/etc/llmgw/``, the root into
   the system trust store, ``agent.toml`` and the systemd unit; then
   ``daemon-reload`` (unit changed), ``restart`` (something changed and the agent
   runs) or ``enable --now`` (it does not run); nothing changed and the agent
   runs: it is left alone;
5. wait until the server's node list shows the node syncing, or print the
   server's reason for refusing it and the agent's log.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import shlex
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from llmgw import pki
from llmgw.onboard.release import Release
from llmgw.onboard.remote import UNIT, OnboardError, Probe, RemoteFile, Ssh, probe_script

__all__ = ["Settings", "Item", "onboard", "node_credentials", "agent_toml", "systemd_unit", "NOT_DONE"]

ETC = "/etc/llmgw"
OPT = "/opt/llmgw"
STATE_DIR = "/var/lib/llmgw-agent"
UNIT_PATH = f"/etc/systemd/system/{UNIT}.service"
TRUST = {
    "debian": ("/usr/local/share/ca-certificates/llmgw-ca.crt", "update-ca-certificates"),
    "rhel": ("/etc/pki/ca-trust/source/anchors/llmgw-ca.pem", "update-ca-trust extract"),
}
#: A kept certificate must have at least this much life left; otherwise onboarding issues a new one.
RENEW_WITHIN = dt.timedelta(days=30)

NOT_DONE = """\
What onboarding did not do:
  - engines: it installed llmgw's engine plugins, not the engines themselves (vLLM, SGLang,
    llama.cpp...). Install them on the node and name their programs in {etc}/agent.toml
    ([engines.NAME] PROGRAM = "PATH"), then `systemctl restart llmgw-agent` there (a re-run of
    onboarding keeps what you add to agent.toml).
  - weights: no model was copied. Put each model's files at the catalog's `source` path on the node.
  A node missing an engine or a model's weights is never chosen for it, and `llmgw ctl nodes` says why:
    llmgw ctl nodes               the engines column and the warnings of {node}
    llmgw ctl engine-check ENGINE an engine's --help against the flags llmgw passes"""


@attrs.frozen
class Settings:
    """Everything one onboarding needs, from the command line."""

    node: str
    server: str
    #: the address the agent reports and engines bind
    address: str
    fabrics: tuple[str, ...]
    ca_dir: Path
    release: Release
    nvidia_smi: str | None = None
    ib_root: str | None = None
    #: seconds to wait for the node to appear; 0: do not wait
    wait: float = 180.0
    #: prefix of every remote path (tests only)
    remote_root: str = ""


@attrs.frozen
class Item:
    """One thing onboarding manages on the node, and what this run did to it."""

    name: str
    path: str
    status: str
    detail: str = ""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the node's certificate ----------------------------------------------------------------------------


def node_credentials(ca_dir: Path, node: str, echo: Callable[[str], None]) -> pki.Issued:
    """The node's certificate, key and CA root in ``<ca-dir>/nodes/<node>/``: kept if still good, else issued.

    A certificate is kept when the CA's records list it as valid for more than
    :data:`RENEW_WITHIN`, it is for this node, and the key beside it is its key.
    """
    ca = pki.load_ca(ca_dir)
    out = ca.directory / "nodes" / node
    cert_path, key_path = out / "node.pem", out / "node.key"
    reason = "none was issued by onboarding yet"
    if cert_path.exists() and key_path.exists():
        reason = _unusable(ca, cert_path, key_path, node)
        if reason is None:
            identity = pki.identity_of(_load_cert(cert_path))
            echo(
                f"certificate: keeping serial {identity.serial_hex} of node {node} "
                f"(valid until {identity.not_after:%Y-%m-%d})"
            )
            ca_path = out / "ca.pem"
            ca_path.write_bytes(ca.cert_path.read_bytes())
            return pki.Issued(identity=identity, cert_path=cert_path, key_path=key_path, ca_path=ca_path)
    issued = pki.issue_node(ca, node, out=out, overwrite=True)
    echo(
        f"certificate: issued serial {issued.identity.serial_hex} for node {node} "
        f"(valid until {issued.identity.not_after:%Y-%m-%d}; {reason})"
    )
    others = [
        r
        for r in pki.list_issued(ca.directory)
        if r.identity.role is pki.Role.NODE
        and r.identity.name == node
        and r.identity.serial != issued.identity.serial
        and r.status() == "valid"
    ]
    if others:
        serials = ", ".join(r.identity.serial_hex for r in others)
        echo(
            f"note: {len(others)} older certificate(s) of {node} are still valid (serial {serials}); "
            f"revoke one with `llmgw ca revoke --serial SERIAL --ca-dir {ca.directory}`"
        )
    return issued


def _load_cert(path: Path):
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes())


def _unusable(ca: pki.CA, cert_path: Path, key_path: Path, node: str) -> str | None:
    """Why the certificate in the node's folder cannot be kept, or ``None`` when it can."""
    from cryptography.hazmat.primitives import serialization

    try:
        cert = _load_cert(cert_path)
        identity = pki.identity_of(cert)
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, pki.PkiError) as exc:
        return f"the one in {cert_path.parent} cannot be read ({exc})"
    if identity.role is not pki.Role.NODE or identity.name != node:
        return f"the one in {cert_path.parent} is for {identity}"
    if cert.issuer != ca.cert.subject or key.public_key() != cert.public_key():
        return f"the one in {cert_path.parent} is not from this CA or does not match its key"
    record = next((r for r in pki.list_issued(ca.directory) if r.identity.serial == identity.serial), None)
    if record is None:
        return f"serial {identity.serial_hex} is not in the CA's records"
    status = record.status()
    if status != "valid":
        return f"serial {identity.serial_hex} is {status}"
    if identity.not_after - dt.datetime.now(dt.UTC) < RENEW_WITHIN:
        return f"serial {identity.serial_hex} expires on {identity.not_after:%Y-%m-%d}"
    return None


# -- the files -----------------------------------------------------------------------------------------


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
MANAGED_KEYS = ("node", "server", "address", "cert", "key", "ca", "state_dir", "fabrics")


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
# SIGTERM to the agent, which stops its shards (SIGTERM, grace, SIGKILL); then SIGKILL to what is left.
KillMode=mixed
TimeoutStopSec=60

[Install]
WantedBy=multi-user.target
"""


# -- onboarding ----------------------------------------------------------------------------------------


def onboard(
    settings: Settings,
    ssh: Ssh,
    echo: Callable[[str], None],
    admin: object | None,
) -> list[Item]:
    """Onboard one node (see the module docstring); returns what was done to each item.

    :param admin: an :class:`~llmgw.ctl.cli.AdminClient` to watch the node list, or ``None`` not to wait.
    :raises OnboardError: naming the step that failed.
    """
    release = settings.release
    r = settings.remote_root
    echo(f"release: {release.describe()} from {release.path}")
    echo(f"node: probing {ssh.target}")
    probe_files = [
        RemoteFile("certificate", f"{ETC}/node.pem", 0o644),
        RemoteFile("key", f"{ETC}/node.key", 0o600),
        RemoteFile("CA root", f"{ETC}/ca.pem", 0o644),
        RemoteFile("trust/debian", TRUST["debian"][0], 0o644),
        RemoteFile("trust/rhel", TRUST["rhel"][0], 0o644),
        RemoteFile("agent config", f"{ETC}/agent.toml", 0o644),
        RemoteFile("systemd unit", UNIT_PATH, 0o644),
    ]
    marker = f"{OPT}/venv/RELEASE"
    script = probe_script(r, probe_files, marker, f"{ETC}/agent.toml")
    probe = Probe.parse(ssh.run(script, what="probing the node"))
    _preflight(probe, release, ssh)
    family = probe.family
    _, trust_command = TRUST[family]  # type: ignore[index]
    echo(
        f"node: {probe.values.get('os_name') or probe.values.get('os_id') or 'unknown OS'}; "
        f"trust store: {family} ({trust_command})"
    )
    # only now, with the node reachable and ready: a typo in --addr issues nothing
    issued = node_credentials(settings.ca_dir, settings.node, echo)

    ca_pem = issued.ca_path.read_bytes()
    current = probe.agent_config()
    config_text, kept = agent_toml(settings, current)
    if kept:
        echo(f"agent config: keeping the node's own {', '.join(kept)} from {ETC}/agent.toml")
    if not settings.fabrics and current and current.get("fabrics"):
        echo(f"agent config: no --fabric given; keeping the node's fabrics {', '.join(current['fabrics'])}")
    contents = {
        "certificate": issued.cert_path.read_bytes(),
        "key": issued.key_path.read_bytes(),
        "CA root": ca_pem,
        f"trust/{family}": ca_pem,
        "agent config": config_text.encode(),
        "systemd unit": systemd_unit(settings).encode(),
    }
    wanted = [f for f in probe_files if f.item in contents]

    items: list[Item] = []
    # The release first: the most likely step to fail, and the agent keeps running the old one meanwhile.
    release_item = Item(
        "release",
        f"{OPT}/venv -> venvs/{release.ident}",
        _status_of(
            probe.values.get("sum.release", "-"), release.manifest_sha256, probe.values.get("venv") == "yes"
        ),
    )
    items.append(release_item)
    for f in wanted:
        remote_sum, remote_stat = probe.state(f.item)
        want_stat = f"{f.mode:o}:root"
        status = _status_of(remote_sum, _digest(contents[f.item]), True)
        detail = ""
        if status == "unchanged" and remote_stat != want_stat:
            status, detail = "updated", f"mode:owner {remote_stat} -> {want_stat}"
        name = "trust store" if f.item.startswith("trust/") else f.item
        items.append(Item(name, f.path, status, detail))

    changed = [i for i in items if i.status != "unchanged"]
    running = probe.values.get("active") == "yes"
    enabled = probe.values.get("enabled") == "yes"
    payload = _tar(
        {
            f"files/{f.item.replace('/', '_').replace(' ', '_')}": contents[f.item]
            for f in wanted
            if _item(items, f.path).status != "unchanged"
        },
        release if release_item.status != "unchanged" else None,
    )
    script = _apply_script(settings, release, items, wanted, trust_command, running=running, enabled=enabled)
    width = max(len(i.name) for i in items)
    for item in items:
        extra = f" ({item.detail})" if item.detail else ""
        echo(f"  {item.name:<{width}}  {item.status:<9}  {item.path}{extra}")
    if release_item.status != "unchanged":
        echo(f"node: installing {', '.join(release.names)} into {OPT}/venvs/{release.ident} (pip, offline)")
    started = time.monotonic()
    out = ssh.run(script, what="installing on the node", stdin=payload)
    applied_at = time.monotonic()
    actions = [line[3:] for line in out.splitlines() if line.startswith("@@ ")]
    for action in actions:
        echo(f"  {action}")
    restarted = _restarts(items) or not (running and enabled)
    echo(
        f"node: done in {applied_at - started:.0f} s; "
        + (f"{len(changed)} item(s) changed" if changed else "nothing changed; the agent was not restarted")
    )

    if admin is not None and settings.wait > 0:
        _wait_for_node(settings, ssh, admin, echo, since_restart=applied_at if restarted else None)
    echo(NOT_DONE.format(etc=ETC, node=settings.node))
    return items


def _restarts(items: list[Item]) -> bool:
    """Whether a change needs the agent restarted: anything it reads (the trust store it does not)."""
    return any(i.status != "unchanged" and i.name != "trust store" for i in items)


def _item(items: list[Item], path: str) -> Item:
    return next(i for i in items if i.path == path)


def _status_of(remote: str, local: str, present: bool) -> str:
    if remote == "-" or not present:
        return "installed"
    return "unchanged" if remote == local else "updated"


def _preflight(probe: Probe, release: Release, ssh: Ssh) -> None:
    if probe.values.get("uid") != "0":
        raise OnboardError(f"commands on {ssh.target} do not run as root (uid {probe.values.get('uid')})")
    problems = []
    if probe.family is None:
        problems.append(
            "neither update-ca-certificates (Debian, Ubuntu) nor update-ca-trust (RHEL, Fedora) is there, "
            "and /etc/os-release names no known family: install ca-certificates"
        )
    if not probe.tool("systemctl"):
        problems.append("systemctl is not there: onboarding runs the agent as a systemd service")
    python = probe.values.get("python", "no")
    if not probe.tool("python3") or python == "no":
        problems.append(
            "python3 with venv is not there: apt-get install python3-venv (Debian) or dnf install python3"
        )
    else:
        wanted = _release_python(release)
        if wanted and wanted != python:
            problems.append(
                f"the node's python3 is {python} but the release's dependency wheels are for "
                f"Python {wanted}: "
                f"build the release with `scripts/release --python-version {python}`"
            )
    if problems:
        raise OnboardError(f"{ssh.target} is not ready for onboarding:\n  - " + "\n  - ".join(problems))


def _release_python(release: Release) -> str | None:
    manifest = json.loads((release.path / "RELEASE").read_text())
    deps = manifest.get("dependencies_for") or {}
    return deps.get("python_version")


def _tar(files: dict[str, bytes], release: Release | None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o600
            tar.addfile(info, io.BytesIO(data))
        if release is not None:
            for name in (*release.files, "RELEASE"):
                tar.add(release.path / name, arcname=f"release/{name}")
    return buffer.getvalue()


def _apply_script(
    settings: Settings,
    release: Release,
    items: list[Item],
    wanted: list[RemoteFile],
    trust_command: str,
    *,
    running: bool,
    enabled: bool,
) -> str:
    q = shlex.quote
    lines = [
        "set -eu",
        f"R={q(settings.remote_root)}",
        'S=$(mktemp -d "${TMPDIR:-/tmp}/llmgw-onboard.XXXXXX")',
        "trap 'rm -rf \"$S\"' EXIT",
        'tar -xf - -C "$S"',
        'say() { echo "@@ $*"; }',
        "umask 022",
    ]
    status = {i.path: i.status for i in items}
    if items[0].status != "unchanged":
        venv = f'"$R"{q(f"{OPT}/venvs/{release.ident}")}'
        copy = f'"$R"{q(f"{OPT}/releases/{release.ident}")}'
        names = " ".join(q(n) for n in release.names)
        lines += [
            f'mkdir -p "$R"{q(OPT + "/releases")} "$R"{q(OPT + "/venvs")}',
            f"rm -rf {copy} {venv}",
            f'cp -r "$S/release" {copy}',
            f"python3 -m venv {venv}",
            f"PIP_CONFIG_FILE=/dev/null {venv}/bin/python -m pip install --quiet --disable-pip-version-check "
            f"--no-index --find-links {copy} {names}",
            f"cp {copy}/RELEASE {venv}/RELEASE",
            f'ln -sfn venvs/{q(release.ident)} "$R"{q(OPT + "/venv.new")}',
            f'mv -Tf "$R"{q(OPT + "/venv.new")} "$R"{q(OPT + "/venv")}',
            f'say "release: $("$R"{q(OPT + "/venv/bin/llmgw")} version | head -n 2 | tr "\\n" " ")"',
        ]
    trust_changed = False
    for f in wanted:
        if status[f.path] == "unchanged":
            continue
        source = f'"$S/files/{f.item.replace("/", "_").replace(" ", "_")}"'
        lines.append(f'install -D -m {f.mode:04o} -o 0 -g 0 {source} "$R"{q(f.path)}')
        trust_changed = trust_changed or f.item.startswith("trust/")
    lines.append(f'install -d -m 0755 "$R"{q(ETC)}')
    lines.append(f'install -d -m 0700 -o 0 -g 0 "$R"{q(STATE_DIR)}')
    if trust_changed:
        lines.append(f"{trust_command} >/dev/null")
        lines.append(f'say "trust store: ran {trust_command}"')
    if status[UNIT_PATH] != "unchanged":
        lines.append("systemctl daemon-reload")
        lines.append('say "systemd: daemon-reload"')
    if _restarts(items) and running:
        lines += [
            f"systemctl enable {UNIT} >/dev/null 2>&1",
            f"systemctl restart {UNIT}",
            f'say "agent: restarted ({UNIT}), it runs the new files"',
        ]
    elif not (running and enabled):
        lines += [f"systemctl enable --now {UNIT}", f'say "agent: enabled and started ({UNIT})"']
    else:
        lines.append(f'say "agent: left running, not restarted ({UNIT})"')
    return "\n".join(lines) + "\n"


def _wait_for_node(
    settings: Settings, ssh: Ssh, admin, echo: Callable[[str], None], *, since_restart: float | None
) -> None:
    """Poll the node list until the node syncs (after the restart, if there was one); fail with the reason."""
    from llmgw.ctl.client import CtlError

    node = settings.node
    echo(f"server: waiting up to {settings.wait:.0f} s for {node} to sync with {settings.server}")
    deadline = time.monotonic() + settings.wait
    try:
        seen = admin.request("GET", "/v1/admin/events", params={"limit": 1})["events"]
        since = seen[-1]["id"] if seen else 0
    except CtlError as exc:
        raise OnboardError(f"cannot read the server's node list to wait for {node}: {exc}") from None
    last_error = None
    while True:
        try:
            nodes = admin.request("GET", "/v1/admin/nodes")["nodes"]
            record = next((n for n in nodes if n["node_id"] == node), None)
            events = admin.request("GET", "/v1/admin/events", params={"since": since, "limit": 200})["events"]
        except CtlError as exc:
            record, events, last_error = None, [], exc
        refusals = [e for e in events if e["kind"] == "refusal" and e["subject"] == node]
        if refusals:
            raise OnboardError(f"the server refused {node}: {refusals[-1]['message']}\n" + _agent_log(ssh))
        if record is not None:
            if record["state"] == "revoked":
                raise OnboardError(
                    f"the server says {node}'s certificate is revoked: {'; '.join(record['warnings'])}"
                )
            # a sync after the (re)start: the old agent's last one is older than the restart
            # (last_sync_ago is rounded to 0.1 s, hence the 0.05)
            fresh = since_restart is None or record["last_sync_ago"] + 0.05 < time.monotonic() - since_restart
            if fresh and record["state"] != "lost":
                engines = ", ".join(f"{k} {v}" for k, v in sorted(record["engines"].items())) or "none"
                echo(
                    f"server: {node} is {record['state']} (agent {record['agent_version']}, "
                    f"{record['gpus_total']} GPUs, "
                    f"fabrics {', '.join(record['fabrics']) or 'none (island)'}, "
                    f"engines {engines})"
                )
                for warning in record["warnings"]:
                    echo(f"server: warning: {node}: {warning}")
                return
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise OnboardError(
                f"{node} did not appear in the server's node list within {settings.wait:.0f} s{detail}.\n"
                + _agent_log(ssh)
            )
        time.sleep(0.5)


def _agent_log(ssh: Ssh) -> str:
    script = (
        f"systemctl status --no-pager {UNIT} 2>&1 | head -n 5 || true\n"
        f"journalctl -u {UNIT} -n 30 --no-pager 2>&1 || true\n"
    )
    try:
        text = ssh.run(script, what="reading the agent's log", timeout=60)
    except OnboardError as exc:
        return f"(could not read the agent's log: {exc})"
    return f"the agent on the node ({UNIT}) says:\n{text.rstrip()}"
