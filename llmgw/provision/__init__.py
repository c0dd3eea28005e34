"""The Provisioner base class: what a provisioner plugin registers.

A provisioner makes a machine for a node on some hypervisor. Like engines, it
returns commands and reads their results, and does no I/O of its own:
``llmgw-provision-node`` runs the commands, in order, and stops at the first
that fails. What a provisioner knows and the runner does not:

- whether the id is free: :meth:`Provisioner.exists_command`, read by
  :meth:`Provisioner.read_existing`;
- the steps that make the machine, each with a title an operator understands:
  :meth:`Provisioner.steps` (by default one per :meth:`Provisioner.create_commands`);
- what a failed step means, in particular "the id was taken after the check"
  (a race, in which this run made nothing): :meth:`Provisioner.explain_failure`;
- how to remove what a failed run left behind: :meth:`Provisioner.cleanup_commands`.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import attrs

from llmgw.errors import LlmgwError
from llmgw.models import Command, positive

__all__ = [
    "Provisioner",
    "MachineRequest",
    "Step",
    "CommandResult",
    "ExistingMachine",
    "StepFailure",
    "ProvisionError",
    "MachineExistsError",
]


@attrs.frozen
class MachineRequest:
    """The machine an operator asked for, already validated by the command line."""

    vmid: int = attrs.field(validator=positive)
    name: str
    #: the machine's address with its prefix length (``10.0.0.11/24``)
    ip_cidr: str
    gateway: str
    bridge: str
    storage: str
    #: the disk image to import: a path on the hypervisor host or a storage volume id
    image: str
    cores: int = attrs.field(validator=positive)
    memory_mib: int = attrs.field(validator=positive)
    disk_gib: int = attrs.field(validator=positive)
    #: PCI addresses of the devices to pass through, in order
    gpus: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: a file of OpenSSH public keys, one a line, that may log in
    ssh_keys_file: str | None = None
    #: the user cloud-init creates for those keys; ``None`` keeps the image's default user
    user: str | None = None


@attrs.frozen
class Step:
    """One command of the plan, with what it does in an operator's words."""

    title: str
    command: Command


@attrs.frozen
class CommandResult:
    """How a command ended: its exit status and what it printed."""

    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        """Whether the command exited 0."""
        return self.returncode == 0

    def message(self, lines: int = 6) -> str:
        """The last ``lines`` non-empty lines it printed (stderr, else stdout), for an error message."""
        text = self.stderr.strip() or self.stdout.strip()
        kept = [line.rstrip() for line in text.splitlines() if line.strip()]
        return "\n".join(kept[-lines:]) or f"(no output; exit status {self.returncode})"


@attrs.frozen
class ExistingMachine:
    """A machine that already holds the requested id."""

    vmid: int
    #: its name, when the hypervisor says
    name: str | None = None
    #: what it is in the hypervisor's words (``VM``, ``template``, ``CT``)
    kind: str = "VM"
    #: where it is, when it is not where the check looked (``node 'pve2'``)
    where: str | None = None

    def describe(self) -> str:
        """``VM 101 'gpu-01'``, ``CT 101 on node 'pve2'``."""
        text = f"{self.kind} {self.vmid}"
        if self.name:
            text += f" {self.name!r}"
        if self.where:
            text += f" on {self.where}"
        return text


@attrs.frozen
class StepFailure:
    """What a failed step means."""

    #: one or more lines: what failed and, when known, why
    reason: str
    #: set when the step failed because the id was taken after the check (a race):
    #: nothing was made by this run and the other machine must not be touched
    taken_by: ExistingMachine | None = None
    #: what the operator can do about it, when the provisioner knows
    hint: str | None = None


class ProvisionError(LlmgwError):
    """Provisioning that cannot go on; the message says what was made and what to do."""


class MachineExistsError(ProvisionError):
    """The requested id is taken: found by the check, or by the create itself (a race)."""

    exit_code = 3


class Provisioner(abc.ABC):
    """One hypervisor llmgw can make nodes on."""

    #: the name ``llmgw-provision-node --kind`` selects
    name: ClassVar[str]
    #: where an operator finds a free id, for the refusal of a taken one (``""`` when there is no such way)
    id_hint: ClassVar[str] = ""

    @abc.abstractmethod
    def exists_command(self, request: MachineRequest) -> Command:
        """A read-only command that tells whether ``request.vmid`` is taken (see :meth:`read_existing`)."""

    @abc.abstractmethod
    def create_commands(self, request: MachineRequest) -> list[Command]:
        """The commands that create and start the machine, in order."""

    def steps(self, request: MachineRequest) -> list[Step]:
        """:meth:`create_commands` with titles; override to give better ones."""
        return [Step(" ".join(c.argv[:2]), c) for c in self.create_commands(request)]

    def read_existing(self, request: MachineRequest, result: CommandResult) -> ExistingMachine | None:
        """Read the result of :meth:`exists_command`.

        The default takes exit status 0 as "taken" and anything else as
        "free"; a provisioner that can tell "free" from "the check failed"
        should override this and raise.

        :returns: the machine holding the id, or ``None`` when it is free.
        :raises ProvisionError: when the result says neither (the check itself failed).
        """
        return ExistingMachine(request.vmid) if result.ok else None

    def explain_failure(self, request: MachineRequest, step: Step, result: CommandResult) -> StepFailure:
        """Say what a failed step means; set ``taken_by`` when the id turned out to be taken."""
        return StepFailure(reason=result.message())

    def cleanup_commands(self, request: MachineRequest) -> list[Command]:
        """Commands that remove the machine this run made, to suggest after a failure; none by default."""
        return []
