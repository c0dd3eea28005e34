"""The Provisioner base class: what a provisioner plugin registers.

A provisioner makes a machine for a node on some hypervisor. Like engines, it
returns commands and does no I/O: ``llmgw-provision-node`` runs them.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import attrs

from llmgw.models import Command

__all__ = ["Provisioner", "MachineRequest"]


@attrs.frozen
class MachineRequest:
    """The machine an operator asked for."""

    vmid: int
    name: str
    ip_cidr: str
    gateway: str
    bridge: str
    storage: str
    image: str
    cores: int
    memory_mib: int
    disk_gib: int
    gpus: tuple[str, ...] = attrs.field(converter=tuple, default=())
    ssh_keys_file: str | None = None


class Provisioner(abc.ABC):
    """One hypervisor llmgw can make nodes on."""

    #: the name ``llmgw-provision-node --kind`` selects
    name: ClassVar[str]

    @abc.abstractmethod
    def exists_command(self, request: MachineRequest) -> Command:
        """A command that exits 0 when ``request.vmid`` is already taken."""

    @abc.abstractmethod
    def create_commands(self, request: MachineRequest) -> list[Command]:
        """The commands that create and start the machine, in order."""
