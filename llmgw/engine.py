"""The Engine base class: what an engine plugin registers.

An engine turns a :class:`~llmgw.models.LaunchSpec` into a
:class:`~llmgw.models.Command`, names its health path, and reads its own
``--help`` into the set of flags it documents. It does no I/O: the agent runs
the command, probes the health path and captures the help text.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping
from typing import ClassVar

import attrs

from llmgw.models import Command, LaunchSpec

__all__ = ["Engine", "LivenessProbe", "parse_argparse_flags"]


@attrs.frozen
class LivenessProbe:
    """A request to rank 0 whose answer within ``timeout`` seconds proves the engine still serves.

    The agent sends it every ``interval`` seconds once the shard is ready, beside
    the health check; any HTTP answer passes, no answer in time (or a broken
    connection) makes the shard ``unhealthy``.
    """

    method: str
    path: str
    body: Mapping[str, object] | None = None
    timeout: float = 10.0
    interval: float = 5.0


class Engine(abc.ABC):
    """One inference engine llmgw can launch.

    Subclasses set the class attributes and implement :meth:`build_command`
    and :meth:`widest_spec`; :meth:`parse_help` has an argparse-style default.
    """

    #: the name profiles use in ``engine:``; unique across all plugins
    name: ClassVar[str]
    #: engine versions this plugin's commands were checked against
    checked_versions: ClassVar[tuple[str, ...]]
    #: whether one replica can span several nodes
    multi_node: ClassVar[bool] = False
    #: HTTP path on rank 0 that answers 200 once the replica serves
    health_path: ClassVar[str] = "/health"
    #: the programs this engine runs, by the name the agent's configuration
    #: uses for their paths; the first runs rank 0
    programs: ClassVar[tuple[str, ...]]
    #: rank 0 dials the other ranks once, at start (llama.cpp's RPC): the
    #: agent starts rank 0 only once every other rank's address accepts TCP
    wait_for_workers: ClassVar[bool] = False

    def liveness_probe(self, spec: LaunchSpec) -> LivenessProbe | None:
        """The request that proves rank 0 still serves, beyond its health path.

        Called by the agent once rank 0 of ``spec`` is ready. For engines whose
        health path stays 200 while requests hang (llama.cpp with a hung RPC
        worker). The default is None: the health path is enough.
        """
        return None

    @abc.abstractmethod
    def build_command(self, spec: LaunchSpec) -> Command:
        """Build the command that starts the shard ``spec`` describes.

        Called by the agent for every shard it starts, and by engine-check for
        the widest spec.

        :param spec: the shard to start; ``spec.rank`` 0 serves HTTP.
        :returns: the argv, environment and working directory of the shard.
        """

    @abc.abstractmethod
    def widest_spec(self) -> LaunchSpec:
        """A launch spec that makes :meth:`build_command` use every flag it ever emits.

        engine-check builds it (every rank) and checks each flag against the
        engine's real ``--help``.
        """

    def parse_help(self, text: str) -> frozenset[str]:
        """Read the flags an engine's ``--help`` output documents.

        The default reads argparse-style option definitions. Override for
        engines whose help is shaped otherwise.

        :param text: what the engine printed for ``--help``.
        :returns: every documented spelling, long and short (``--port``, ``-p``).
        """
        return parse_argparse_flags(text)

    def program_path(self, spec: LaunchSpec, program: str) -> str:
        """The path of ``program`` on the node: configured, or its bare name."""
        return spec.executables.get(program, program)

    def version_argv(self, program: str) -> tuple[str, ...]:
        """The arguments that make ``program`` print the engine's version.

        The agent runs ``PATH *version_argv(program)`` for the engine's first
        program at start and reports the version. The default is
        ``("--version",)``; an engine whose program is an interpreter
        (``python -m ...``) asks the package instead.
        """
        return ("--version",)

    def parse_version(self, text: str) -> str | None:
        """The version in what the version command printed (stdout, else stderr).

        :returns: a string comparable with :attr:`checked_versions`, or None
            when the text holds no version. The default takes the last word
            of the first non-empty line (``vllm 0.34.0`` gives ``0.34.0``).
        """
        for line in text.splitlines():
            if line.split():
                return line.split()[-1]
        return None

    def device_env(self, spec: LaunchSpec) -> dict[str, str]:
        """The environment that gives a shard its GPUs and its fabric's adapters.

        ``CUDA_VISIBLE_DEVICES`` lists ``spec.gpus`` (empty: no GPU at all);
        ``NCCL_IB_HCA`` lists ``spec.adapters`` with NCCL's exact-name prefix
        ``=``, so ``mlx5_1`` does not also select ``mlx5_10``; it is left
        out when the replica is on no fabric.
        """
        env = {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in spec.gpus)}
        if spec.adapters:
            env["NCCL_IB_HCA"] = "=" + ",".join(spec.adapters)
        return env

    # -- engine-check ------------------------------------------------------
    # The methods below have defaults that fit an argparse program printing
    # its whole help for ``--help``; override the ones your engine differs in.

    def option_args(self, command: Command) -> tuple[str, ...]:
        """The part of ``command.argv`` that the program's ``--help`` speaks about.

        engine-check reads the flags to check from it. The default is
        everything after ``argv[0]``; override it when the command starts
        with another program's arguments (``python -m sglang.launch_server``).
        """
        return tuple(command.argv[1:])

    def help_argv(self, program: str) -> tuple[str, ...]:
        """The arguments that make ``program`` print its full help.

        engine-check ``--binary`` and the agent run ``PATH *help_argv``.
        The default is ``("--help",)``.
        """
        return ("--help",)

    def help_env(self, program: str) -> Mapping[str, str]:
        """Environment variables the help command of ``program`` needs, added to the caller's.

        The default adds none.
        """
        return {}

    def help_warnings(self, program: str, text: str) -> list[str]:
        """Signs, known to this engine, that ``text`` is not the full help of ``program``.

        engine-check also applies its own checks (the help must define
        ``--help``; an argparse usage line must not name flags no option line
        defines); add here what only your engine knows, such as a section
        its full help always ends with. The default finds none.

        :returns: one sentence per problem, without the program's name
            (engine-check puts it in front); flags reported missing from a
            help with warnings are marked as possibly caused by them.
        """
        return []

    def flag_features(self) -> Mapping[str, str]:
        """Flag -> the llmgw feature that makes :meth:`build_command` emit it.

        engine-check prints it next to each flag (``--nnodes``: "multi-node
        rendezvous"), so an operator knows what a missing flag breaks. The
        default labels none.
        """
        return {}

    def __repr__(self) -> str:
        return f"<Engine {self.name}>"


# An option's own definition line: indented, then one or more comma-separated
# spellings (each optionally followed by a metavar) before the description.
_DEFINITION = re.compile(r"^\s{1,8}(-[^\s].*?)(?:\s{2,}|$)")
_SPELLING = re.compile(r"^(--?[A-Za-z0-9][A-Za-z0-9_.\-]*)")


def parse_argparse_flags(text: str) -> frozenset[str]:
    """Flags documented by argparse-style help text.

    Only an option's own definition line counts: a flag mentioned inside
    another flag's description is not documented by it. ``--x/--no-x`` and
    ``-a, --alpha`` give every spelling.

    :returns: the set of spellings, e.g. ``{"--port", "-p", "--no-x"}``.
    """
    flags: set[str] = set()
    for line in text.splitlines():
        match = _DEFINITION.match(line)
        if not match:
            continue
        for part in re.split(r",\s*|/(?=-)", match.group(1)):
            spelling = _SPELLING.match(part.strip())
            if spelling:
                flags.add(spelling.group(1).rstrip(".,"))
    return frozenset(flags)
