"""``llmgw-sim``'s entry point: ``--version`` answered before the engine itself is imported.

Every agent runs ``llmgw-sim --version`` when it starts (:class:`llmgw.engine.HelpAndVersion`). Answered
here, the call imports this package alone, not trio, the HTTP server and the engine: about half its CPU
(0.1 s of 0.2 s) on every agent start. Anything else, ``--help`` included, is
:func:`llmgw_engine_sim.process.main`.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from llmgw_engine_sim import __version__

__all__ = ["main"]


def main(argv: list[str] | None = None) -> NoReturn:
    """Run ``llmgw-sim`` with ``argv`` (default: the command line) and exit with its code."""
    args = sys.argv[1:] if argv is None else argv
    if list(args) == ["--version"]:
        print(f"llmgw-sim {__version__}")  # as the parser's --version prints it
        sys.exit(0)
    from llmgw_engine_sim.process import main as run

    run(argv)
