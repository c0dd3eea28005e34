"""Deterministic "model output": the same prompt always gives the same text.

Tokens are whitespace-separated words. Like a real model decoding greedily,
each word is a function of the whole context before it: a hash of the choice
index, the seed, the prompt and the words generated so far. So a prompt that
ends with the first k words of an answer (an assistant message continued, or
a completion's prompt with its text so far appended) is continued with the
answer's word k+1 onwards, and the two halves equal the unbroken answer.

Generation stops by itself (``finish_reason`` ``stop``) where the context's
hash says so (one chance in :data:`STOP_ONE_IN` per word, never before the
answer's first word unless the answer was already begun), or at ``max_tokens``
(``length``); ``ignore_eos`` (as vLLM's) makes it go on to ``max_tokens``.
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


#: a generated word ends the answer with one chance in this many (the mean natural length)
STOP_ONE_IN = 32


def generate(
    prompt: str,
    max_tokens: int,
    *,
    index: int = 0,
    seed: int | None = None,
    begun: bool = False,
    ignore_eos: bool = False,
) -> Generation:
    """Generate up to ``max_tokens`` tokens after ``prompt``, one word at a time from the context so far.

    Called by the sim's API for every choice of a chat or completion request.

    :param prompt: the whole context: the rendered chat (ending with ``assistant: `` and any text of
        the answer already begun) or a completion's prompt.
    :param index: the choice number, for requests asking ``n`` > 1 choices.
    :param seed: the request's ``seed``, if any; part of the hash.
    :param begun: the prompt ends inside the answer (a continued assistant message, or a completion):
        every word is preceded by a space, and the first may already be the end.
    :param ignore_eos: never stop before ``max_tokens``.
    :returns: the same :class:`Generation` for the same arguments, always; generating after
        ``prompt + text`` (with ``begun``) gives the rest of the generation after ``prompt``.
    """
    context = hashlib.sha256(f"{index}\x1f{seed}\x1f".encode())
    context.update(prompt.encode())
    tokens: list[str] = []
    for position in range(max_tokens):
        digest = context.copy().digest()
        if not ignore_eos and (begun or position > 0) and digest[4] % STOP_ONE_IN == 0:
            return Generation(tuple(tokens), "stop")
        word = _WORDS[int.from_bytes(digest[:4], "big") % len(_WORDS)]
        token = " " + word if begun or position > 0 else word
        tokens.append(token)
        context.update(token.encode())
    return Generation(tuple(tokens), "length")


def embed(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector of ``dimensions`` floats for ``text``."""
    raw = b"".join(_digest("embed", text, block) for block in range(math.ceil(dimensions * 4 / 32)))
    values = [(v / 2**31) - 1.0 for v in struct.unpack(f">{dimensions}I", raw[: dimensions * 4])]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]
