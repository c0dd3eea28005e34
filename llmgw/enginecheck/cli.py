"""``llmgw ctl engine-check``: would this engine's installed program take llmgw's flags?

Registered under ``llmgw ctl`` by :mod:`llmgw.cli`. The check itself is
:mod:`llmgw.enginecheck`, which the agent runs at start too.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import click
from tabulate import tabulate

from llmgw.cli import Command
from llmgw.engine import Engine
from llmgw.enginecheck import ACCEPTED, MISSING, CheckReport, check_engine, collect_help
from llmgw.plugins import EngineRecord, get_plugin_manager

__all__ = ["engine_check", "render_report"]


@click.command("engine-check", cls=Command)
@click.argument("engine_name", metavar="ENGINE")
@click.option(
    "--help-output",
    "help_outputs",
    multiple=True,
    metavar="[PROGRAM=]TEXT",
    help="The help text itself, as the program printed it.",
)
@click.option(
    "--help-file",
    "help_files",
    multiple=True,
    metavar="[PROGRAM=]FILE",
    help="A file holding what the program printed for its help ('-': standard input).",
)
@click.option(
    "--binary",
    "binaries",
    multiple=True,
    metavar="[PROGRAM=]PATH",
    help="Run PATH with the engine's help arguments (vLLM: serve --help=all) and check what it prints.",
)
@click.option(
    "--extra-args",
    metavar="ARGS",
    help="A profile's args to check too, as one shell-quoted string ('--max-model-len 32768').",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=120.0,
    show_default=True,
    help="Seconds a --binary help command may take.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def engine_check(
    engine_name: str,
    help_outputs: tuple[str, ...],
    help_files: tuple[str, ...],
    binaries: tuple[str, ...],
    extra_args: str | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Check every flag llmgw would pass ENGINE against the engine's real help.

    llmgw builds the widest command it would ever run for ENGINE (every rank of
    a multi-node replica) and looks each flag up among the options the help
    defines, by whole spelling: --port is not satisfied by --port-range, nor by
    a mention in another option's description. Each flag is printed as
    accepted or missing with the llmgw feature that uses it.

    Give one help per program the engine runs: llama.cpp runs llama-server and
    rpc-server, so --help-file llama-server=FILE --help-file rpc-server=FILE.

    Exits 1 when a flag is missing or a help could not be read, 2 on a usage
    error. A help that looks cut short, or is not the full help, draws a
    warning, and flags missing from it are marked as possibly caused by that.
    """
    record = _engine_record(engine_name)
    engine = record.engine
    texts, sources, paths = _gather(engine, help_outputs, help_files, binaries)
    collected = collect_help(engine, paths, timeout=timeout)
    report = check_engine(
        engine,
        {**texts, **collected.texts},
        failures=collected.failures,
        sources={**sources, **collected.sources},
        notes=collected.notes,
        extra_args=shlex.split(extra_args) if extra_args is not None else None,
    )
    if as_json:
        payload = {"distribution": record.distribution, "version": record.version, **report.to_json()}
        click.echo(json.dumps(payload, indent=2))
    else:
        click.echo(render_report(report, record))
    sys.exit(0 if report.ok else 1)


def _engine_record(name: str) -> EngineRecord:
    plugins = get_plugin_manager()
    plugins.engine(name)  # raises UnknownEngineError naming the engines there are
    return plugins.engines()[name]


def _gather(
    engine: Engine, outputs: Sequence[str], files: Sequence[str], binaries: Sequence[str]
) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Help texts and their sources from --help-output/--help-file, and paths to run from --binary."""
    given: dict[str, tuple[str, str]] = {}
    for option, values in (("--help-output", outputs), ("--help-file", files), ("--binary", binaries)):
        for raw in values:
            program, value = _split_program(engine, option, raw)
            if program in given:
                raise click.UsageError(f"{program}: help given twice ({given[program][0]} and {option})")
            given[program] = (option, value)
    if not given:
        raise click.UsageError(
            "give the help to check: --help-output TEXT, --help-file FILE or --binary PATH"
        )
    lacking = [p for p in engine.programs if p not in given]
    if lacking:
        raise click.UsageError(
            f"engine {engine.name} runs {len(engine.programs)} programs ({', '.join(engine.programs)}): "
            f"give the help of {', '.join(lacking)} too, e.g. --help-file {lacking[0]}=FILE"
        )
    texts: dict[str, str] = {}
    sources: dict[str, str] = {}
    paths: dict[str, str] = {}
    for program, (option, value) in given.items():
        if option == "--help-output":
            texts[program], sources[program] = value, "--help-output"
        elif option == "--help-file":
            texts[program], sources[program] = (
                _read(value),
                "standard input" if value == "-" else f"file {value}",
            )
        else:
            paths[program] = value
    return texts, sources, paths


def _split_program(engine: Engine, option: str, raw: str) -> tuple[str, str]:
    """``PROGRAM=VALUE`` or a bare ``VALUE`` (only for an engine with one program)."""
    prefix, sep, rest = raw.partition("=")
    if sep and prefix in engine.programs:
        return prefix, rest
    if sep and prefix and "/" not in prefix and "\n" not in prefix and option != "--help-output":
        if not Path(raw).exists():
            raise click.UsageError(
                f"{option} {raw}: engine {engine.name} runs no program {prefix!r}; "
                f"its programs are {', '.join(engine.programs)}"
            )
    if len(engine.programs) > 1:
        raise click.UsageError(
            f"engine {engine.name} runs {', '.join(engine.programs)}: say which, as {option} PROGRAM=..."
        )
    return engine.programs[0], raw


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(errors="replace")
    except OSError as exc:
        raise click.UsageError(f"--help-file {path}: {exc.strerror or exc}") from None


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def render_report(report: CheckReport, record: EngineRecord | None = None) -> str:
    """The report as ``ctl engine-check`` prints it: help sources, warnings, one row per flag, a verdict."""
    origin = f"{record.distribution} {record.version}, " if record and record.distribution else ""
    lines = [f"engine {report.engine} ({origin}checked against {', '.join(report.checked_versions)})"]
    for program in report.programs:
        if program.failure is None:
            source = f" from {program.source}" if program.source else ""
            lines.append(f"help of {program.program}{source}: {program.documented} flags documented")
    lines += [f"warning: {w}" for w in report.warnings]
    rows = []
    for flag in report.flags:
        if flag.status not in (ACCEPTED, MISSING):
            continue
        used_for = flag.feature
        if flag.possibly_truncated:
            used_for += " (possibly because the help is truncated)"
        rows.append([flag.status, flag.flag, flag.program, _ranks(flag.ranks), used_for])
    if rows:
        lines += ["", tabulate(rows, headers=["status", "flag", "program", "ranks", "used for"]), ""]
    lines += [f"error: {program.failure}" for program in report.failures]
    results = []
    if report.missing:
        names = ", ".join(f.flag for f in report.missing)
        results.append(f"{len(report.missing)} of {len(report.flags)} flags missing: {names}")
        if report.missing_features:
            results.append(f"without them llmgw cannot use: {'; '.join(report.missing_features)}")
    for program in report.failures:
        unchecked = sum(1 for f in report.flags if f.program == program.program)
        results.append(
            f"the help of {program.program} could not be read, so its {unchecked} flags were not checked"
        )
    if report.ok:
        results.append(f"all {len(report.flags)} flags accepted")
    lines += [f"result: {r}" for r in results]
    return "\n".join(lines)
