"""``llmgw-provision-node``: make the machine a node will run on, through a provisioner plugin.

The provisioner (``--kind``, Proxmox VE by default) returns commands; this
module validates the flags, checks that the id is free, runs the commands in
order and says what was made. It never touches an existing machine: a taken id
is refused before anything runs, and a create that fails because the id was
taken in the meantime is reported as that, with nothing to clean up. When a
later step fails, it checks what is left and prints the commands that remove
it, or finish the job by hand.

Exit status: 0 made (or planned, with ``--dry-run``), 1 failed, 2 bad flags,
3 the id is taken, 130 interrupted.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import click

from llmgw.cli import Command as ErrorDoorCommand
from llmgw.models import Command
from llmgw.provision import (
    CommandResult,
    ExistingMachine,
    MachineExistsError,
    MachineRequest,
    Provisioner,
    ProvisionError,
    Step,
)

__all__ = ["main", "provision_node", "read_ssh_keys", "parse_size", "SshKeys"]

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


# ---------------------------------------------------------------------------
# flags
# ---------------------------------------------------------------------------


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


def _vmid(ctx: click.Context, param: click.Parameter, value: int) -> int:
    low, high = _VMID_RANGE
    if not low <= value <= high:
        raise click.BadParameter(f"{value} is not a Proxmox-style VMID: use {low} to {high}")
    return value


def _positive(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if value < 1:
        raise click.BadParameter(f"{value}: must be at least 1")
    return value


def _vm_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if len(value) > 253 or not _VM_NAME.match(value):
        raise click.BadParameter(
            f"{value!r} is not a DNS name (letters, digits and '-', dot-separated); "
            "it becomes the VM's name and hostname"
        )
    return value


def _node_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    from llmgw.pki import PkiError, validate_name

    try:
        return validate_name(value)
    except PkiError as exc:
        raise click.BadParameter(str(exc)) from None


def _interface(ctx: click.Context, param: click.Parameter, value: str) -> ipaddress.IPv4Interface:
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


def _address(ctx: click.Context, param: click.Parameter, value: str) -> Any:
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an IP address") from None


def _identifier(what: str) -> Callable[[click.Context, click.Parameter, str], str]:
    def check(ctx: click.Context, param: click.Parameter, value: str) -> str:
        if not _IDENT.match(value):
            raise click.BadParameter(f"{value!r} is not a {what} name (letters, digits, '-', '_', '.')")
        return value

    return check


def _user(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not _USER.match(value):
        raise click.BadParameter(f"{value!r} is not a Linux user name")
    return value


def _gpus(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
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


def _check_gateway(interface: Any, gateway: Any) -> None:
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


def _image(value: str, *, must_exist: bool) -> tuple[str, str | None]:
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


# ---------------------------------------------------------------------------
# running commands
# ---------------------------------------------------------------------------


def _env(command: Command) -> dict[str, str] | None:
    return {**os.environ, **command.env} if command.env else None


def _not_found(command: Command) -> ProvisionError:
    return ProvisionError(
        f"{command.argv[0]} is not on PATH: run llmgw-provision-node on the hypervisor host "
        "(for Proxmox VE: on the node, as root)"
    )


def _capture(command: Command) -> CommandResult:
    try:
        done = subprocess.run(
            command.argv, capture_output=True, text=True, env=_env(command), cwd=command.cwd, check=False
        )
    except FileNotFoundError:
        raise _not_found(command) from None
    return CommandResult(done.returncode, done.stdout, done.stderr)


def _stream(command: Command, echo: Callable[[str], None]) -> CommandResult:
    """Run ``command``, echoing its output (stdout and stderr together) as it comes."""
    try:
        process = subprocess.Popen(
            command.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(command),
            cwd=command.cwd,
        )
    except FileNotFoundError:
        raise _not_found(command) from None
    lines: list[str] = []
    assert process.stdout is not None
    try:
        with process.stdout:
            for line in process.stdout:
                lines.append(line)
                echo(f"    | {line.rstrip()}")
    except KeyboardInterrupt:
        # the child got the same SIGINT; let it finish its own cleanup before anyone looks at what is left
        process.wait()
        raise
    return CommandResult(process.wait(), "".join(lines), "")


def _shell(command: Command) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in command.env.items())
    line = shlex.join(command.argv)
    line = f"{env} {line}" if env else line
    return f"(cd {shlex.quote(command.cwd)} && {line})" if command.cwd else line


# ---------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------


def _provisioner(kind: str) -> Provisioner:
    from llmgw.plugins import get_plugin_manager

    provisioners = get_plugin_manager().provisioners()
    if kind not in provisioners:
        known = ", ".join(sorted(provisioners)) or "none"
        raise ProvisionError(
            f"no plugin provides provisioner {kind!r} (--kind); provisioners there are: {known}. "
            "`llmgw plugins` lists the plugins and their errors"
        )
    return provisioners[kind]


def _warn(text: str) -> None:
    click.echo(f"warning: {text}", err=True)


@click.command(
    cls=ErrorDoorCommand, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.option("--vmid", type=int, required=True, callback=_vmid, help="The id the VM gets; it must be free.")
@click.option("--name", required=True, callback=_vm_name, help="The VM's name and hostname.")
@click.option(
    "--node-id",
    callback=_node_id,
    metavar="ID",
    help="The node id onboarding will give it (default: --name); a warning when it differs from --name.",
)
@click.option("--ip", "ip", required=True, callback=_interface, metavar="CIDR", help="e.g. 10.0.0.11/24.")
@click.option("--gateway", required=True, callback=_address, metavar="IP", help="Inside the --ip network.")
@click.option(
    "--bridge", default="vmbr0", show_default=True, callback=_identifier("bridge"), help="The network bridge."
)
@click.option(
    "--storage",
    default="local-lvm",
    show_default=True,
    callback=_identifier("storage"),
    help="Where the disk and the cloud-init drive go.",
)
@click.option(
    "--image",
    required=True,
    metavar="PATH|VOLUME",
    help="The cloud image to import (qcow2 or raw, with cloud-init): a path on this host or a volume id.",
)
@click.option("--cores", type=int, required=True, callback=_positive, help="Virtual CPU cores.")
@click.option("--memory", required=True, metavar="SIZE", help="MiB, or with a unit: 64G.")
@click.option("--disk", required=True, metavar="SIZE", help="GiB, or with a unit: 200G, 1T.")
@click.option(
    "--gpu",
    "gpus",
    multiple=True,
    callback=_gpus,
    metavar="PCI_ID",
    help="A device to pass through, as lspci -D names it (repeatable).",
)
@click.option(
    "--ssh-keys",
    metavar="FILE",
    help=f"OpenSSH public keys that may log in [default: this host's {DEFAULT_SSH_KEYS}].",
)
@click.option(
    "--user", callback=_user, help="The user cloud-init makes for those keys [default: the image's own]."
)
@click.option("--kind", default="proxmox", show_default=True, help="The provisioner plugin.")
@click.option("--dry-run", is_flag=True, help="Check, then print the commands; run nothing that changes.")
def provision_node(
    vmid: int,
    name: str,
    node_id: str | None,
    ip: Any,
    gateway: Any,
    bridge: str,
    storage: str,
    image: str,
    cores: int,
    memory: str,
    disk: str,
    gpus: tuple[str, ...],
    ssh_keys: str | None,
    user: str | None,
    kind: str,
    dry_run: bool,
) -> None:
    """Make the VM for an llmgw node: import a cloud image, let cloud-init set it up, start it.

    Run it on the hypervisor host (Proxmox VE: on the node, as root). cloud-init
    sets the address, the ssh keys and no package upgrade on first boot. An
    existing VMID is refused, never changed. Onboard the VM afterwards with
    llmgw-onboard-node.
    """
    _check_gateway(ip, gateway)
    image_arg, image_warning = _image(image, must_exist=not dry_run)
    keys = read_ssh_keys(ssh_keys or DEFAULT_SSH_KEYS)
    request = MachineRequest(
        vmid=vmid,
        name=name,
        ip_cidr=ip.with_prefixlen,
        gateway=str(gateway),
        bridge=bridge,
        storage=storage,
        image=image_arg,
        cores=cores,
        memory_mib=parse_size(memory, unit="MiB", flag="'--memory'"),
        disk_gib=parse_size(disk, unit="GiB", flag="'--disk'"),
        gpus=gpus,
        ssh_keys_file=keys.path,
        user=user,
    )
    provisioner = _provisioner(kind)
    node = _check_node_id(name, node_id)
    if image_warning:
        _warn(image_warning)

    _refuse_if_taken(provisioner, request, dry_run=dry_run)
    if dry_run:
        _print_plan(provisioner, request, keys)
        return
    with tempfile.TemporaryDirectory(prefix="llmgw-provision-") as scratch:
        if keys.comments:
            # Proxmox checks every non-blank line with ssh-keygen and refuses comments: pass the keys only
            copy = Path(scratch) / "authorized_keys"
            copy.write_text(keys.without_comments(), encoding="utf-8")
            request = attrs.evolve(request, ssh_keys_file=str(copy))
        _run_steps(provisioner, request)
    _print_made(provisioner, request, keys, node)


def _check_node_id(name: str, node_id: str | None) -> str | None:
    """The node id it will get, warning when it is not the VM's name."""
    if node_id is None:
        from llmgw.pki import PkiError, validate_name

        try:
            return validate_name(name)
        except PkiError as exc:
            _warn(f"--name {name!r} cannot be a node id ({exc}); pass --node-id and onboard with that id")
            return None
    if node_id != name:
        _warn(
            f"the VM is named {name!r} but its node id will be {node_id!r}: `ctl nodes` and the hypervisor "
            "will show different names for one machine; name the VM after the node (--name "
            f"{node_id}) unless you mean it"
        )
    return node_id


def _refuse_if_taken(provisioner: Provisioner, request: MachineRequest, *, dry_run: bool) -> None:
    check = provisioner.exists_command(request)
    try:
        result = _capture(check)
    except ProvisionError:
        if not dry_run:
            raise
        click.echo(f"# not checked whether VMID {request.vmid} is free: {check.argv[0]} is not on PATH here")
        return
    existing = provisioner.read_existing(request, result)
    if existing is not None:
        raise MachineExistsError(
            f"VMID {request.vmid} is taken by {existing.describe()} (`{_shell(check)}`); "
            "llmgw-provision-node never changes an existing machine. Choose another --vmid"
            + (f" ({provisioner.id_hint})" if provisioner.id_hint else "")
            + ", or remove that machine yourself if it is a leftover"
        )
    if dry_run:
        click.echo(f"# VMID {request.vmid} is free (`{_shell(check)}`)")


def _print_plan(provisioner: Provisioner, request: MachineRequest, keys: SshKeys) -> None:
    steps = provisioner.steps(request)
    click.echo(f"# dry run: the {len(steps)} commands that would make {request.name!r}; nothing was run")
    if keys.comments:
        click.echo(
            f"# {keys.path} has {keys.comments} comment line(s), which Proxmox refuses: the run passes "
            "a temporary copy with only its keys instead of that file"
        )
    for number, step in enumerate(steps, 1):
        click.echo(f"# {number}/{len(steps)}: {step.title}")
        click.echo(_shell(step.command))


def _run_steps(provisioner: Provisioner, request: MachineRequest) -> None:
    steps = provisioner.steps(request)
    for number, step in enumerate(steps, 1):
        click.echo(f"[{number}/{len(steps)}] {step.title}")
        click.echo(f"    $ {_shell(step.command)}")
        started = time.monotonic()
        try:
            result = _stream(step.command, click.echo)
        except KeyboardInterrupt:
            raise _Interrupted(_failure_report(provisioner, request, steps, number, None)) from None
        if not result.ok:
            raise _failure(provisioner, request, steps, number, result)
        click.echo(f"    done in {time.monotonic() - started:.0f} s")


class _Interrupted(ProvisionError):
    exit_code = 130


def _failure(
    provisioner: Provisioner, request: MachineRequest, steps: list[Step], number: int, result: CommandResult
) -> ProvisionError:
    step = steps[number - 1]
    failure = provisioner.explain_failure(request, step, result)
    if failure.taken_by is not None:
        where = failure.taken_by.describe()
        return MachineExistsError(
            f"VMID {request.vmid} was taken after the check: step {number} of {len(steps)} "
            f"({step.title}) was refused because {where} exists; {failure.reason}\n"
            f"This run made nothing, and did not touch {where}. Choose another --vmid"
            + (f" ({provisioner.id_hint})" if provisioner.id_hint else "")
            + "."
            + (f"\nnote: {failure.hint}" if failure.hint else "")
        )
    lines = [f"step {number} of {len(steps)} failed: {step.title}", f"{failure.reason}"]
    if failure.hint:
        lines.append(f"hint: {failure.hint}")
    return ProvisionError(
        "\n".join(lines) + "\n" + _failure_report(provisioner, request, steps, number, result)
    )


def _failure_report(
    provisioner: Provisioner,
    request: MachineRequest,
    steps: list[Step],
    number: int,
    result: CommandResult | None,
) -> str:
    """What the run did, what is left now (checked, not assumed) and how to remove it or finish by hand."""
    done = [s.title for s in steps[: number - 1]]
    lines = []
    if result is None:
        lines.append(f"interrupted during step {number} of {len(steps)}: {steps[number - 1].title}")
    lines.append("done: " + ("; ".join(done) if done else "nothing"))
    check = provisioner.exists_command(request)
    unknown = False
    try:
        existing: ExistingMachine | None = provisioner.read_existing(request, _capture(check))
    except ProvisionError as exc:
        lines.append(f"left behind: unknown, the check failed: {exc}")
        unknown = True
    else:
        if existing is None:
            lines.append(
                f"left behind: nothing; `{_shell(check)}` says VMID {request.vmid} is free "
                "(a create that fails removes what it made)"
            )
            return "\n".join(lines)
        lines.append(f"left behind: {existing.describe()} (`{_shell(check)}`)")
        if existing.name not in (None, request.name):
            lines.append(
                f"that machine is not named {request.name!r}: it may not be this run's; "
                "look at it before removing anything"
            )
            return "\n".join(lines)
    cleanup = provisioner.cleanup_commands(request)
    if cleanup:
        lines.append("to remove it" + (", if it exists:" if unknown else ":"))
        lines.extend(f"  {_shell(c)}" for c in cleanup)
    rest = steps[number - 1 :]
    lines.append("or fix the cause and finish by hand:")
    lines.extend(f"  {_shell(s.command)}" for s in rest)
    return "\n".join(lines)


def _print_made(
    provisioner: Provisioner, request: MachineRequest, keys: SshKeys, node_id: str | None
) -> None:
    address = request.ip_cidr.split("/")[0]
    count = len(keys.keys)
    source = keys.path + (f" (without its {keys.comments} comment lines)" if keys.comments else "")
    rows = [
        ("machine", f"{request.cores} cores, {request.memory_mib} MiB memory"),
        ("disk", f"{request.disk_gib} GiB on {request.storage}, from {request.image}"),
        ("network", f"{request.ip_cidr} via {request.gateway} on {request.bridge}"),
        ("GPUs", ", ".join(request.gpus) or "none"),
        ("login", f"{count} ssh key{'s' if count != 1 else ''} from {source}"),
        ("user", request.user or "the image's default user"),
        ("first boot", "cloud-init sets the address and the keys; no package upgrade"),
    ]
    click.echo(f"made VM {request.vmid} {request.name!r} ({provisioner.name}), started:")
    for label, value in rows:
        click.echo(f"  {label:<11} {value}")
    click.echo(
        f"next: once `ssh {request.user + '@' if request.user else ''}{address}` answers, onboard it:\n"
        f"  llmgw-onboard-node --node {node_id or 'NODE_ID'} --addr {address} --server SERVER"
    )


def main() -> None:
    """Entry point of the ``llmgw-provision-node`` console script."""
    provision_node(prog_name="llmgw-provision-node")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
