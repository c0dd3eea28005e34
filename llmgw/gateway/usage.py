"""Reading token counts from an engine's answers, without parsing whole bodies.

OpenAI-compatible engines end a completion with ``"usage": {"prompt_tokens":
N, "completion_tokens": M, ...}``; a stream carries it in a last chunk when
the client asked (``stream_options: {"include_usage": true}``). The gateway
counts them per model and API key (:mod:`llmgw.gateway.metrics`), and charges
them to keys with a ``tpm`` limit (:mod:`llmgw.gateway.admission`); a stream
without usage is charged an estimate (:func:`estimated_usage`).
"""

from __future__ import annotations

import re

__all__ = ["CHARS_PER_TOKEN", "read_usage", "estimated_usage", "StreamUsage"]

#: characters of prompt text counted as one token where the engine reported no usage (an estimate)
CHARS_PER_TOKEN = 4

_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,12})')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,12})')
#: bytes after ``"usage"`` searched for its numbers
_WINDOW = 512
#: bytes of a stream chunk kept to find a usage object cut between two chunks (one is ~100 bytes)
_CARRY = 160


def read_usage(body: bytes) -> tuple[int, int] | None:
    """(prompt tokens, completion tokens) of the last ``usage`` object in ``body``; None without one.

    An embeddings answer has no completion tokens: they count 0.
    """
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    window = body[at : at + _WINDOW]
    prompt = _PROMPT.search(window)
    if prompt is None:
        return None
    completion = _COMPLETION.search(window)
    return int(prompt.group(1)), int(completion.group(1)) if completion is not None else 0


def estimated_usage(prompt_chars: int, events: int) -> tuple[int, int]:
    """(prompt, completion) tokens of a stream that carried no usage: its prompt's characters over
    :data:`CHARS_PER_TOKEN`, and one completion token per event (``data: [DONE]`` not counted).

    Called when a key's tokens are charged (``--tpm``) and the client did not ask for the usage.
    """
    return -(-prompt_chars // CHARS_PER_TOKEN), max(0, events - 1)


class StreamUsage:
    """The usage of a server-sent-events stream, fed chunk by chunk; :attr:`usage` is the last one seen,
    :attr:`events` the events seen (``data:`` lines)."""

    __slots__ = ("usage", "events", "_carry")

    def __init__(self) -> None:
        self.usage: tuple[int, int] | None = None
        self.events = 0
        self._carry = b""

    def feed(self, chunk: bytes) -> None:
        """Look for a usage object in ``chunk`` (and the end of the chunk before, if it was cut there).

        A usage object cut between two chunks still has a ``..._tokens`` key in the second
        (``total_tokens`` comes last), so a chunk without one is skipped at the cost of one search.
        """
        self.events += chunk.count(b"data:")
        if b"_tokens" in chunk:
            found = read_usage(self._carry + chunk)
            if found is not None:
                self.usage = found
        self._carry = chunk[-_CARRY:]
