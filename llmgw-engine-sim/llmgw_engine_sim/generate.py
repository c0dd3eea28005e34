"""Deterministic "model output": the same prompt always gives the same text.

Tokens are whitespace-separated words. Like a real model decoding greedily,
each word is a function of the whole context before it: a hash of the choice
index, the seed, the prompt and the words generated so far. So a prompt that
ends with the first k words of an answer (an assistant message continued, or
a completion's prompt with its text so far appended) is continued with the
answer's word k+1 onwards, and the two halves equal the unbroken answer.

Where an answer stops by itself (``finish_reason`` ``stop``; else ``length``
at ``max_tokens``): a chat answer has a natural length of 4 to 63 words drawn
from its prompt without the answer, counted from the answer's first word; a
completion (whose prompt may already hold part of the answer) stops where the
context's hash says so, one chance in :data:`STOP_ONE_IN` per word.
``ignore_eos`` (as vLLM's) makes either go on to ``max_tokens``.
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


#: a completion's word ends it with one chance in this many (its mean natural length)
STOP_ONE_IN = 32


def generate(
    prompt: str,
    max_tokens: int,
    *,
    index: int = 0,
    seed: int | None = None,
    answer: str | None = None,
    ignore_eos: bool = False,
    adapter: str | None = None,
) -> Generation:
    """Generate up to ``max_tokens`` tokens after ``prompt``, one word at a time from the context so far.

    Called by the sim's API for every choice of a chat or completion request.

    :param prompt: a chat's rendered messages up to the answer (ending with ``assistant: ``), or a
        completion's prompt.
    :param index: the choice number, for requests asking ``n`` > 1 choices.
    :param seed: the request's ``seed``, if any; part of the hash.
    :param answer: for a chat, the answer's text already given (a continued assistant message, else
        empty); None for a completion.
    :param ignore_eos: never stop before ``max_tokens``.
    :param adapter: the LoRA adapter answering (None: the base model); part of the hash, so each
        adapter says something else, as continuation-safe as the base model.
    :returns: the same :class:`Generation` for the same arguments, always; for a chat, generating with
        ``answer`` the first words of an answer gives its remaining words, as for a completion does
        ``prompt`` followed by them.
    """
    salt = () if adapter is None else ("lora", adapter)
    context = hashlib.sha256("".join(f"{part}\x1f" for part in (index, seed, *salt)).encode())
    context.update(prompt.encode())
    chat = answer is not None
    if chat:
        context.update(answer.encode())
        natural_length = 4 + _digest("length", prompt, index, seed, *salt)[0] % 60
        position = count_tokens(answer)
    tokens: list[str] = []
    while len(tokens) < max_tokens:
        digest = context.copy().digest()
        if not ignore_eos:
            if chat and position + len(tokens) >= natural_length:
                return Generation(tuple(tokens), "stop")
            if not chat and digest[4] % STOP_ONE_IN == 0:
                return Generation(tuple(tokens), "stop")
        word = _WORDS[int.from_bytes(digest[:4], "big") % len(_WORDS)]
        token = word if chat and position + len(tokens) == 0 else " " + word
        tokens.append(token)
        context.update(token.encode())
    return Generation(tuple(tokens), "length")


def embed(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector of ``dimensions`` floats for ``text``."""
    raw = b"".join(_digest("embed", text, block) for block in range(math.ceil(dimensions * 4 / 32)))
    values = [(v / 2**31) - 1.0 for v in struct.unpack(f">{dimensions}I", raw[: dimensions * 4])]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]
