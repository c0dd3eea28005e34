"""The simulated engine's prefix cache: prompts cost prefill time for the tokens it has not seen.

Like vLLM's automatic prefix caching: a prompt is cut into blocks of
``--prefix-block-tokens`` tokens (whitespace-separated words, as everywhere in
the sim); each full block is named by a hash chained over every block before
it, so a block hits only when the whole prefix up to it is the same. The
replica keeps the most recently used blocks up to ``--prefix-cache-tokens``
tokens (least recently used first out, a prefix's tail before its head). A request's prefill takes
``uncached tokens × --prefill-seconds-per-token``, one prefill at a time per
replica (prefill is compute bound: concurrent ones queue), and its first token
comes ``--time-to-first-token`` after its prefill. The default prefill cost,
100 µs per token, makes a shared 1,000-token system prompt cost 0.1 s when it
misses; ``--prefill-seconds-per-token 0`` makes prefill free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import attrs
import trio

from llmgw_engine_sim.flags import non_negative, option, positive_int

__all__ = ["PrefillOptions", "PrefixCache", "Prefill"]


@attrs.frozen
class PrefillOptions:
    """The prefix cache's flags."""

    #: tokens the cache holds (0: no cache, every prompt is prefilled whole)
    cache_tokens: int = option(
        65536,
        "--prefix-cache-tokens",
        "prompt tokens the prefix cache keeps, least recently used out; 0 disables it (default {default})",
        non_negative(int),
        "N",
    )
    #: tokens per cached block
    block_tokens: int = option(
        16,
        "--prefix-block-tokens",
        "tokens per prefix-cache block; only whole blocks are cached (default {default})",
        positive_int,
        "N",
    )
    #: prefill time per uncached prompt token (100 µs: ~10k tokens/s, a mid-range GPU's prefill on a 7B
    #: model, so a long shared system prompt shows what prefix routing saves)
    seconds_per_token: float = option(
        0.0001,
        "--prefill-seconds-per-token",
        "prefill time per prompt token not in the prefix cache, one prefill at a time; "
        "0 makes prefill free (default {default})",
        non_negative(float),
        "SECONDS",
    )


class PrefixCache:
    """Block hashes of the prompts seen, least recently used first, up to ``capacity_tokens``."""

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        #: prompt tokens looked up, and how many of them were found cached
        self.tokens_seen = 0
        self.tokens_hit = 0

    def admit(self, tokens: Sequence[str], salt: str = "") -> int:
        """Look ``tokens`` up and cache their whole blocks; returns how many leading tokens were cached.

        The prompt's blocks become the most recently used, its first block most of all (as in
        vLLM, a prefix's tail is evicted before its head). A ``salt`` (a LoRA adapter's name) starts the
        hash chain, so the same prompt under another adapter shares no block, as vLLM's block hashes
        include the LoRA id.
        """
        size = self.block_tokens
        blocks = self._blocks
        digests = []
        digest = hashlib.blake2b(f"lora\x1f{salt}".encode(), digest_size=16).digest() if salt else b""
        for start in range(0, len(tokens) - size + 1, size):
            block = "\x1f".join(tokens[start : start + size]).encode()
            digest = hashlib.blake2b(digest + block, digest_size=16).digest()
            digests.append(digest)
        hit = 0
        while hit < len(digests) and digests[hit] in blocks:
            hit += 1
        if self.capacity_blocks:
            for digest in reversed(digests):
                blocks[digest] = None
                blocks.move_to_end(digest)
            while len(blocks) > self.capacity_blocks:
                blocks.popitem(last=False)
        self.tokens_seen += len(tokens)
        self.tokens_hit += hit * size
        return hit * size

    def __len__(self) -> int:
        """Tokens cached now."""
        return len(self._blocks) * self.block_tokens


class Prefill:
    """One replica's prefill: the prefix cache, and the lane where prefills queue."""

    def __init__(self, options: PrefillOptions) -> None:
        self.options = options
        self.cache = PrefixCache(options.cache_tokens, options.block_tokens)
        self._lane = trio.Lock()

    async def run(self, prompt: str, adapter: str | None = None) -> int:
        """Called before a request's first token: waits out the prefill of what the cache lacks.

        ``adapter``: the LoRA adapter answering (its blocks are its own). Returns the number of prompt
        tokens found in the cache.
        """
        tokens = prompt.split()
        cached = self.cache.admit(tokens, adapter or "")
        seconds = (len(tokens) - cached) * self.options.seconds_per_token
        if seconds > 0:
            async with self._lane:
                await trio.sleep(seconds)
        return cached
