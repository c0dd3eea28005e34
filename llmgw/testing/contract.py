"""The engine conformance suite every engine distribution runs.

Subclass :class:`EngineContract` in your distribution's ``tests/``, set
``distribution`` to your distribution's name, ``engine_class`` to your
Engine and ``help_files`` to where each program's real ``--help`` output is
kept (or override the ``engine`` and ``help_texts`` fixtures). The inherited tests check what llmgw
relies on, your ``__version__`` and your entry point included; each failure
message says how to fix it::

    from llmgw.testing.contract import EngineContract

    class TestMyEngine(EngineContract):
        distribution = "llmgw-engine-my"
        engine_class = MyEngine
        help_files = {"my-server": "my-server-{version}.txt"}

with a ``version`` fixture whose params are ``MyEngine.checked_versions``
(``version = version_fixture(MyEngine)``, from :mod:`llmgw.testing.engine_checks`, which also has what
engines' own tests share beside this suite).

The ``engine_help_dir`` fixture (from :mod:`llmgw.testing.pytest_plugin`,
loaded by pytest wherever llmgw is installed) is the folder of real help texts
the engines in the llmgw repository keep beside it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import attrs
import pytest

from llmgw.engine import (
    Engine,
    HelpAndVersion,
    HttpCall,
    LivenessProbe,
    ProgressMetrics,
    help_and_version_of,
    old_api_uses,
)
from llmgw.enginecheck import check_engine, command_program, option_flags, widest_commands
from llmgw.models import Command, LaunchSpec
from llmgw.plugins import get_plugin_manager

__all__ = ["EngineContract", "flags_of", "flag_value", "command_program", "read_help_files"]

_NUMBER = re.compile(r"^-\d+(\.\d+)?$")


def flags_of(command: Command) -> list[str]:
    """The flags (``--x`` or ``-x``, without ``=value``) in a command's argv, in order."""
    return [
        arg.split("=", 1)[0] for arg in command.argv[1:] if arg.startswith("-") and not _NUMBER.match(arg)
    ]


def flag_value(argv: tuple[str, ...] | list[str], flag: str) -> str:
    """The argument after ``flag`` in ``argv`` (``--port 8000`` -> ``"8000"``); an engine's tests call it on a
    built command to check one flag's value.

    :raises ValueError: ``flag`` is not in ``argv``.
    """
    return argv[argv.index(flag) + 1]


def read_help_files(folder: str | os.PathLike, help_files: Mapping[str, str], version: str) -> dict[str, str]:
    """Program name -> its real ``--help`` output, read from ``folder``; called by the ``help_texts`` fixture
    and by an engine's own tests for one checked ``version``.

    :param help_files: program name -> file name, ``{version}`` standing for ``version``
        (:attr:`EngineContract.help_files`)
    """
    return {
        program: (Path(folder) / name.format(version=version)).read_text()
        for program, name in help_files.items()
    }


class EngineContract:
    """Tests every engine distribution inherits.

    Set ``distribution``, ``engine_class`` and ``help_files`` (or override the ``engine`` and
    ``help_texts`` fixtures).
    """

    #: the name of the distribution that registers the engine (``llmgw-engine-foo``)
    distribution: str | None = None
    #: the engine's class: the ``engine`` fixture makes one
    engine_class: type[Engine] | None = None
    #: program name -> the file of its real ``--help`` output, ``{version}`` standing for the ``version``
    #: fixture's value (one of the engine's checked versions): the ``help_texts`` fixture reads them
    help_files: Mapping[str, str] = {}
    #: the folder of :attr:`help_files` (None: the ``engine_help_dir`` fixture's)
    help_dir: Path | None = None

    @pytest.fixture
    def engine(self) -> Engine:
        """An instance of :attr:`engine_class`; override this fixture to build it another way."""
        if self.engine_class is None:
            raise NotImplementedError("set `engine_class = YourEngine` or override the `engine` fixture")
        return self.engine_class()

    @pytest.fixture
    def help_texts(self, request: pytest.FixtureRequest, version: str) -> dict[str, str]:
        """Program name -> its real ``--help`` output, read from :attr:`help_files` for the module's
        ``version`` fixture (parametrized by the checked versions); override this fixture to get them
        another way."""
        if not self.help_files:
            raise NotImplementedError(
                "set `help_files = {program: 'file-{version}.txt'}` or override the `help_texts` fixture"
            )
        folder = self.help_dir or request.getfixturevalue("engine_help_dir")
        return read_help_files(folder, self.help_files, version)

    @pytest.fixture
    def widest(self, engine: Engine) -> LaunchSpec:
        """The engine's widest spec, with a configured path for every program."""
        executables = {p: f"/opt/engines/{p}/bin/{p}" for p in engine.programs}
        return attrs.evolve(engine.widest_spec(), executables=executables)

    def ranks(self, spec: LaunchSpec) -> list[LaunchSpec]:
        """The spec of every rank of ``spec``'s replica."""
        return [attrs.evolve(spec, rank=rank) for rank in range(spec.nnodes)]

    def test_declares_identity(self, engine: Engine) -> None:
        """The engine has a name, the versions it was checked against, and its programs."""
        assert re.match(r"^[a-z0-9][a-z0-9_-]*$", engine.name), (
            f"Engine.name {engine.name!r}: use lowercase letters, digits, '-' and '_'"
        )
        assert engine.checked_versions, (
            "set Engine.checked_versions to the engine versions your commands were checked against"
        )
        assert engine.programs, "set Engine.programs to the program names your commands run"

    def test_version(self, engine: Engine) -> None:
        """The engine's package has a ``__version__``, the installed distribution's version."""
        assert self.distribution, (
            f"set `distribution = 'llmgw-engine-{engine.name}'` (your distribution's name) "
            f"on {type(self).__name__}"
        )
        package = importlib.import_module(type(engine).__module__.split(".")[0])
        assert getattr(package, "__version__", None) == metadata.version(self.distribution), (
            f"{package.__name__}.__version__ must be the installed version of {self.distribution}: "
            f'__version__ = llmgw.version.distribution_version("{self.distribution}")'
        )

    def test_registered_through_the_entry_point(self, engine: Engine) -> None:
        """The installed distribution's ``llmgw`` entry point registers this engine under its name."""
        assert self.distribution, f"set `distribution` on {type(self).__name__}"
        engines = get_plugin_manager().engines()
        assert engine.name in engines, (
            f"no installed plugin registers engine {engine.name!r}: add "
            f'[project.entry-points.llmgw] {engine.name} = "{type(engine).__module__}" to pyproject.toml '
            "and reinstall"
        )
        record = engines[engine.name]
        assert record.distribution == self.distribution, (
            f"engine {engine.name!r} is registered by {record.distribution}, not {self.distribution}"
        )
        assert type(record.engine) is type(engine)

    def test_uses_the_current_engine_api(self, engine: Engine) -> None:
        """No method of llmgw 0.1's Engine API that is a fact now (the plugin manager refuses those)."""
        assert not old_api_uses(engine), "; ".join(old_api_uses(engine))

    def test_health_path(self, engine: Engine) -> None:
        """The health path is an absolute HTTP path."""
        assert engine.health_path.startswith("/"), (
            f"Engine.health_path {engine.health_path!r} must start with '/'"
        )

    def test_help_documents_help(self, engine: Engine, help_texts: dict[str, str]) -> None:
        """Each program's help parses and documents --help itself (so it is not cut short)."""
        assert set(help_texts) == set(engine.programs), (
            f"help_texts must give one help per program: {engine.programs}, got {sorted(help_texts)}"
        )
        for program, text in help_texts.items():
            flags = engine.parse_help(text)
            assert "--help" in flags, (
                f"{program}: parse_help found no --help in the help text; either the text is "
                "truncated or parse_help misses option definition lines"
            )

    def test_single_node_command(self, engine: Engine, widest: LaunchSpec) -> None:
        """A one-node spec builds a command that binds the spec's port and joins nobody."""
        spec = attrs.evolve(widest, nnodes=1, rank=0, dist_init_addr=None, peer_addrs=())
        command = engine.build_command(spec)
        assert str(spec.port) in command.argv, "rank 0 must be told the port it serves on"
        assert not any(widest.dist_init_addr in arg for arg in command.argv if widest.dist_init_addr), (
            "a single-node command must not carry a dist-init address"
        )
        command_program(engine, spec, command)

    def test_every_rank_builds(self, engine: Engine, widest: LaunchSpec) -> None:
        """Every rank of the widest spec builds, deterministically, with string env values."""
        for spec in self.ranks(widest):
            command = engine.build_command(spec)
            assert command == engine.build_command(spec), "build_command must be deterministic"
            assert all(isinstance(v, str) for v in command.env.values()), "env values must be strings"
            command_program(engine, spec, command)

    def test_gpus_and_exact_adapter_names(self, engine: Engine, widest: LaunchSpec) -> None:
        """Every rank gets its GPUs in CUDA_VISIBLE_DEVICES and the fabric's adapters in NCCL_IB_HCA by exact
        name (``=mlx5_1,mlx5_10``: a bare ``mlx5_1`` would also select ``mlx5_10``)."""
        for spec in self.ranks(attrs.evolve(widest, gpus=(4, 5, 6, 7), adapters=("mlx5_1", "mlx5_10"))):
            env = engine.build_command(spec).env
            got = (env.get("CUDA_VISIBLE_DEVICES"), env.get("NCCL_IB_HCA"))
            assert got == ("4,5,6,7", "=mlx5_1,mlx5_10"), (
                f"rank {spec.rank}: CUDA_VISIBLE_DEVICES and NCCL_IB_HCA are {got}; start the command's env "
                "from self.device_env(spec), which sets both"
            )

    def test_rank_zero_differs_from_workers(self, engine: Engine, widest: LaunchSpec) -> None:
        """In a multi-node spec, rank 0 and the workers get different commands."""
        if not engine.multi_node:
            pytest.skip("single-node engine")
        assert widest.nnodes > 1, "a multi-node engine's widest_spec() must span several nodes"
        commands = [engine.build_command(spec) for spec in self.ranks(widest)]
        assert commands[0] != commands[1], "rank 0 and rank 1 got the same command"

    def test_widest_flags_are_documented(
        self, engine: Engine, widest: LaunchSpec, help_texts: dict[str, str]
    ) -> None:
        """Every flag of the widest command, on every rank, is in that program's real help."""
        documented = {p: engine.parse_help(t) for p, t in help_texts.items()}
        missing = []
        for spec in self.ranks(widest):
            command = engine.build_command(spec)
            program = command_program(engine, spec, command)
            for flag in flags_of(Command(argv=(command.argv[0], *engine.option_args(command)))):
                if flag not in documented.get(program, frozenset()):
                    missing.append(f"rank {spec.rank} ({program}): {flag}")
        assert not missing, (
            "flags llmgw would pass that the engine's help does not document: "
            + ", ".join(missing)
            + "; use a spelling the help documents, or fix parse_help"
        )

    def test_program_paths_are_honoured(self, engine: Engine, widest: LaunchSpec) -> None:
        """Configured program paths from the agent reach argv[0]."""
        for spec in self.ranks(widest):
            argv0 = engine.build_command(spec).argv[0]
            assert os.path.isabs(argv0) and argv0.startswith("/opt/engines/"), (
                f"rank {spec.rank}: argv[0] {argv0!r} ignores spec.executables; "
                "use engine.program_path(spec, PROGRAM)"
            )

    # -- engine-check (llmgw.enginecheck) ------------------------------------
    # What ``llmgw ctl engine-check`` and the agent see: the flags are read with
    # Engine.option_args, the help with Engine.parse_help.

    @staticmethod
    def definition_lines(engine: Engine, text: str, flag: str) -> list[int]:
        """Indices of the lines of ``text`` that define ``flag``, by the engine's own parser."""
        return [i for i, line in enumerate(text.splitlines()) if flag in engine.parse_help(line)]

    def without_flag(self, engine: Engine, text: str, flag: str) -> str:
        """``text`` with the option lines that define ``flag`` deleted."""
        drop = set(self.definition_lines(engine, text, flag))
        assert drop, f"{flag} has no definition line of its own in the help; check parse_help"
        return "".join(line for i, line in enumerate(text.splitlines(keepends=True)) if i not in drop)

    def with_flag_renamed(self, engine: Engine, text: str, flag: str, new: str) -> str:
        """``text`` with ``flag`` spelt ``new`` on the option lines that define it."""
        spelling = re.compile(rf"(?<![\w-]){re.escape(flag)}(?![\w-])")
        lines = text.splitlines(keepends=True)
        for i in self.definition_lines(engine, text, flag):
            lines[i] = spelling.sub(new, lines[i], count=1)
        return "".join(lines)

    def checked_flags(self, engine: Engine) -> list[tuple[str, str]]:
        """``(program, flag)`` for every flag of the widest command, each once."""
        pairs: list[tuple[str, str]] = []
        for _, program, command in widest_commands(engine):
            pairs += [
                (program, f) for f in option_flags(engine.option_args(command)) if (program, f) not in pairs
            ]
        return pairs

    def test_engine_check_passes(self, engine: Engine, help_texts: dict[str, str]) -> None:
        """engine-check accepts every flag of the widest command against the real help, without warnings."""
        report = check_engine(engine, help_texts)
        assert report.ok, (
            "engine-check rejects the real help: "
            + "; ".join(f.describe() for f in report.missing)
            + "; use spellings every checked version documents, or fix parse_help or option_args"
        )
        assert not report.warnings, (
            f"engine-check thinks the real help is incomplete: {report.warnings}; "
            "fix parse_help (it must find --help) or help_warnings"
        )

    def test_engine_check_names_a_removed_flag(self, engine: Engine, help_texts: dict[str, str]) -> None:
        """A help whose definition of one flag is deleted fails engine-check, naming that flag."""
        for program, flag in self.checked_flags(engine):
            texts = {**help_texts, program: self.without_flag(engine, help_texts[program], flag)}
            missing = {(f.program, f.flag) for f in check_engine(engine, texts).missing}
            assert (program, flag) in missing, (
                f"{program}: with {flag}'s option line deleted, engine-check did not report it missing; "
                "parse_help must read option definition lines only, not mentions in descriptions"
            )

    def test_engine_check_names_a_flag_renamed_longer(
        self, engine: Engine, help_texts: dict[str, str]
    ) -> None:
        """A flag renamed to a longer name containing it (--port -> --port-range) fails engine-check."""
        for program, flag in self.checked_flags(engine):
            renamed = self.with_flag_renamed(engine, help_texts[program], flag, flag + "-range")
            missing = {
                (f.program, f.flag) for f in check_engine(engine, {**help_texts, program: renamed}).missing
            }
            assert (program, flag) in missing, (
                f"{program}: {flag} renamed {flag}-range still counts as documented; compare whole "
                "spellings (set membership), not substrings"
            )

    @classmethod
    def cut_short(cls, engine: Engine, text: str) -> tuple[str, str]:
        """``(which part, text)``: half of a help, the half without the line that defines ``--help``.

        A help cut at its end keeps its first half, one that lost its beginning its second half; the half
        taken is the one a truncation would leave without ``--help``, wherever the program prints it
        (argparse near the top, click and others last). With ``--help`` defined in both halves, the
        part after its last definition. Only lines that start with an option count as defining it.
        """
        lines = text.splitlines(keepends=True)
        middle = len(lines) // 2
        # --help's own option line starts with an option; a parse_help that also finds --help in a usage
        # line or a description must not pick the half, or the check could not catch it
        helps = [i for i in cls.definition_lines(engine, text, "--help") if lines[i].lstrip().startswith("-")]
        if all(i < middle for i in helps):
            return "the second half", "".join(lines[middle:])
        if all(i >= middle for i in helps):
            return "the first half", "".join(lines[:middle])
        return "the part after its last --help line", "".join(lines[max(helps) + 1 :])

    def test_engine_check_warns_on_half_a_help(self, engine: Engine, help_texts: dict[str, str]) -> None:
        """Half a help (the half without its --help line) draws a truncation warning; flags missing from it
        are marked so."""
        for program, text in help_texts.items():
            part, half = self.cut_short(engine, text)
            report = check_engine(engine, {**help_texts, program: half})
            assert any(w.startswith(f"{program}:") for w in report.warnings), (
                f"{program}: {part} of its help (no line of it defines --help) drew no truncation warning, "
                f"so a help cut short would pass engine-check. parse_help found these flags in it: "
                f"{sorted(engine.parse_help(half))}; it must find --help only on --help's own option line "
                "(not in a usage line or a description), or help_warnings must say the text is incomplete"
            )
            assert all(f.possibly_truncated for f in report.missing if f.program == program)

    def test_help_command(self, engine: Engine) -> None:
        """Each program names the arguments and environment that make it print its full help and version."""
        assert set(engine.help_and_version) <= set(engine.programs), (
            "help_and_version names programs the engine does not run: "
            f"{sorted(set(engine.help_and_version) - set(engine.programs))}; "
            f"Engine.programs is {engine.programs}"
        )
        for program in engine.programs:
            asked = help_and_version_of(engine, program)
            assert isinstance(asked, HelpAndVersion), (
                f"help_and_version[{program!r}] must be a llmgw.engine.HelpAndVersion"
            )
            for field in ("help_args", "version_args"):
                args = getattr(asked, field)
                assert args and all(isinstance(a, str) for a in args), (
                    f"help_and_version[{program!r}].{field} must be a non-empty tuple of strings"
                )
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in asked.help_env.items()), (
                f"help_and_version[{program!r}].help_env must map strings to strings"
            )

    def test_liveness_probe(self, engine: Engine) -> None:
        """The liveness probe, if any, is a LivenessProbe on an absolute path with positive times."""
        probe = engine.liveness_probe
        if probe is None:
            return
        assert isinstance(probe, LivenessProbe), "Engine.liveness_probe must be a LivenessProbe or None"
        assert probe.path.startswith("/"), f"liveness_probe.path {probe.path!r} must start with '/'"
        assert probe.timeout > 0 and probe.interval > 0, "liveness_probe timeout and interval must be > 0"
        if probe.model_field is not None:
            assert isinstance(probe.request_body("example"), Mapping), (
                "a liveness_probe with model_field sends a JSON object: its body must be a mapping or None"
            )
        if probe.progress is not None:
            assert isinstance(probe.progress, ProgressMetrics), "liveness_probe.progress: a ProgressMetrics"
            assert probe.progress.path.startswith("/"), "liveness_probe.progress.path must start with '/'"
            assert probe.progress.tokens, "liveness_probe.progress.tokens must name at least one counter"

    def test_flag_features_name_emitted_flags(self, engine: Engine) -> None:
        """Every flag flag_features labels is one the widest command emits (no stale labels)."""
        emitted = {flag for _, flag in self.checked_flags(engine)}
        stale = sorted(set(engine.flag_features) - emitted)
        assert not stale, f"flag_features labels flags the widest command never emits: {stale}"

    # -- LoRA adapters (spec.lora, Engine.lora_*) -------------------------------

    def test_lora_in_widest_spec(self, engine: Engine) -> None:
        """An engine serving LoRA adapters has them in its widest spec, so engine-check checks their flags."""
        if not engine.serves_lora:
            pytest.skip("the engine serves no LoRA adapters")
        lora = engine.widest_spec().lora
        assert lora is not None, (
            "serves_lora is True but widest_spec().lora is None: engine-check would never see the LoRA "
            "flags; set lora=LoraSpec(...) in widest_spec()"
        )
        if engine.lora_at_start:
            assert lora.at_start, "lora_at_start engines get every adapter in spec.lora.at_start: list some"

    def test_lora_flags_only_with_adapters(self, engine: Engine, widest: LaunchSpec) -> None:
        """A spec without adapters gets none of the LoRA flags, and flag_features names each LoRA flag."""
        if not engine.serves_lora:
            pytest.skip("the engine serves no LoRA adapters")
        plain = attrs.evolve(widest, lora=None)
        with_lora: set[str] = set()
        without: set[str] = set()
        for spec in self.ranks(widest):
            with_lora |= set(flags_of(engine.build_command(spec)))
        for spec in self.ranks(plain):
            without |= set(flags_of(engine.build_command(spec)))
        lora_flags = with_lora - without
        unnamed = sorted(flag for flag in lora_flags if flag not in engine.flag_features)
        assert not unnamed, (
            f"flags emitted only for spec.lora have no flag_features entry: {unnamed}; name the LoRA "
            "feature each serves, so engine-check tells an operator what a missing one breaks"
        )

    def test_no_lora_without_adapters(self, engine: Engine, widest: LaunchSpec) -> None:
        """A spec without adapters starts every rank with no argument or environment variable naming LoRA."""
        if not engine.serves_lora:
            pytest.skip("the engine serves no LoRA adapters")
        for spec in self.ranks(attrs.evolve(widest, lora=None)):
            command = engine.build_command(spec)
            named = [arg for arg in command.argv if "lora" in arg.lower()]
            named += [name for name in command.env if "lora" in name.lower()]
            assert not named, (
                f"rank {spec.rank}: {named} with spec.lora None; emit LoRA flags and variables only when "
                "spec.lora is set (a model without adapters must start as it did before adapters)"
            )

    def test_lora_calls(self, engine: Engine) -> None:
        """The load and unload calls are HttpCalls (absolute path, JSON body, positive timeout) or None, and
        the request fields are JSON objects."""
        if not engine.serves_lora:
            pytest.skip("the engine serves no LoRA adapters")
        for call in (engine.lora_load("sql", "/adapters/sql"), engine.lora_unload("sql")):
            if call is None:
                continue
            assert isinstance(call, HttpCall), "lora_load/lora_unload must return an HttpCall or None"
            assert call.path.startswith("/"), f"HttpCall.path {call.path!r} must start with '/'"
            assert call.timeout > 0, "HttpCall.timeout must be > 0"
            json.dumps(call.body)
        known = ["sql", "chat"]
        for fields in (
            engine.lora_request_fields("sql", "base", known),
            engine.lora_base_request_fields("base", known),
        ):
            assert isinstance(fields, Mapping), "request fields must be a mapping of body keys"
            json.dumps(dict(fields))
        assert engine.lora_request_fields("sql", "base", known) != engine.lora_request_fields(
            "chat", "base", known
        ), "two adapters get the same request fields: the gateway could not tell them apart"
