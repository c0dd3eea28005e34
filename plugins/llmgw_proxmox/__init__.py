"""Built-in plugin: make nodes as Proxmox VE virtual machines with ``qm``.

``llmgw-provision-node --kind proxmox`` (the default) runs on the Proxmox VE
host, as root, and gets from :class:`ProxmoxProvisioner`:

1. ``qm config VMID``, read-only, to refuse a VMID that is taken;
2. ``qm create VMID ... --scsi0 STORAGE:0,import-from=IMAGE ...``: the VM, its
   disk imported from a cloud image, a cloud-init drive with the network, the
   ssh keys and no package upgrade on first boot (``--ciupgrade 0``, Proxmox VE
   8.0 or later), and the GPUs passed through. One command, so a failed import
   leaves nothing: ``qm create`` frees the disks and the config it made;
3. ``qm resize VMID scsi0 SIZE``: cloud-init grows the root file system to it;
4. ``qm start VMID``.

Tests put a fake ``qm`` on ``PATH`` (``tests/test_provision.py``).
"""

from __future__ import annotations

from llmgw import hookimpl
from llmgw.provision import Provisioner

from ._qm import QM, ProxmoxProvisioner, ipconfig

__all__ = ["QM", "ProxmoxProvisioner", "ipconfig", "llmgw_register_provisioners"]


@hookimpl
def llmgw_register_provisioners() -> list[Provisioner]:
    """Register the ``proxmox`` provisioner."""
    return [ProxmoxProvisioner()]
