"""The conformance suite's truncation check holds for a short, correct help, wherever it prints --help."""

from __future__ import annotations

import pytest

from llmgw.engine import Engine
from llmgw.models import Command, LaunchSpec
from llmgw.testing.contract import EngineContract


class ShortEngine(Engine):
    """One program, four flags: a small engine whose real help is a dozen lines."""

    name = "short"
    checked_versions = ("1.0",)
    programs = ("short-server",)

    def build_command(self, spec: LaunchSpec) -> Command:
        """``short-server --model M --host H --port P``."""
        argv = [self.program_path(spec, "short-server"), "--model", spec.model_source]
        return Command(argv=(*argv, "--host", spec.host, "--port", str(spec.port)))


OPTIONS = """\
  --model MODEL, -m MODEL       Path or name of the model to serve.
  --served-model-name NAME      The model name clients send.
  --host HOST                   Address to serve HTTP on.
  --port PORT                   Port to serve HTTP on.
  --threads N                   Worker threads.
  --log-level LEVEL             How much to log.
"""
HELP_LINE = "  -h, --help                    show this help message and exit\n"
USAGE = "usage: short-server [-h] --model MODEL [--host HOST] [--port PORT]\n\nA short server.\n\noptions:\n"

#: 13 lines each: argparse's order (--help first), and --help last as click and many programs print it
HELP_FIRST = USAGE + HELP_LINE + OPTIONS + "  --version                     print the version\n"
HELP_LAST = USAGE + OPTIONS + "  --version                     print the version\n" + HELP_LINE


@pytest.mark.parametrize("text", [HELP_FIRST, HELP_LAST], ids=["help-first", "help-last"])
def test_a_correct_short_help_passes_the_truncation_check(text):
    """A correct 13-line help passes, whether --help comes first or last."""
    assert len(text.splitlines()) == 13
    contract, engine = EngineContract(), ShortEngine()
    contract.test_engine_check_passes(engine, {"short-server": text})
    contract.test_engine_check_warns_on_half_a_help(engine, {"short-server": text})


def test_a_parse_help_that_reads_descriptions_fails_saying_so():
    """A parse_help that takes --help from a description fails the check, naming what it found there."""

    class LooseEngine(ShortEngine):
        def parse_help(self, text: str) -> frozenset[str]:
            return super().parse_help(text) | ({"--help"} if "--help" in text else frozenset())

    usage = "usage: short-server [options]\n\nRun short-server --help to see every option.\n\noptions:\n"
    text = usage + OPTIONS + HELP_LINE
    with pytest.raises(AssertionError) as failed:
        EngineContract().test_engine_check_warns_on_half_a_help(LooseEngine(), {"short-server": text})
    assert "the first half of its help (no line of it defines --help) drew no truncation warning" in str(
        failed.value
    )
    assert "it must find --help only on --help's own option line" in str(failed.value)
