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

The certificate is chosen in :mod:`~llmgw.onboard.credentials`, the files
written on the node are made in :mod:`~llmgw.onboard.files`, and ssh is
:mod:`~llmgw.onboard.remote`.
"""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import tarfile
import time
from collections.abc import Callable

import attrs

from llmgw.onboard.credentials import node_credentials
from llmgw.onboard.files import ETC, OPT, STATE_DIR, TRUST, UNIT_PATH, agent_toml, systemd_unit
from llmgw.onboard.release import Release
from llmgw.onboard.remote import UNIT, OnboardError, Probe, RemoteFile, Ssh, probe_script
from llmgw.onboard.settings import Settings

__all__ = ["Settings", "Item", "onboard", "node_credentials", "agent_toml", "systemd_unit", "NOT_DONE"]

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
class Item:
    """One thing onboarding manages on the node, and what this run did to it."""

    name: str
    path: str
    status: str
    detail: str = ""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
    from llmgw.wire import EventList, NodeList

    node = settings.node
    echo(f"server: waiting up to {settings.wait:.0f} s for {node} to sync with {settings.server}")
    deadline = time.monotonic() + settings.wait
    try:
        seen = admin.request("GET", "/v1/admin/events", EventList, params={"limit": 1}).events
        since = seen[-1].id if seen else 0
    except CtlError as exc:
        raise OnboardError(f"cannot read the server's node list to wait for {node}: {exc}") from None
    last_error = None
    while True:
        try:
            nodes = admin.request("GET", "/v1/admin/nodes", NodeList).nodes
            record = next((n for n in nodes if n.node_id == node), None)
            events = admin.request(
                "GET", "/v1/admin/events", EventList, params={"since": since, "limit": 200}
            ).events
        except CtlError as exc:
            record, events, last_error = None, (), exc
        refusals = [e for e in events if e.kind == "refusal" and e.subject == node]
        if refusals:
            raise OnboardError(f"the server refused {node}: {refusals[-1].message}\n" + _agent_log(ssh))
        if record is not None:
            if record.state == "revoked":
                raise OnboardError(
                    f"the server says {node}'s certificate is revoked: {'; '.join(record.warnings)}"
                )
            # a sync after the (re)start: the old agent's last one is older than the restart
            # (last_sync_ago is rounded to 0.1 s, hence the 0.05)
            fresh = since_restart is None or record.last_sync_ago + 0.05 < time.monotonic() - since_restart
            if fresh and record.state != "lost":
                engines = ", ".join(f"{k} {v}" for k, v in sorted(record.engines.items())) or "none"
                echo(
                    f"server: {node} is {record.state} (agent {record.agent_version}, "
                    f"{record.gpus_total} GPUs, "
                    f"fabrics {', '.join(record.fabrics) or 'none (island)'}, "
                    f"engines {engines})"
                )
                for warning in record.warnings:
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
