"""LoRA adapter directories for tests: what a PEFT fine-tune leaves on disk, small.

:func:`make_sim_adapter` writes ``adapter_config.json`` (PEFT's keys: ``peft_type: "LORA"``, ``r``,
``lora_alpha``, ``target_modules``, ``base_model_name_or_path``) and ``adapter_model.safetensors`` (a valid
safetensors file holding one ``lora_A``/``lora_B`` pair of zeros, of the given rank), which is what
``llmgw-sim --enable-lora`` reads on ``POST /v1/load_lora_adapter``. The same arguments write the same bytes.
Options make the broken adapters a load must refuse (no weights, a config that is not JSON).

:func:`write_tiny_gguf_lora` writes what llama.cpp takes instead: a GGUF LoRA adapter file for the tiny
model of :mod:`llmgw.testing.gguf` (needs the ``gguf`` test dependency).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["make_sim_adapter", "safetensors_bytes", "write_tiny_gguf_lora"]

#: the hidden size of the adapter's tensors (tiny: the sim does not compute with them)
HIDDEN = 8


def safetensors_bytes(tensors: dict[str, tuple[int, ...]]) -> bytes:
    """A safetensors file holding float32 tensors of zeros with the given shapes, by name (sorted).

    The format: an 8-byte little-endian header length, the JSON header (each tensor's ``dtype``, ``shape``
    and ``data_offsets``), padded with spaces to a multiple of 8, then the data.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        shape = tensors[name]
        size = 4
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + bytes(offset)


def make_sim_adapter(
    path: str | Path,
    *,
    rank: int = 8,
    base: str = "test/model",
    peft_type: str = "LORA",
    weights: bool = True,
    config: str | None = None,
) -> Path:
    """Write a LoRA adapter directory at ``path`` (made if missing) and return it.

    Called by tests that load adapters into ``llmgw-sim`` (or hand them to the agent as an adapter's
    files).

    :param rank: the adapter's ``r`` (a sim started with a lower ``--max-lora-rank`` refuses it).
    :param base: ``base_model_name_or_path``, the model it was trained on.
    :param peft_type: PEFT's adapter type; anything but ``LORA`` is refused by a load.
    :param weights: False leaves out ``adapter_model.safetensors`` (a load fails after its load time).
    :param config: the exact text of ``adapter_config.json`` instead of a valid one (to break it).
    :returns: the directory.
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    if config is None:
        config = json.dumps(
            {
                "peft_type": peft_type,
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": ["q_proj", "v_proj"],
                "base_model_name_or_path": base,
            },
            indent=2,
        )
    (folder / "adapter_config.json").write_text(config)
    prefix = "base_model.model.model.layers.0.self_attn"
    tensors = {}
    for module in ("q_proj", "v_proj"):
        tensors[f"{prefix}.{module}.lora_A.weight"] = (rank, HIDDEN)
        tensors[f"{prefix}.{module}.lora_B.weight"] = (HIDDEN, rank)
    target = folder / "adapter_model.safetensors"
    if weights:
        target.write_bytes(safetensors_bytes(tensors))
    else:
        target.unlink(missing_ok=True)
    return folder


def write_tiny_gguf_lora(
    path: str | Path, *, seed: int = 1, rank: int = 4, layers: int = 2, std: float = 0.5
) -> Path:
    """Write a GGUF LoRA adapter for :func:`llmgw.testing.gguf.write_tiny_gguf`'s model and return its path.

    Called by tests that run a real ``llama-server --lora FILE``: llama.cpp takes adapters as GGUF files
    (``general.type: adapter``, ``adapter.type: lora``, ``adapter.lora.alpha``, and ``<tensor>.lora_a`` /
    ``.lora_b`` pairs, here for ``attn_q`` and ``attn_v`` of every block), as ``convert_lora_to_gguf.py``
    writes them. Random weights of ``std`` change the model's text visibly; the same arguments write the
    same bytes.

    :param layers: the model's blocks (``write_tiny_gguf``'s ``layers``).
    """
    import gguf  # a test dependency, as for llmgw.testing.gguf
    import numpy as np

    from llmgw.testing.gguf import TinyModel

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    width = TinyModel.embedding_length
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string(gguf.Keys.General.TYPE, "adapter")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
    for block in range(layers):
        for name in ("attn_q", "attn_v"):
            # numpy shape (rows, cols) is ggml ne {cols, rows}: A is ne {n_in, r}, B is ne {r, n_out}
            a = (rng.standard_normal((rank, width)) * std).astype(np.float32)
            b = (rng.standard_normal((width, rank)) * std).astype(np.float32)
            writer.add_tensor(f"blk.{block}.{name}.weight.lora_a", a)
            writer.add_tensor(f"blk.{block}.{name}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
