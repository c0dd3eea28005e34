"""The tiny GGUF model for tests of a real llama.cpp: it reads back with gguf's own reader."""

from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is a test dependency (pip install gguf)")

from llmgw.testing.gguf import (  # noqa: E402 - after the importorskip
    CHATML_TEMPLATE,
    REQUIRED_KEYS,
    TinyModel,
    tiny_vocab,
    write_tiny_gguf,
)


def field_value(reader, key: str):
    """A scalar, string or array metadata value, as Python values."""
    field = reader.fields[key]
    return field.contents()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def reader(model_path):
    return gguf.GGUFReader(model_path)


class TestTinyGguf:
    """write_tiny_gguf writes a small llama model with everything llama.cpp needs."""

    def test_every_required_key(self, reader):
        """Every metadata key llama.cpp needs is there, and the chat template."""
        missing = [key for key in REQUIRED_KEYS if key not in reader.fields]
        assert missing == []
        assert field_value(reader, "tokenizer.chat_template") == CHATML_TEMPLATE

    def test_hyperparameters(self, reader):
        """A llama of width 64, 2 blocks, 4 heads and the rope dimension llama.cpp checks."""
        shape = TinyModel()
        assert field_value(reader, "general.architecture") == "llama"
        assert field_value(reader, "llama.block_count") == 2
        assert field_value(reader, "llama.embedding_length") == shape.embedding_length
        assert field_value(reader, "llama.attention.head_count") == 4
        assert field_value(reader, "llama.rope.dimension_count") == 64 // 4
        assert field_value(reader, "llama.vocab_size") == 377
        assert field_value(reader, "tokenizer.ggml.model") == "llama"
        assert field_value(reader, "tokenizer.ggml.add_bos_token") is True

    def test_vocabulary(self, reader):
        """377 unique tokens: specials, the 256 bytes, then text pieces; ids of BOS, EOS and UNK."""
        tokens, scores, types = tiny_vocab()
        assert len(tokens) == len(set(tokens)) == 377
        assert field_value(reader, "tokenizer.ggml.tokens") == tokens
        assert field_value(reader, "tokenizer.ggml.token_type") == types
        assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3 + 0x0A] == "<0x0A>"
        assert (
            field_value(reader, "tokenizer.ggml.bos_token_id"),
            field_value(reader, "tokenizer.ggml.eos_token_id"),
        ) == (1, 2)

    def test_tensors(self, reader):
        """Each block's tensors with llama.cpp's names and ggml shapes; EOS and byte rows of output zeroed."""
        tensors = {t.name: t for t in reader.tensors}
        assert len(tensors) == 3 + 2 * 9
        assert list(tensors["token_embd.weight"].shape) == [64, 377]
        assert list(tensors["blk.1.ffn_down.weight"].shape) == [128, 64]
        assert list(tensors["blk.0.ffn_gate.weight"].shape) == [64, 128]
        output = tensors["output.weight"].data
        assert not output[:259].any(), "specials and bytes have zero logits"
        assert output[259:].any()

    def test_small_and_deterministic(self, tmp_path, model_path):
        """A few hundred KB, and the same arguments write the same bytes; another seed does not."""
        again = write_tiny_gguf(tmp_path / "again.gguf")
        other = write_tiny_gguf(tmp_path / "other.gguf", seed=7)
        assert model_path.stat().st_size < 1_000_000
        assert again.read_bytes() == model_path.read_bytes()
        assert other.read_bytes() != model_path.read_bytes()

    def test_options(self, tmp_path):
        """No chat template, four layers and f32 weights are options."""
        path = write_tiny_gguf(tmp_path / "m.gguf", layers=4, dtype="f32", chat_template=None)
        reader = gguf.GGUFReader(path)
        assert "tokenizer.chat_template" not in reader.fields
        assert field_value(reader, "llama.block_count") == 4
        assert field_value(reader, "general.file_type") == 0
        with pytest.raises(ValueError, match="dtype"):
            write_tiny_gguf(tmp_path / "x.gguf", dtype="q4")
