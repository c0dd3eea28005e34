"""A real llama-server started with LlamaCppEngine's LoRA arguments answers each adapter as the plugin says.

Needs the llama.cpp build of ``scripts/build-llamacpp`` (0c1e570), as ``tests/e2e/test_e2e_llamacpp.py``;
skips without it, and fails in CI.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import httpx
import pytest
from llmgw_engine_llamacpp import LlamaCppEngine

from llmgw.models import LaunchSpec, LoraSpec
from llmgw.testing.processes import ProcessSet, free_port, processes, wait_until

pytest.importorskip("gguf", reason="the gguf package is a test dependency (pip install gguf)")

from llmgw.testing.gguf import write_tiny_gguf  # noqa: E402 - after the importorskip
from llmgw.testing.lora import write_tiny_gguf_lora  # noqa: E402

__all__ = ["processes"]

#: where scripts/build-llamacpp puts llama.cpp 0c1e570 (llama-cpp-python 0.3.36's)
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
BIN = Path(os.environ.get("LLMGW_LLAMACPP_BIN") or CACHE / "llmgw" / "llama.cpp" / "0.3.36" / "bin")
SERVER = BIN / "llama-server"
BUILT = SERVER.exists()
if not BUILT and os.environ.get("CI"):
    raise RuntimeError(f"llama.cpp is not built ({SERVER}): run scripts/build-llamacpp")

pytestmark = pytest.mark.skipif(not BUILT, reason=f"llama.cpp is not built: no {SERVER}")

PROMPT = "hello world"


def start(processes: ProcessSet, spec: LaunchSpec) -> str:
    """Start the command LlamaCppEngine builds for ``spec`` and wait for /health; returns its URL."""
    command = LlamaCppEngine().build_command(spec)
    process = processes.start(list(command.argv), name="llama-server", extra_env=dict(command.env))
    url = f"http://{spec.host}:{spec.port}"
    wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 60, "llama-server", process)
    return url


def complete(url: str, **fields) -> str:
    """The greedy completion of PROMPT with ``fields`` merged into the body, as the gateway merges them."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_adapters_chosen_per_request(processes, tmp_path):
    """Each adapter's fields give its own text; the base-model fields give the text of no adapter at all."""
    host = "127.0.0.1"
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    adapters = (
        ("sql", str(write_tiny_gguf_lora(tmp_path / "sql.gguf", seed=1))),
        ("chat", str(write_tiny_gguf_lora(tmp_path / "chat.gguf", seed=2))),
    )
    spec = LaunchSpec(
        model_source=str(model),
        served_name="tiny",
        host=host,
        port=free_port(host),
        gpus=(),
        executables={"llama-server": str(SERVER)},
    )
    plain = complete(start(processes, spec))
    with_lora = attrs.evolve(spec, port=free_port(host), lora=LoraSpec(2, at_start=adapters))
    url = start(processes, with_lora)
    engine, known = LlamaCppEngine(), [name for name, _ in adapters]
    assert complete(url, **engine.lora_base_request_fields("tiny", known)) == plain
    sql = complete(url, **engine.lora_request_fields("sql", "tiny", known))
    chat = complete(url, **engine.lora_request_fields("chat", "tiny", known))
    assert len({plain, sql, chat}) == 3, (plain, sql, chat)
    listed = httpx.get(f"{url}/lora-adapters", timeout=5).json()
    assert [(a["id"], a["path"]) for a in listed] == [(0, adapters[0][1]), (1, adapters[1][1])]
