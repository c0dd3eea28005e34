"""The node side of onboarding: ssh, and the shell scripts it runs there.

Everything on the node goes through the system ``ssh`` client (BatchMode, so
it never prompts; ``StrictHostKeyChecking=accept-new`` with a known_hosts file
kept in the CA directory, so a node's host key is learnt on first contact and
a changed one is refused). Two scripts run there: a probe, which reads what is
installed (checksums, modes, the OS family, the tools present), and an apply
script, which receives the changed files as a tar stream on its stdin and
installs them. Nothing is written before the probe has said what differs.

Every remote path is prefixed with ``root`` (empty on a real node); tests point
it at a directory, and prepend a folder of fake ``systemctl`` and
``update-ca-certificates`` to the remote ``PATH``, so the test machine is not
changed.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from llmgw.errors import LlmgwError

__all__ = ["OnboardError", "SshTarget", "Ssh", "RemoteFile", "Probe", "probe_script", "parse_addr"]

#: The unit onboarding writes and manages.
UNIT = "llmgw-agent"


class OnboardError(LlmgwError):
    """Onboarding could not finish; the message says what happened on which step and what to do."""


def parse_addr(text: str, port: int | None) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` as ``(host, port)``; ``port`` (--ssh-port) wins."""
    text = text.strip()
    host, found = text, None
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest.startswith(":"):
            found = rest[1:]
        elif rest:
            raise OnboardError(f"--addr {text!r}: expected HOST, HOST:PORT or [IPV6]:PORT")
    elif text.count(":") == 1:
        host, found = text.split(":")
    if found is not None and not found.isdigit():
        raise OnboardError(f"--addr {text!r}: the ssh port {found!r} is not a number")
    if not host or any(c.isspace() for c in host) or host.startswith("-"):
        raise OnboardError(f"--addr {text!r}: expected HOST, HOST:PORT or [IPV6]:PORT")
    chosen = port if port is not None else int(found) if found is not None else 22
    if not 0 < chosen < 65536:
        raise OnboardError(f"ssh port {chosen} is out of range")
    return host, chosen


@attrs.frozen
class SshTarget:
    """Where and as whom to ssh, and where known host keys are kept."""

    host: str
    port: int
    user: str
    known_hosts: Path
    key: Path | None = None

    def __str__(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


class Ssh:
    """Runs shell scripts on the node as root (through ``sudo -n`` when the ssh user is not root)."""

    def __init__(self, target: SshTarget, *, remote_path: Sequence[str] = ()) -> None:
        self.target = target
        self.remote_path = list(remote_path)

    def argv(self, script: str) -> list[str]:
        """The local ``ssh`` command line that runs ``script`` with ``sh`` on the node."""
        t = self.target
        options = [
            "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=accept-new",
            "-o", f"UserKnownHostsFile={t.known_hosts}",
            "-o", "ConnectTimeout=15",
            "-o", "ServerAliveInterval=15",
            "-o", "LogLevel=ERROR",
            "-p", str(t.port),
            "-l", t.user,
        ]  # fmt: skip
        if t.key is not None:
            options += ["-i", str(t.key), "-o", "IdentitiesOnly=yes"]
        if self.remote_path:
            joined = ":".join(self.remote_path)
            script = f"PATH={shlex.quote(joined)}:$PATH; export PATH\n{script}"
        command = ["sh", "-c", script]
        if t.user != "root":
            command = ["sudo", "-n", *command]
        return ["ssh", *options, t.host, shlex.join(command)]

    def run(self, script: str, *, what: str, stdin: bytes | None = None, timeout: float = 900) -> str:
        """Run ``script`` on the node and return its stdout.

        :raises OnboardError: when ssh cannot connect (with the likely fixes),
            or the script fails (with ``what`` and the end of its output).
        """
        try:
            done = subprocess.run(
                self.argv(script),
                input=stdin if stdin is not None else b"",
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except FileNotFoundError:
            raise OnboardError(
                "the ssh client is not installed here (apt-get install openssh-client)"
            ) from None
        except subprocess.TimeoutExpired:
            raise OnboardError(f"{what} on {self.target} did not finish within {timeout:.0f} s") from None
        out = done.stdout.decode(errors="replace")
        err = done.stderr.decode(errors="replace")
        if done.returncode == 255 and not out:
            raise OnboardError(self._connect_help(err.strip()))
        if done.returncode != 0:
            tail = "\n".join((out + err).strip().splitlines()[-25:])
            raise OnboardError(
                f"{what} failed on {self.target} (exit {done.returncode}); the output ends with:\n{tail}"
            )
        return out

    def _connect_help(self, err: str) -> str:
        t = self.target
        lines = [f"cannot ssh to {t}: {err or 'ssh exited 255'}"]
        if "REMOTE HOST IDENTIFICATION HAS CHANGED" in err or "Host key verification failed" in err:
            lines.append(
                f"the node's host key differs from the one recorded in {t.known_hosts}; if the machine was "
                f"reinstalled, remove its line with `ssh-keygen -R '[{t.host}]:{t.port}' -f {t.known_hosts}`"
            )
        elif "Permission denied" in err:
            lines.append(
                f"the node does not accept this key for {t.user}; pass --ssh-key, or add the key to "
                f"~{t.user}/.ssh/authorized_keys there (llmgw-provision-node --ssh-keys does this)"
            )
        else:
            lines.append(
                f"check that the machine is up and sshd listens: `ssh -p {t.port} {t.user}@{t.host} true`"
            )
        if t.user != "root":
            lines.append(f"{t.user} must be able to run `sudo -n` without a password")
        return "\n".join(lines)


@attrs.frozen
class RemoteFile:
    """A file onboarding manages on the node: an item name, its path (without the root prefix), its mode."""

    item: str
    path: str
    mode: int


@attrs.frozen
class Probe:
    """What the probe found on the node."""

    values: Mapping[str, str]

    @classmethod
    def parse(cls, text: str) -> Probe:
        values = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                values[key.strip()] = value.strip()
        return cls(values)

    def agent_config(self) -> dict | None:
        """The node's current ``agent.toml``, or ``None`` when there is none or it is not TOML."""
        import base64
        import binascii
        import tomllib

        text = self.values.get("config")
        if not text:
            return None
        try:
            return tomllib.loads(base64.b64decode(text).decode())
        except (binascii.Error, UnicodeDecodeError, tomllib.TOMLDecodeError):
            return None

    def tool(self, name: str) -> str | None:
        return self.values.get(f"tool.{name}") or None

    def state(self, item: str) -> tuple[str, str]:
        """``(sha256 or "-", "MODE:OWNER" or "-")`` of a managed file."""
        return self.values.get(f"sum.{item}", "-"), self.values.get(f"stat.{item}", "-")

    @property
    def family(self) -> str | None:
        """``debian``, ``rhel``, or ``None`` when neither trust-store tool nor a known OS was found."""
        ids = f"{self.values.get('os_id', '')} {self.values.get('os_like', '')}".lower().split()
        if self.tool("update-ca-certificates") or {"debian", "ubuntu"} & set(ids):
            return "debian"
        if self.tool("update-ca-trust") or {"rhel", "fedora", "centos", "rocky", "almalinux"} & set(ids):
            return "rhel"
        return None


def probe_script(root: str, files: Sequence[RemoteFile], release_marker: str, config_path: str) -> str:
    """A script printing ``key=value`` lines: the OS, the tools, the sha256 and mode:owner of each file.

    ``config=`` carries the node's ``agent.toml`` (base64): the settings onboarding does not manage are kept.
    """
    r = shlex.quote(root)
    lines = [
        "set -u",
        f"R={r}",
        'f=""',
        'for c in "$R/etc/os-release" "$R/usr/lib/os-release"; do [ -r "$c" ] && { f=$c; break; }; done',
        'if [ -n "$f" ]; then ( . "$f"; echo "os_id=${ID:-}"; echo "os_like=${ID_LIKE:-}"; '
        'echo "os_name=${PRETTY_NAME:-}" ); fi',
        "for t in update-ca-certificates update-ca-trust systemctl python3 journalctl; do "
        'echo "tool.$t=$(command -v "$t" 2>/dev/null || true)"; done',
        'echo "uid=$(id -u)"',
        'echo "python=$(python3 -c \'import ensurepip, venv, sys; print("%d.%d" % sys.version_info[:2])\' '
        '2>/dev/null || echo no)"',
        'sum() { if [ -f "$1" ]; then sha256sum "$1" | cut -d" " -f1; else echo -; fi; }',
        'st() { if [ -e "$1" ]; then stat -c "%a:%U" "$1"; else echo -; fi; }',
    ]
    for f in files:
        p = f'"$R"{shlex.quote(f.path)}'
        lines.append(f'echo "sum.{f.item}=$(sum {p})"; echo "stat.{f.item}=$(st {p})"')
    marker = f'"$R"{shlex.quote(release_marker)}'
    config = f'"$R"{shlex.quote(config_path)}'
    lines.append(f'if [ -f {config} ]; then echo "config=$(base64 -w0 < {config})"; fi')
    lines.append(f'echo "sum.release=$(sum {marker})"')
    lines.append('if [ -x "$R/opt/llmgw/venv/bin/llmgw" ]; then echo venv=yes; else echo venv=no; fi')
    lines.append(
        f"if systemctl is-active --quiet {UNIT} 2>/dev/null; then echo active=yes; else echo active=no; fi"
    )
    lines.append(
        f"if systemctl is-enabled --quiet {UNIT} 2>/dev/null; then echo enabled=yes; else echo enabled=no; fi"
    )
    return "\n".join(lines) + "\n"
