"""A tiny, deterministic, random-weight LLaMA-architecture GGUF model for tests of a real llama.cpp.

:func:`write_tiny_gguf` writes, with the ``gguf`` package (a test dependency),
a model of a few hundred KB that ``llama-server`` loads and serves in
milliseconds on a CPU: a 377-token SentencePiece-style vocabulary (the
specials, the 256 byte tokens, letters, digits and a few word pieces), two
layers of width 64, and a ChatML chat template. Its text is garbage made of
letters and word fragments; tokens coming back is the point.

The output rows of every token that is not a plain text piece (``<unk>``,
``<s>``, ``</s>`` and the byte tokens) are zeroed, so that sampling
practically never emits end-of-sequence or a lone byte: every request runs
to ``max_tokens`` (``finish_reason: "length"``). The same arguments give the
same bytes, so ``temperature: 0`` gives the same text on every run, on one
node or over RPC.

Every metadata key llama.cpp needs to load a llama model is written (checked
against ``src/llama-model.cpp``, ``src/models/llama.cpp`` and
``src/llama-vocab.cpp`` of llama.cpp 0c1e570); :data:`REQUIRED_KEYS` lists
them. Run ``python -m llmgw.testing.gguf OUT.gguf`` to write one by hand.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

__all__ = [
    "CHATML_TEMPLATE",
    "REQUIRED_KEYS",
    "TinyModel",
    "tiny_vocab",
    "write_tiny_gguf",
]

#: ChatML, as Qwen and many others write it
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: the metadata keys llama.cpp needs to load and serve the model (the chat template is optional)
REQUIRED_KEYS = (
    "general.architecture",
    "general.name",
    "general.file_type",
    "llama.vocab_size",
    "llama.context_length",
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.dimension_count",
    "llama.rope.freq_base",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
)

# llama.cpp's token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6
_SPACE = "\u2581"  # SentencePiece's word-start marker
_WORDS = ("the", "hello", "world", "cluster", "node", "test")


class TinyModel:
    """The shape of the tiny model: defaults give the model described in the module docstring."""

    name = "tiny-random-llama"
    context_length = 256
    embedding_length = 64
    feed_forward_length = 128
    head_count = 4
    rms_epsilon = 1e-5
    rope_freq_base = 10000.0
    bos, eos, unk = 1, 2, 0

    @property
    def rope_dimension_count(self) -> int:
        """llama needs n_embd / n_head here, or the load fails with ``invalid n_rot``."""
        return self.embedding_length // self.head_count


def tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    """The vocabulary: (tokens, scores, token types), 377 unique tokens.

    ``<unk>``, ``<s>``, ``</s>``; the bytes ``<0x00>``...``<0xFF>`` (they give
    byte fallback and the newline token); then text pieces, each scored
    ``-(i+1)``: ``▁``, letters, digits, punctuation, ``▁a``...``▁z``, and the
    prefixes of a few words (``▁th``, ``▁the``, ``▁he``... ``▁hello``), so that
    SentencePiece merges reach them.
    """
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256
    pieces = [_SPACE]
    pieces += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    pieces += [str(d) for d in range(10)]
    pieces += list(".,!?'-:")
    pieces += [_SPACE + chr(c) for c in range(ord("a"), ord("z") + 1)]
    for word in _WORDS:
        for end in range(2, len(word) + 1):
            piece = _SPACE + word[:end]
            if piece not in pieces:
                pieces.append(piece)
    scores = [0.0] * len(tokens) + [-(i + 1.0) for i in range(len(pieces))]
    tokens += pieces
    types += [_NORMAL] * len(pieces)
    assert len(set(tokens)) == len(tokens), "token strings must be unique"
    return tokens, scores, types


def write_tiny_gguf(
    path: str | Path,
    *,
    layers: int = 2,
    seed: int = 1234,
    dtype: str = "f16",
    chat_template: str | None = CHATML_TEMPLATE,
) -> Path:
    """Write the tiny model to ``path`` and return it; the same arguments write the same bytes.

    :param layers: transformer blocks (4 puts blocks on both of two RPC workers).
    :param seed: seeds ``numpy.random.default_rng``.
    :param dtype: ``f16`` or ``f32`` for the 2-D weights (norms are always f32).
    :param chat_template: a Jinja chat template, or None to write none
        (llama-server then falls back to ChatML by itself).
    """
    import gguf  # a test dependency: imported here so that importing this module needs only numpy

    if dtype not in ("f16", "f32"):
        raise ValueError(f"dtype must be f16 or f32, got {dtype!r}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = TinyModel()
    tokens, scores, types = tiny_vocab()
    n_vocab, n_embd, n_ff = len(tokens), shape.embedding_length, shape.feed_forward_length
    wtype = np.float16 if dtype == "f16" else np.float32
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int, std: float) -> np.ndarray:
        # numpy shape (rows, cols) is ggml ne {cols, rows}
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(wtype)

    def ones() -> np.ndarray:
        return np.ones(n_embd, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(shape.name)
    writer.add_file_type(1 if dtype == "f16" else 0)  # MOSTLY_F16 or ALL_F32
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(shape.head_count)
    writer.add_head_count_kv(shape.head_count)
    writer.add_layer_norm_rms_eps(shape.rms_epsilon)
    writer.add_rope_dimension_count(shape.rope_dimension_count)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(shape.bos)
    writer.add_eos_token_id(shape.eos)
    writer.add_unk_token_id(shape.unk)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, 1.0))
    writer.add_tensor("output_norm.weight", ones())
    output = matrix(n_vocab, n_embd, 0.375)
    output[[i for i, t in enumerate(types) if t != _NORMAL]] = 0  # never EOS, never a lone byte
    writer.add_tensor("output.weight", output)
    for block in range(layers):
        prefix = f"blk.{block}."
        writer.add_tensor(prefix + "attn_norm.weight", ones())
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(prefix + name + ".weight", matrix(n_embd, n_embd, 0.125))
        writer.add_tensor(prefix + "ffn_norm.weight", ones())
        writer.add_tensor(prefix + "ffn_gate.weight", matrix(n_ff, n_embd, 0.125))
        writer.add_tensor(prefix + "ffn_up.weight", matrix(n_ff, n_embd, 0.125))
        writer.add_tensor(prefix + "ffn_down.weight", matrix(n_embd, n_ff, 0.09))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    """``python -m llmgw.testing.gguf OUT [--layers N] [--seed N] [--dtype f16|f32] [--chat-template T]``."""
    parser = argparse.ArgumentParser(prog="python -m llmgw.testing.gguf", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dtype", choices=("f16", "f32"), default="f16")
    parser.add_argument("--chat-template", choices=("chatml", "none"), default="chatml")
    args = parser.parse_args(argv)
    template = CHATML_TEMPLATE if args.chat_template == "chatml" else None
    path = write_tiny_gguf(
        args.out, layers=args.layers, seed=args.seed, dtype=args.dtype, chat_template=template
    )
    print(f"{path}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
