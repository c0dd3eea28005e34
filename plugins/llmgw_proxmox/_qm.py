"""The ``qm`` commands that make a node's VM, and what ``qm`` says back."""

from __future__ import annotations

import ipaddress
import re
from typing import ClassVar

from llmgw.models import Command
from llmgw.provision import (
    CommandResult,
    ExistingMachine,
    MachineRequest,
    Provisioner,
    ProvisionError,
    Step,
    StepFailure,
)

__all__ = ["QM", "ProxmoxProvisioner", "ipconfig"]

#: The program run for every command; a bare name is looked up on PATH.
QM = "qm"

#: ``qm config`` on a VMID with no VM config on this node (exit status 2).
_NO_CONFIG = re.compile(r"Configuration file '[^']*/qemu-server/(\d+)\.conf' does not exist")
#: ``qm create`` on a VMID that is taken anywhere in the cluster, by a VM or a container
#: (``unable to create VM 101 - VM 101 already exists on node 'pve'``).
_TAKEN = re.compile(r"\b(VM|CT) (\d+) already exists on node '([^']+)'")
#: The same refusal from Proxmox VE before 7 (``unable to create vm 101: config file already exists``).
_TAKEN_OLD = re.compile(r"unable to create vm \d+: config file already exists", re.IGNORECASE)
_NO_CIUPGRADE = re.compile(r"ciupgrade: property is not defined in schema")
_IMPORT_FAILED = re.compile(r"copy failed|qemu-img|import-from|could not (open|read)", re.IGNORECASE)


def ipconfig(ip_cidr: str, gateway: str) -> str:
    """The ``--ipconfig0`` value: ``ip=10.0.0.11/24,gw=10.0.0.1`` (``ip6=...,gw6=...`` for IPv6)."""
    if ipaddress.ip_interface(ip_cidr).version == 6:
        return f"ip6={ip_cidr},gw6={gateway}"
    return f"ip={ip_cidr},gw={gateway}"


class ProxmoxProvisioner(Provisioner):
    """A VM on the Proxmox VE host this runs on, from a cloud image, set up by cloud-init."""

    name: ClassVar[str] = "proxmox"
    id_hint: ClassVar[str] = "`pvesh get /cluster/nextid` prints a free one"

    def exists_command(self, request: MachineRequest) -> Command:
        """``qm config VMID``: prints the VM's config, or fails saying it does not exist."""
        return Command(argv=[QM, "config", str(request.vmid)])

    def read_existing(self, request: MachineRequest, result: CommandResult) -> ExistingMachine | None:
        """A VM or template on this node from ``qm config``; ``None`` when qm says there is no config.

        ``qm config`` reads this node's configs only: a container, or a VM on
        another cluster node, with this VMID is found by ``qm create``, which
        refuses it (see :meth:`explain_failure`).
        """
        if result.ok:
            config = dict(
                line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line and line[0] != " "
            )
            kind = "template" if config.get("template", "").strip() == "1" else "VM"
            return ExistingMachine(request.vmid, name=config.get("name", "").strip() or None, kind=kind)
        found = _NO_CONFIG.search(result.stderr + result.stdout)
        if found and int(found.group(1)) == request.vmid:
            return None
        raise ProvisionError(
            f"cannot tell whether VMID {request.vmid} is free: `qm config {request.vmid}` failed "
            f"(exit status {result.returncode}):\n  {_indent(result.message())}\n"
            "run llmgw-provision-node on the Proxmox VE host, as root"
        )

    def create_commands(self, request: MachineRequest) -> list[Command]:
        """The three commands of :meth:`steps`."""
        return [step.command for step in self.steps(request)]

    def steps(self, request: MachineRequest) -> list[Step]:
        """Create (with the import), grow the disk, start."""
        vmid = str(request.vmid)
        return [
            Step(
                f"create VM {vmid} {request.name!r} and import {request.image} into {request.storage}",
                Command(argv=self.create_argv(request)),
            ),
            Step(
                f"grow its disk to {request.disk_gib} GiB",
                Command(argv=[QM, "resize", vmid, "scsi0", f"{request.disk_gib}G"]),
            ),
            Step(f"start VM {vmid}", Command(argv=[QM, "start", vmid])),
        ]

    def create_argv(self, request: MachineRequest) -> list[str]:
        """The ``qm create`` command line: every setting in one command, so a failure leaves nothing."""
        argv = [
            QM,
            "create",
            str(request.vmid),
            "--name",
            request.name,
            "--ostype",
            "l26",
            # q35 for PCIe passthrough (hostpciN's pcie=1 needs it); host CPU for the engines' kernels
            "--machine",
            "q35",
            "--cpu",
            "host",
            "--cores",
            str(request.cores),
            "--memory",
            str(request.memory_mib),
        ]
        if request.gpus:
            # passed-through devices pin all of the guest's memory: a balloon cannot take any back
            argv += ["--balloon", "0"]
        argv += [
            "--scsihw",
            "virtio-scsi-pci",
            "--scsi0",
            f"{request.storage}:0,import-from={request.image}",
            "--ide2",
            f"{request.storage}:cloudinit",
            "--boot",
            "order=scsi0",
            # cloud images expect a serial console
            "--serial0",
            "socket",
            "--vga",
            "serial0",
            "--net0",
            f"virtio,bridge={request.bridge}",
            "--ipconfig0",
            ipconfig(request.ip_cidr, request.gateway),
            # no package upgrade on first boot: the node runs what the image had (Proxmox VE 8.0+)
            "--ciupgrade",
            "0",
        ]
        if request.user:
            argv += ["--ciuser", request.user]
        if request.ssh_keys_file:
            # qm reads the file itself (on this host) and checks every line with ssh-keygen
            argv += ["--sshkeys", request.ssh_keys_file]
        for index, gpu in enumerate(request.gpus):
            argv += [f"--hostpci{index}", f"{gpu},pcie=1"]
        return argv

    def explain_failure(self, request: MachineRequest, step: Step, result: CommandResult) -> StepFailure:
        """Tell a taken VMID (a race), a failed import and a few well-known refusals apart."""
        said = result.stderr + "\n" + result.stdout
        what = step.command.argv[1] if len(step.command.argv) > 1 else ""
        reason = f"qm said:\n  {_indent(result.message())}"
        if what == "create":
            taken = _TAKEN.search(said)
            if taken and int(taken.group(2)) == request.vmid:
                kind = taken.group(1)
                return StepFailure(
                    reason=reason,
                    taken_by=ExistingMachine(request.vmid, kind=kind, where=f"node {taken.group(3)!r}"),
                    hint="a container holds it: `qm config` sees only VMs"
                    if kind == "CT"
                    else "a VM made meanwhile, here or on another cluster node (`qm config` sees only "
                    "the VMs of this node)",
                )
            if _TAKEN_OLD.search(said):
                return StepFailure(reason=reason, taken_by=ExistingMachine(request.vmid))
            if _NO_CIUPGRADE.search(said):
                return StepFailure(
                    reason=reason,
                    hint="this Proxmox VE does not know --ciupgrade (added in 8.0, qemu-server 8.0.2); "
                    "without it cloud-init would upgrade every package on first boot: upgrade Proxmox VE",
                )
            if "SSH public key validation error" in said:
                return StepFailure(
                    reason=reason,
                    hint=f"Proxmox checks every line of {request.ssh_keys_file} with ssh-keygen -l; "
                    "keep only OpenSSH public key lines",
                )
            if _IMPORT_FAILED.search(said):
                return StepFailure(
                    reason=f"importing {request.image} into {request.storage} failed; {reason}",
                    hint="check the image with `qemu-img info IMAGE` and the storage with `pvesm status`",
                )
        if what == "resize" and "shrinking disks is not supported" in said:
            return StepFailure(
                reason=reason,
                hint=f"--disk {request.disk_gib}G is smaller than the image; "
                "`qemu-img info IMAGE` shows its virtual size",
            )
        if what == "start" and request.gpus and re.search(r"vfio|iommu|hostpci", said, re.IGNORECASE):
            return StepFailure(
                reason=reason,
                hint="PCI passthrough needs the IOMMU on (intel_iommu=on or amd_iommu=on) and the "
                "devices free for vfio-pci; `lspci -nnk -s PCI_ID` shows the driver in use",
            )
        return StepFailure(reason=reason)

    def cleanup_commands(self, request: MachineRequest) -> list[Command]:
        """``qm destroy VMID``, with the disks it no longer references (a half-finished import)."""
        return [
            Command(
                argv=[QM, "destroy", str(request.vmid), "--destroy-unreferenced-disks", "1", "--purge", "1"]
            )
        ]


def _indent(text: str) -> str:
    return text.replace("\n", "\n  ")
