"""engine-check: would an installed engine accept every flag llmgw passes it?

The check builds the widest command an engine plugin would ever produce (every
rank of :meth:`~llmgw.engine.Engine.widest_spec`), reads the flags the real
program's help documents (:meth:`~llmgw.engine.Engine.parse_help`: option
definition lines only, so ``--port`` is not satisfied by ``--port-range`` nor by
a mention inside a description), and reports each flag as accepted or missing
with the llmgw feature that uses it. It also says when a help text looks cut
short or is not the full help, and marks the flags missing from it as possibly
caused by that.

``ctl engine-check`` (:mod:`llmgw.enginecheck.cli`) and the agent at start run
the same two functions: :func:`check_engine` on help texts in hand, and
:func:`check_installed`, which first runs each program's help command.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from llmgw.engine import Engine, help_and_version_of
from llmgw.errors import LlmgwError, PluginError
from llmgw.models import Command, LaunchSpec

__all__ = [
    "ACCEPTED",
    "MISSING",
    "UNCHECKED",
    "PROFILE_ARGS",
    "CheckReport",
    "CollectedHelp",
    "FlagCheck",
    "HelpCommandError",
    "HelpRun",
    "ProgramHelp",
    "check_engine",
    "check_installed",
    "collect_help",
    "command_program",
    "completeness_warnings",
    "option_flags",
    "run_help",
    "widest_commands",
]

ACCEPTED = "accepted"
MISSING = "missing"
#: the program's help could not be read, so the flag was not checked
UNCHECKED = "unchecked"
#: the feature label of flags that come from a profile's ``args``
PROFILE_ARGS = "profile args"

_NUMBER = re.compile(r"^-\d+(\.\d+)?$")
# argparse's usage synopsis: "usage: prog [-h] --model-path MODEL_PATH ..." up to a blank line.
_USAGE_START = re.compile(r"^usage:", re.IGNORECASE)
_USAGE_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w.-]*)")


@attrs.frozen
class FlagCheck:
    """One flag of the widest command, checked against its program's help."""

    flag: str
    program: str
    #: what llmgw uses the flag for (``multi-node rendezvous``), or ``-``
    feature: str
    #: the ranks whose command carries the flag
    ranks: tuple[int, ...] = attrs.field(converter=tuple)
    #: ``accepted``, ``missing``, or ``unchecked`` (the help could not be read)
    status: str
    #: missing from a help that looks cut short or is not the full help
    possibly_truncated: bool = False

    def describe(self) -> str:
        """One line for an operator: ``missing --nnodes (vllm, multi-node rendezvous)``."""
        line = f"{self.status} {self.flag} ({self.program}, {self.feature})"
        if self.possibly_truncated:
            line += ", possibly because the help is truncated"
        return line


@attrs.frozen
class ProgramHelp:
    """The help text engine-check used for one program, and what it made of it."""

    program: str
    #: where the help came from: a file, ``--help-output``, or the command run
    source: str | None = None
    #: how many flag spellings the help documents
    documented: int = 0
    #: signs that the help is cut short or not the full help
    warnings: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: why there is no help for the program (its help command failed); None when there is
    failure: str | None = None


@attrs.frozen
class CheckReport:
    """Everything one engine-check found: per program, per flag."""

    engine: str
    checked_versions: tuple[str, ...] = attrs.field(converter=tuple)
    programs: tuple[ProgramHelp, ...] = attrs.field(converter=tuple)
    flags: tuple[FlagCheck, ...] = attrs.field(converter=tuple)

    @property
    def missing(self) -> tuple[FlagCheck, ...]:
        """The flags a program's help does not document."""
        return tuple(f for f in self.flags if f.status == MISSING)

    @property
    def failures(self) -> tuple[ProgramHelp, ...]:
        """The programs whose help could not be read."""
        return tuple(p for p in self.programs if p.failure is not None)

    @property
    def warnings(self) -> tuple[str, ...]:
        """Every completeness warning, program by program."""
        return tuple(w for p in self.programs for w in p.warnings)

    @property
    def missing_features(self) -> tuple[str, ...]:
        """The llmgw features the missing flags serve, each once, in flag order (``LoRA adapters
        (max_adapters)``, ``multi-node rendezvous``); read by ``ctl engine-check`` to say what cannot be
        used, and by whoever must not place such a feature on the engine."""
        return tuple(dict.fromkeys(f.feature for f in self.missing if f.feature != "-"))

    @property
    def ok(self) -> bool:
        """True when every program's help was read and documents every flag."""
        return not self.missing and not self.failures

    def summary(self) -> str:
        """One line: ``vllm: ok`` or what is wrong, for logs and ``ctl nodes``."""
        if self.ok:
            return f"{self.engine}: ok, {len(self.flags)} flags accepted"
        parts = [f"help of {p.program} unavailable" for p in self.failures]
        if self.missing:
            flags = ", ".join(f"{f.flag} ({f.program})" for f in self.missing)
            parts.append(f"{len(self.missing)} flags missing: {flags}")
        if self.warnings:
            parts.append("the help looks truncated or is not the full help")
        return f"{self.engine}: " + "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON object (``ctl engine-check --json``, the agent's report)."""
        data = attrs.asdict(self, value_serializer=_json_value)
        data["ok"] = self.ok
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckReport:
        """The report :meth:`to_json` gave (``ok`` is recomputed, not read)."""
        return cls(
            engine=data["engine"],
            checked_versions=data["checked_versions"],
            programs=[ProgramHelp(**program) for program in data["programs"]],
            flags=[FlagCheck(**flag) for flag in data["flags"]],
        )


def _json_value(instance: object, field: attrs.Attribute | None, value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class HelpCommandError(LlmgwError):
    """A program's help command could not be run, or printed no help."""


@attrs.frozen
class HelpRun:
    """What one help command printed: the help text, and how it ended."""

    program: str
    #: the command as an operator would type it
    command: str
    text: str
    returncode: int


def option_flags(args: Sequence[str]) -> list[str]:
    """The flags among ``args`` (``--x`` or ``-x``, without ``=value``), in order, each once.

    Negative numbers (``-1``) are values, not flags.
    """
    flags: list[str] = []
    for arg in args:
        if arg.startswith("-") and len(arg) > 1 and not _NUMBER.match(arg):
            flag = arg.split("=", 1)[0]
            if flag not in flags:
                flags.append(flag)
    return flags


def widest_commands(
    engine: Engine, extra_args: Sequence[str] | None = None
) -> list[tuple[LaunchSpec, str, Command]]:
    """The command of every rank of the engine's widest spec, with the program each runs.

    :param extra_args: profile args to build with instead of the widest
        spec's own (``None`` keeps them).
    :returns: ``(spec, program, command)`` per rank, rank 0 first.
    :raises PluginError: a command runs none of the engine's programs.
    """
    widest = engine.widest_spec()
    if extra_args is not None:
        widest = attrs.evolve(widest, extra_args=tuple(extra_args))
    out = []
    for rank in range(widest.nnodes):
        spec = attrs.evolve(widest, rank=rank)
        command = engine.build_command(spec)
        out.append((spec, command_program(engine, spec, command), command))
    return out


def command_program(engine: Engine, spec: LaunchSpec, command: Command) -> str:
    """Which of the engine's programs ``command`` runs, found from its argv[0].

    :raises PluginError: argv[0] is none of them (the message says how to build it).
    """
    for program in engine.programs:
        if command.argv[0] in (engine.program_path(spec, program), program):
            return program
    raise PluginError(
        f"engine {engine.name!r}: argv[0] {command.argv[0]!r} of rank {spec.rank} is none of its "
        f"programs {engine.programs}; build argv[0] with engine.program_path(spec, PROGRAM)"
    )


def completeness_warnings(engine: Engine, program: str, text: str, documented: frozenset[str]) -> list[str]:
    """Signs that ``text`` is not the full help of ``program``.

    Every full help defines ``--help`` (or ``-h``) on an option line of its
    own; an argparse usage synopsis names no flag that no option line
    defines; and the engine's own :meth:`~llmgw.engine.Engine.help_warnings`.

    :param documented: what ``engine.parse_help(text)`` returned.
    """
    warnings = []
    if not {"--help", "-h"} & documented:
        command = shlex.join([program, *help_and_version_of(engine, program).help_args])
        warnings.append(
            f"{program}: the help defines no --help option, so it looks truncated or is not the "
            f"full help (engine-check reads what `{command}` prints)"
        )
    usage = _usage_flags(text)
    undefined = [flag for flag in usage if flag not in documented]
    # A cut-short help loses its last options: several of the flags its usage
    # names, or the last one. (One undefined flag in the middle is an oddity of
    # the help, not a cut.)
    if len(undefined) >= 2 or (usage and usage[-1] in undefined):
        shown = ", ".join(undefined[:5]) + (", ..." if len(undefined) > 5 else "")
        warnings.append(
            f"{program}: the usage line names {len(undefined)} flag{'s' if len(undefined) > 1 else ''} "
            f"that no option line defines ({shown}), so the help looks truncated"
        )
    warnings += [f"{program}: {warning}" for warning in engine.help_warnings(program, text)]
    return warnings


def _usage_flags(text: str) -> list[str]:
    """The flags an argparse usage synopsis names, in order, each once.

    The synopsis runs from the ``usage:`` line to the first blank line; on its
    first line, flags count from the first ``[`` on, past the program's name
    (which may be ``python -m ...``).
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _USAGE_START.match(line)), None)
    if start is None:
        return []
    first = lines[start]
    synopsis = [first[first.index("[") :] if "[" in first else ""]
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        synopsis.append(line)
    flags: list[str] = []
    for flag in _USAGE_FLAG.findall("\n".join(synopsis)):
        if flag not in flags:
            flags.append(flag)
    return flags


def check_engine(
    engine: Engine,
    help_texts: Mapping[str, str],
    *,
    failures: Mapping[str, str] | None = None,
    sources: Mapping[str, str] | None = None,
    notes: Mapping[str, str] | None = None,
    extra_args: Sequence[str] | None = None,
) -> CheckReport:
    """Check every flag of the engine's widest command against its programs' help.

    :param help_texts: program name -> what that program printed for its help.
    :param failures: program name -> why its help could not be read; its flags
        are reported ``unchecked``, not missing. A program in neither mapping
        is a failure too ("no help given").
    :param sources: program name -> where its help came from, for the report.
    :param notes: program name -> one more reason to doubt its help (its help
        command exited non-zero), added to its warnings.
    :param extra_args: profile args to check too, instead of the widest spec's own.
    :raises ValueError: a help or failure names a program the engine does not run.
    """
    failures = dict(failures or {})
    sources = dict(sources or {})
    notes = dict(notes or {})
    unknown = sorted((set(help_texts) | set(failures)) - set(engine.programs))
    if unknown:
        raise ValueError(
            f"engine {engine.name!r} runs {', '.join(engine.programs)}, not {', '.join(unknown)}"
        )
    documented: dict[str, frozenset[str]] = {}
    programs = []
    for program in engine.programs:
        if program in help_texts and program not in failures:
            flags = engine.parse_help(help_texts[program])
            documented[program] = flags
            warnings = completeness_warnings(engine, program, help_texts[program], flags)
            warnings += [f"{program}: {notes[program]}"] if program in notes else []
            programs.append(ProgramHelp(program, sources.get(program), len(flags), warnings))
        else:
            failure = failures.get(program, "no help given")
            programs.append(ProgramHelp(program, sources.get(program), failure=failure))
    truncated = {p.program for p in programs if p.warnings}
    commands = widest_commands(engine, extra_args)
    profile_flags = set(option_flags(commands[0][0].extra_args))
    features = engine.flag_features
    seen: dict[tuple[str, str], list[int]] = {}
    for spec, program, command in commands:
        for flag in option_flags(engine.option_args(command)):
            seen.setdefault((program, flag), []).append(spec.rank)
    checks = []
    for (program, flag), ranks in seen.items():
        feature = features.get(flag) or (PROFILE_ARGS if flag in profile_flags else "-")
        if program not in documented:
            status = UNCHECKED
        else:
            status = ACCEPTED if flag in documented[program] else MISSING
        maybe = status == MISSING and program in truncated
        checks.append(FlagCheck(flag, program, feature, ranks, status, maybe))
    return CheckReport(engine.name, engine.checked_versions, programs, checks)


def run_help(engine: Engine, program: str, path: str, *, timeout: float) -> HelpRun:
    """Run ``path`` with the engine's help arguments for ``program`` and return its help.

    The help is taken from stdout, or from stderr when stdout holds no option
    definition (llama.cpp's older ``rpc-server`` prints it there).

    :param timeout: seconds the command may take; then its process group is killed.
    :raises HelpCommandError: the command could not start, did not finish in
        time, or printed no option definition; the message holds its exit
        code and the tail of its stderr.
    """
    asked = help_and_version_of(engine, program)
    argv = [path, *asked.help_args]
    extra_env = dict(asked.help_env)
    shown = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in extra_env.items()), shlex.join(argv)])
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **extra_env},
            start_new_session=True,
        )
    except OSError as exc:
        raise HelpCommandError(f"{program}: cannot run `{shown}`: {exc.strerror or exc}") from None
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        process.communicate()
        raise HelpCommandError(f"{program}: `{shown}` did not finish within {timeout:g} s") from None
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    for text in (stdout, stderr):
        if engine.parse_help(text):
            return HelpRun(program, shown, text, process.returncode)
    printed = "nothing on stdout" if not stdout.strip() else "no option definitions on stdout"
    tail = _tail(stderr) or _tail(stdout)
    message = f"{program}: `{shown}` exited {process.returncode} and printed {printed}"
    message += f"; its stderr ends with:\n{tail}" if tail else "; its stderr is empty"
    raise HelpCommandError(message)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(text: str, lines: int = 10) -> str:
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join(f"  {line}" for line in kept)


@attrs.frozen
class CollectedHelp:
    """The help texts the help commands of an engine's programs printed, and their failures."""

    texts: Mapping[str, str] = attrs.field(factory=dict)
    failures: Mapping[str, str] = attrs.field(factory=dict)
    #: program -> the command that printed its help
    sources: Mapping[str, str] = attrs.field(factory=dict)
    #: program -> why its help may be incomplete though it printed one
    notes: Mapping[str, str] = attrs.field(factory=dict)


def collect_help(engine: Engine, paths: Mapping[str, str], *, timeout: float) -> CollectedHelp:
    """Run the help command of each program in ``paths`` (program -> path), keeping failures.

    :param timeout: seconds each help command may take.
    """
    texts: dict[str, str] = {}
    failures: dict[str, str] = {}
    sources: dict[str, str] = {}
    notes: dict[str, str] = {}
    for program, path in paths.items():
        try:
            run = run_help(engine, program, path, timeout=timeout)
        except HelpCommandError as exc:
            failures[program] = str(exc)
            continue
        texts[program], sources[program] = run.text, f"`{run.command}`"
        if run.returncode != 0:
            notes[program] = f"its help command exited {run.returncode}, so the help may be incomplete"
    return CollectedHelp(texts, failures, sources, notes)


def check_installed(
    engine: Engine,
    executables: Mapping[str, str] | None = None,
    *,
    timeout: float,
    extra_args: Sequence[str] | None = None,
) -> CheckReport:
    """Run each program's help command, then :func:`check_engine` on what they printed.

    What the agent runs at start for each installed engine. A help command
    that fails is reported as that failure (its flags ``unchecked``), never as
    every flag missing.

    :param executables: program name -> path on this node (the agent's
        configuration); a program missing here is run by its bare name.
    :param timeout: seconds each help command may take.
    """
    executables = executables or {}
    paths = {program: executables.get(program, program) for program in engine.programs}
    collected = collect_help(engine, paths, timeout=timeout)
    return check_engine(
        engine,
        collected.texts,
        failures=collected.failures,
        sources=collected.sources,
        notes=collected.notes,
        extra_args=extra_args,
    )
