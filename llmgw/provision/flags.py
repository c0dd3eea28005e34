"""Reading and checking ``llmgw-provision-node``'s flags: sizes, addresses, names, GPUs, ssh keys.

Each ``check_*`` is a click callback (or called by the command) that returns
the value or raises :class:`click.BadParameter` naming the flag and what a
good value looks like; :func:`read_ssh_keys` reads an ``--ssh-keys`` file.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import click

__all__ = ["DEFAULT_SSH_KEYS", "SshKeys", "parse_size", "read_ssh_keys"]

#: Where the keys come from when ``--ssh-keys`` is not given: whoever may log in here may log in there.
DEFAULT_SSH_KEYS = "~/.ssh/authorized_keys"
_PCI_ID = re.compile(r"^(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?$")
_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_VM_NAME = re.compile(rf"^{_DNS_LABEL}(?:\.{_DNS_LABEL})*$")
_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_VOLUME_ID = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*:\S+$")
_SIZE = re.compile(r"^(\d+)\s*([A-Za-z]*)$")
_KEY_TYPES = (
    r"(?:ssh-(?:ed25519|rsa|dss)|ecdsa-sha2-nistp(?:256|384|521)"
    r"|sk-(?:ssh-ed25519|ecdsa-sha2-nistp256)@openssh\.com)"
)
_KEY_LINE = re.compile(rf"(?:^|\s){_KEY_TYPES}\s+[A-Za-z0-9+/]{{16,}}=*(?:\s|$)")
#: Proxmox VMIDs (``pve-vmid``).
_VMID_RANGE = (100, 999_999_999)
_MAX_GPUS = 16


def parse_size(text: str, *, unit: str, flag: str) -> int:
    """A positive size in ``unit`` (``MiB`` or ``GiB``): a bare number, or one with a unit (``64G``).

    :raises click.BadParameter: naming ``flag``.
    """
    factors = {"MiB": {"M": 1, "G": 1024, "T": 1024 * 1024}, "GiB": {"G": 1, "T": 1024}}[unit]
    found = _SIZE.match(text.strip())
    suffix = found.group(2).upper().removesuffix("B").removesuffix("I") if found else ""
    if not found or (suffix and suffix not in factors):
        units = ", ".join(f"{n}{s}" for s, n in (("G", 64), ("T", 1)) if s in factors)
        raise click.BadParameter(
            f"{text!r} is not a size: write a whole number of {unit} or one with a unit ({units})",
            param_hint=flag,
        )
    value = int(found.group(1)) * (factors[suffix] if suffix else 1)
    if value < 1:
        raise click.BadParameter(f"{text!r}: must be more than 0", param_hint=flag)
    return value


def check_vmid(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """``--vmid``: a Proxmox-style VMID (100 to 999999999)."""
    low, high = _VMID_RANGE
    if not low <= value <= high:
        raise click.BadParameter(f"{value} is not a Proxmox-style VMID: use {low} to {high}")
    return value


def check_positive(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """A count of at least 1 (``--cores``)."""
    if value < 1:
        raise click.BadParameter(f"{value}: must be at least 1")
    return value


def check_vm_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """``--name``: a DNS name, since it becomes the VM's hostname."""
    if len(value) > 253 or not _VM_NAME.match(value):
        raise click.BadParameter(
            f"{value!r} is not a DNS name (letters, digits and '-', dot-separated); "
            "it becomes the VM's name and hostname"
        )
    return value


def check_node_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--node-id``: a valid llmgw node id, or None when not given."""
    if value is None:
        return None
    from llmgw.pki import PkiError, validate_name

    try:
        return validate_name(value)
    except PkiError as exc:
        raise click.BadParameter(str(exc)) from None


def check_interface(ctx: click.Context, param: click.Parameter, value: str) -> ipaddress.IPv4Interface:
    """``--ip``: a host address in CIDR form, as an :class:`ipaddress.IPv4Interface` (or v6)."""
    if "/" not in value:
        raise click.BadParameter(f"{value!r} has no prefix length: write it as CIDR, e.g. {value}/24")
    try:
        interface = ipaddress.ip_interface(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an address in CIDR form, e.g. 10.0.0.11/24") from None
    network = interface.network
    if network.num_addresses > 2 and interface.ip in (network.network_address, network.broadcast_address):
        raise click.BadParameter(
            f"{value}: {interface.ip} is the {network} network's own address, not a host's"
        )
    return interface


def check_address(ctx: click.Context, param: click.Parameter, value: str) -> Any:
    """``--gateway``: an IP address."""
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an IP address") from None


def identifier_option(what: str, default: str, help: str) -> Callable[[Any], Any]:
    """``--WHAT``, a Proxmox identifier (``--bridge``, ``--storage``), checked; ``default`` shown in help."""

    def check(ctx: click.Context, param: click.Parameter, value: str) -> str:
        if not _IDENT.match(value):
            raise click.BadParameter(f"{value!r} is not a {what} name (letters, digits, '-', '_', '.')")
        return value

    return click.option(f"--{what}", default=default, show_default=True, callback=check, help=help)


def check_user(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--user``: a Linux user name, or None when not given."""
    if value is not None and not _USER.match(value):
        raise click.BadParameter(f"{value!r} is not a Linux user name")
    return value


def check_gpus(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """``--gpu``: PCI addresses as ``lspci -D`` prints them, none twice, at most 16."""
    seen: dict[str, str] = {}
    for gpu in value:
        if not _PCI_ID.match(gpu):
            raise click.BadParameter(
                f"{gpu!r} is not a PCI address: write [DOMAIN:]BUS:DEVICE[.FUNCTION] as lspci -D "
                "prints it, e.g. 0000:41:00.0"
            )
        key = gpu.lower() if gpu.count(":") == 2 else f"0000:{gpu.lower()}"
        if key in seen:
            raise click.BadParameter(f"{gpu} is given twice")
        seen[key] = gpu
    if len(value) > _MAX_GPUS:
        raise click.BadParameter(f"{len(value)} devices: a VM takes at most {_MAX_GPUS}")
    return value


def check_gateway(interface: Any, gateway: Any) -> None:
    """Check that ``--gateway`` is a host of ``--ip``'s network and not the VM itself."""
    if gateway.version != interface.version:
        raise click.BadParameter(
            f"{gateway} is IPv{gateway.version} but --ip is IPv{interface.version}", param_hint="'--gateway'"
        )
    if gateway not in interface.network:
        raise click.BadParameter(
            f"{gateway} is not in {interface.network}, the network of --ip {interface.with_prefixlen}",
            param_hint="'--gateway'",
        )
    if gateway == interface.ip:
        raise click.BadParameter(f"{gateway} is the VM's own address (--ip)", param_hint="'--gateway'")
    network = interface.network
    if network.num_addresses > 2 and gateway in (network.network_address, network.broadcast_address):
        raise click.BadParameter(f"{gateway} is not a host address of {network}", param_hint="'--gateway'")


def check_image(value: str, *, must_exist: bool) -> tuple[str, str | None]:
    """The image as qm takes it (an absolute path or a volume id), and a warning if any."""
    if "," in value or not value.strip():
        raise click.BadParameter(f"{value!r}: the image name may not contain ','", param_hint="'--image'")
    if _VOLUME_ID.match(value) and not value.startswith(("/", ".")):
        return value, None
    path = Path(value).expanduser().absolute()
    if path.is_file():
        return str(path), None
    problem = f"{path} is not a file here (--image takes a path on this host or a storage volume id)"
    if must_exist:
        raise click.BadParameter(problem, param_hint="'--image'")
    return str(path), f"--image {problem}; the run will fail until it is"


@attrs.frozen
class SshKeys:
    """The public keys of an ``--ssh-keys`` file."""

    path: str
    keys: tuple[str, ...]
    #: comment lines, which Proxmox refuses (it checks every non-blank line with ``ssh-keygen -l``)
    comments: int

    def without_comments(self) -> str:
        """The file's keys, one a line."""
        return "".join(f"{key}\n" for key in self.keys)


def read_ssh_keys(path: str, *, flag: str = "--ssh-keys") -> SshKeys:
    """Read an ``authorized_keys``-style file: blank lines and ``#`` comments allowed, every other line a key.

    :raises click.BadParameter: naming ``flag`` when the file is missing,
        unreadable, a private key, has no key, or a line that is not a key.
    """
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise click.BadParameter(
            f"{file} does not exist; the VM would have no key to log in with. "
            "Pass a file of OpenSSH public keys (e.g. ~/.ssh/id_ed25519.pub)",
            param_hint=f"'{flag}'",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read {file}: {exc}", param_hint=f"'{flag}'") from None
    if "PRIVATE KEY-----" in text:
        raise click.BadParameter(
            f"{file} holds a private key; pass the public one (.pub)", param_hint=f"'{flag}'"
        )
    keys: list[str] = []
    comments = 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            comments += 1
            continue
        if not _KEY_LINE.search(stripped):
            shown = stripped if len(stripped) <= 40 else stripped[:37] + "..."
            raise click.BadParameter(
                f"{file} line {number} is not an OpenSSH public key: {shown!r}", param_hint=f"'{flag}'"
            )
        keys.append(stripped)
    if not keys:
        raise click.BadParameter(
            f"{file} holds no public key; the VM would have no key to log in with", param_hint=f"'{flag}'"
        )
    return SshKeys(path=str(file.absolute()), keys=tuple(keys), comments=comments)
