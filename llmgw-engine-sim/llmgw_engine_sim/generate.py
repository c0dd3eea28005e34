"""Deterministic "model output": the same prompt always gives the same text.

Tokens are whitespace-separated words. Generated words come from a hash of
the prompt (and the choice index and seed), and each prompt has its own
natural length, so some completions stop on their own (``finish_reason``
``stop``) and others are cut by ``max_tokens`` (``length``).
"""

from __future__ import annotations

import hashlib
import math
import struct

import attrs

__all__ = ["Generation", "count_tokens", "embed", "generate"]

_WORDS = (
    "the a fleet of gpus serves models behind one gateway while agents watch shards and "
    "replicas rise fall ready again tokens stream quickly through loopback sockets every "
    "node joins its peers over fabric links heartbeat rendezvous weights load slowly then "
    "answers flow prompt completion chat embedding cluster scheduler catalog profile"
).split()


@attrs.frozen
class Generation:
    """The tokens generated for one prompt, and why generation ended."""

    tokens: tuple[str, ...]
    #: ``stop`` (the text ended by itself) or ``length`` (``max_tokens`` reached)
    finish_reason: str

    @property
    def text(self) -> str:
        """The tokens joined as text."""
        return "".join(self.tokens)


def count_tokens(text: str) -> int:
    """How many tokens ``text`` is: its whitespace-separated words."""
    return len(text.split())


def _digest(*parts: object) -> bytes:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()


def generate(prompt: str, max_tokens: int, *, index: int = 0, seed: int | None = None) -> Generation:
    """Generate up to ``max_tokens`` tokens for ``prompt``.

    :param index: the choice number, for requests asking ``n`` > 1 choices.
    :param seed: the request's ``seed``, if any; part of the hash.
    :returns: the same :class:`Generation` for the same arguments, always.
    """
    natural_length = 4 + _digest("length", prompt, index, seed)[0] % 60
    length = min(natural_length, max_tokens)
    tokens = []
    for position in range(length):
        word = _WORDS[int.from_bytes(_digest(prompt, index, seed, position)[:4], "big") % len(_WORDS)]
        tokens.append(word if position == 0 else " " + word)
    return Generation(tuple(tokens), "stop" if natural_length <= max_tokens else "length")


def embed(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector of ``dimensions`` floats for ``text``."""
    raw = b"".join(_digest("embed", text, block) for block in range(math.ceil(dimensions * 4 / 32)))
    values = [(v / 2**31) - 1.0 for v in struct.unpack(f">{dimensions}I", raw[: dimensions * 4])]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]
