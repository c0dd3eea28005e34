"""Running a provisioner's commands: check the id is free, run the steps, say what was made or what is left.

:func:`refuse_if_taken` runs before anything changes; :func:`run_steps`
streams each step's output and, when one fails or is interrupted, raises a
:class:`~llmgw.provision.ProvisionError` that says what was done, what is left
(checked, not assumed) and the commands that remove it or finish by hand.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Callable

import click

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
from llmgw.provision.flags import SshKeys

__all__ = ["print_made", "print_plan", "refuse_if_taken", "run_steps", "shell", "warn"]


def warn(text: str) -> None:
    """Print ``warning: text`` on stderr."""
    click.echo(f"warning: {text}", err=True)


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


def shell(command: Command) -> str:
    """``command`` as one shell line an operator can paste (its env and cwd included)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in command.env.items())
    line = shlex.join(command.argv)
    line = f"{env} {line}" if env else line
    return f"(cd {shlex.quote(command.cwd)} && {line})" if command.cwd else line


def refuse_if_taken(provisioner: Provisioner, request: MachineRequest, *, dry_run: bool) -> None:
    """Check that the machine's id is free before anything runs.

    With ``dry_run`` it prints what it found, and only notes a check it cannot run here.

    :raises MachineExistsError: the id is taken (exit 3).
    :raises ProvisionError: the check's program is not on PATH (not with ``dry_run``).
    """
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
            f"VMID {request.vmid} is taken by {existing.describe()} (`{shell(check)}`); "
            "llmgw-provision-node never changes an existing machine. Choose another --vmid"
            + (f" ({provisioner.id_hint})" if provisioner.id_hint else "")
            + ", or remove that machine yourself if it is a leftover"
        )
    if dry_run:
        click.echo(f"# VMID {request.vmid} is free (`{shell(check)}`)")


def print_plan(provisioner: Provisioner, request: MachineRequest, keys: SshKeys) -> None:
    """Print the commands a run would make, for ``--dry-run``; nothing is run."""
    steps = provisioner.steps(request)
    click.echo(f"# dry run: the {len(steps)} commands that would make {request.name!r}; nothing was run")
    if keys.comments:
        click.echo(
            f"# {keys.path} has {keys.comments} comment line(s), which Proxmox refuses: the run passes "
            "a temporary copy with only its keys instead of that file"
        )
    for number, step in enumerate(steps, 1):
        click.echo(f"# {number}/{len(steps)}: {step.title}")
        click.echo(shell(step.command))


def run_steps(provisioner: Provisioner, request: MachineRequest) -> None:
    """Run the provisioner's steps in order, streaming their output.

    :raises MachineExistsError: a step was refused because the id was taken after the check.
    :raises ProvisionError: a step failed or was interrupted (exit 130); says what is left, how to clean up.
    """
    steps = provisioner.steps(request)
    for number, step in enumerate(steps, 1):
        click.echo(f"[{number}/{len(steps)}] {step.title}")
        click.echo(f"    $ {shell(step.command)}")
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
                f"left behind: nothing; `{shell(check)}` says VMID {request.vmid} is free "
                "(a create that fails removes what it made)"
            )
            return "\n".join(lines)
        lines.append(f"left behind: {existing.describe()} (`{shell(check)}`)")
        if existing.name not in (None, request.name):
            lines.append(
                f"that machine is not named {request.name!r}: it may not be this run's; "
                "look at it before removing anything"
            )
            return "\n".join(lines)
    cleanup = provisioner.cleanup_commands(request)
    if cleanup:
        lines.append("to remove it" + (", if it exists:" if unknown else ":"))
        lines.extend(f"  {shell(c)}" for c in cleanup)
    rest = steps[number - 1 :]
    lines.append("or fix the cause and finish by hand:")
    lines.extend(f"  {shell(s.command)}" for s in rest)
    return "\n".join(lines)


def print_made(provisioner: Provisioner, request: MachineRequest, keys: SshKeys, node_id: str | None) -> None:
    """Say what was made and the ``llmgw-onboard-node`` command that comes next."""
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
