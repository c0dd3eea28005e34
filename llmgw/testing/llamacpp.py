"""The llama.cpp of end-to-end tests: the build of ``scripts/build-llamacpp``, agents with it, a tiny catalog.

The binaries come from ``$LLMGW_LLAMACPP_BIN``, else from the script's default cache folder. A test module
without them is skipped, unless ``$LLMGW_REQUIRE_LLAMACPP`` is set (CI builds llama.cpp first and sets it),
where a missing build is an error::

    pytestmark = [pytest.mark.timeout(300), built_or_skip()]
    cluster = LlamaCppCluster(tmp_path / "cluster", server_port=free_port())
    cluster.apply(tiny_catalog(write_tiny_gguf(tmp_path / "tiny.gguf"), nodes=2))  # llmgw.testing.gguf
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import catalog_yaml, model

__all__ = ["LLAMA_CPP_PYTHON_VERSION", "SERVER", "WORKER", "LlamaCppCluster", "built_or_skip", "tiny_catalog"]

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


def tiny_catalog(
    source: Path | str, nodes: int = 1, adapters: Mapping[str, str] | None = None, **profile: object
) -> str:
    """The catalog of one replica of ``tiny`` (the GGUF file at ``source``) on llama.cpp, called by the tests
    that apply it.

    :param nodes: nodes of the replica, on CPUs (rank 0 runs llama-server, the others its RPC worker).
    :param adapters: the model's LoRA adapters, name -> source, in the order llama-server gets them.
    :param profile: any other field of the ``cpu`` profile (``max_adapters=2``).
    :returns: its YAML; llama-server gets a context of 512 tokens and two slots.
    """
    fields = {"adapters": dict(adapters)} if adapters else {}
    cpu = {"engine": "llamacpp", "nodes": nodes, "gpus_per_node": 0, "args": ["-c", "512", "-np", "2"]}
    return catalog_yaml({"tiny": model(str(source), "cpu", **fields)}, cpu=cpu | profile)
