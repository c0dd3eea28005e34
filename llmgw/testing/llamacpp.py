"""The llama.cpp build end-to-end tests run: where ``scripts/build-llamacpp`` put it, and agents that have it.

The binaries come from ``$LLMGW_LLAMACPP_BIN``, else from the script's default cache folder. A test module
without them is skipped, unless ``$LLMGW_REQUIRE_LLAMACPP`` is set (CI builds llama.cpp first and sets it),
where a missing build is an error::

    pytestmark = [pytest.mark.timeout(300), built_or_skip()]
    cluster = LlamaCppCluster(tmp_path / "cluster", server_port=free_port())
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster

__all__ = ["LLAMA_CPP_PYTHON_VERSION", "SERVER", "WORKER", "LlamaCppCluster", "built_or_skip"]

#: the llama-cpp-python sdist version scripts/build-llamacpp pins (llama.cpp 0c1e570, b11312)
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
_BIN = Path(
    os.environ.get("LLMGW_LLAMACPP_BIN") or _CACHE / "llmgw" / "llama.cpp" / LLAMA_CPP_PYTHON_VERSION / "bin"
)
#: llama.cpp's server, and its RPC worker (the ranks after 0 of a multi-node replica)
SERVER, WORKER = _BIN / "llama-server", _BIN / "ggml-rpc-server"


def built_or_skip() -> pytest.MarkDecorator:
    """The mark of a test module that runs llama.cpp, called as the module is collected.

    :returns: a skip saying how to build llama.cpp when it is not built (nothing is skipped when it is).
    :raises RuntimeError: llama.cpp is not built and ``$LLMGW_REQUIRE_LLAMACPP`` says it must be.
    """
    built = SERVER.exists() and WORKER.exists()
    not_built = (
        f"llama.cpp is not built: no {SERVER} and {WORKER}; run scripts/build-llamacpp "
        "(or set LLMGW_LLAMACPP_BIN to the folder holding llama-server and ggml-rpc-server)"
    )
    if not built and os.environ.get("LLMGW_REQUIRE_LLAMACPP"):
        # CI builds llama.cpp first and sets this: a missing build there is a failure, not a skip
        raise RuntimeError(f"LLMGW_REQUIRE_LLAMACPP is set but {not_built}")
    return pytest.mark.skipif(not built, reason=not_built)


class LlamaCppCluster(LocalCluster):
    """A LocalCluster whose agents also have llama.cpp installed (llama-server and its RPC worker)."""

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        if name.startswith("agent-"):
            argv = [*argv, "--engine", f"llamacpp:llama-server={SERVER}"]
            argv += ["--engine", f"llamacpp:rpc-server={WORKER}"]
        return super()._start(name, argv)
