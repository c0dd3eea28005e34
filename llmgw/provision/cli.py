"""``llmgw-provision-node``: make the machine a node will run on, through a provisioner plugin.

The provisioner (``--kind``, Proxmox VE by default) returns commands; this
module validates the flags, checks that the id is free, runs the commands in
order and says what was made. It never touches an existing machine: a taken id
is refused before anything runs, and a create that fails because the id was
taken in the meantime is reported as that, with nothing to clean up. When a
later step fails, it checks what is left and prints the commands that remove
it, or finish the job by hand. The flags are checked in
:mod:`~llmgw.provision.flags`, the commands run by :mod:`~llmgw.provision.run`.

Exit status: 0 made (or planned, with ``--dry-run``), 1 failed, 2 bad flags,
3 the id is taken, 130 interrupted.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
import click

from llmgw.cli import Command
from llmgw.provision import MachineRequest, Provisioner, ProvisionError
from llmgw.provision.flags import (
    DEFAULT_SSH_KEYS,
    SshKeys,
    check_address,
    check_gateway,
    check_gpus,
    check_image,
    check_interface,
    check_node_id,
    check_positive,
    check_user,
    check_vm_name,
    check_vmid,
    identifier_option,
    parse_size,
    read_ssh_keys,
)
from llmgw.provision.run import print_made, print_plan, refuse_if_taken, run_steps, warn

__all__ = ["main", "provision_node", "read_ssh_keys", "parse_size", "SshKeys"]


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


@click.command(
    cls=Command, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.option(
    "--vmid", type=int, required=True, callback=check_vmid, help="The id the VM gets; it must be free."
)
@click.option("--name", required=True, callback=check_vm_name, help="The VM's name and hostname.")
@click.option(
    "--node-id",
    callback=check_node_id,
    metavar="ID",
    help="The node id onboarding will give it (default: --name); a warning when it differs from --name.",
)
@click.option(
    "--ip", "ip", required=True, callback=check_interface, metavar="CIDR", help="e.g. 10.0.0.11/24."
)
@click.option(
    "--gateway", required=True, callback=check_address, metavar="IP", help="Inside the --ip network."
)
@identifier_option("bridge", "vmbr0", "The network bridge.")
@identifier_option("storage", "local-lvm", "Where the disk and the cloud-init drive go.")
@click.option(
    "--image",
    required=True,
    metavar="PATH|VOLUME",
    help="The cloud image to import (qcow2 or raw, with cloud-init): a path on this host or a volume id.",
)
@click.option("--cores", type=int, required=True, callback=check_positive, help="Virtual CPU cores.")
@click.option("--memory", required=True, metavar="SIZE", help="MiB, or with a unit: 64G.")
@click.option("--disk", required=True, metavar="SIZE", help="GiB, or with a unit: 200G, 1T.")
@click.option(
    "--gpu",
    "gpus",
    multiple=True,
    callback=check_gpus,
    metavar="PCI_ID",
    help="A device to pass through, as lspci -D names it (repeatable).",
)
@click.option(
    "--ssh-keys",
    metavar="FILE",
    help=f"OpenSSH public keys that may log in [default: this host's {DEFAULT_SSH_KEYS}].",
)
@click.option(
    "--user", callback=check_user, help="The user cloud-init makes for those keys [default: the image's own]."
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
    check_gateway(ip, gateway)
    image_arg, image_warning = check_image(image, must_exist=not dry_run)
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
        warn(image_warning)

    refuse_if_taken(provisioner, request, dry_run=dry_run)
    if dry_run:
        print_plan(provisioner, request, keys)
        return
    with tempfile.TemporaryDirectory(prefix="llmgw-provision-") as scratch:
        if keys.comments:
            # Proxmox checks every non-blank line with ssh-keygen and refuses comments: pass the keys only
            copy = Path(scratch) / "authorized_keys"
            copy.write_text(keys.without_comments(), encoding="utf-8")
            request = attrs.evolve(request, ssh_keys_file=str(copy))
        run_steps(provisioner, request)
    print_made(provisioner, request, keys, node)


def _check_node_id(name: str, node_id: str | None) -> str | None:
    """The node id it will get, warning when it is not the VM's name."""
    if node_id is None:
        from llmgw.pki import PkiError, validate_name

        try:
            return validate_name(name)
        except PkiError as exc:
            warn(f"--name {name!r} cannot be a node id ({exc}); pass --node-id and onboard with that id")
            return None
    if node_id != name:
        warn(
            f"the VM is named {name!r} but its node id will be {node_id!r}: `ctl nodes` and the hypervisor "
            "will show different names for one machine; name the VM after the node (--name "
            f"{node_id}) unless you mean it"
        )
    return node_id


def main() -> None:
    """Entry point of the ``llmgw-provision-node`` console script."""
    provision_node(prog_name="llmgw-provision-node")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
