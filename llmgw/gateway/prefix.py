"""Prefix-aware routing: requests that share a prompt's beginning go where that beginning was sent before.

Engines keep the KV cache of prompt prefixes they have computed (vLLM's and
SGLang's prefix caching): a conversation's next turn, or another request with
the same long system prompt, starts much sooner on the replica that already
holds that prefix. The gateway cannot see the engines' caches, so it
remembers where it sent each prefix:

- :func:`prefix_keys` cuts the prompt's text (the messages' roles and text
  content, so it does not depend on the chat template; a completion's prompt)
  into blocks of ``block_chars`` bytes and names leading runs of 1, 2, 3, 4,
  6, 8, 12, 16... blocks by their hash;
- :class:`PrefixTable` remembers, for the most recent keys, the replica each
  went to, and :meth:`PrefixTable.choose` sends a request to the replica that
  got its longest known prefix. A prefix never seen goes where consistent
  hashing (rendezvous) of its first block says, so gateways and workers agree
  without talking;
- load stays bounded: a replica with more than ``load_factor`` times the mean
  requests in flight (counting this one) is passed over, and the prefix is
  placed again as a new one is: by its first block's hash order among the
  replicas at or under the mean load. That spreads a hot prefix over more
  replicas, and a workload without shared prefixes gets least-loaded routing.
  Session affinity (``X-Session-Id``) still wins.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar


class Candidate(Protocol):
    """What choosing reads of a replica (:class:`llmgw.gateway.balancer.Upstream`)."""

    name: str
    in_flight: int
    affinity_key: bytes


#: the replicas' type: :meth:`PrefixTable.choose` returns one of those it is given
C = TypeVar("C", bound=Candidate)

__all__ = ["prefix_keys", "prompt_text", "PrefixTable"]


def prompt_text(endpoint: str, body: dict[str, Any]) -> str:
    """The text a prompt's prefix is judged on: the messages' roles and text, or the completion's prompt."""
    if endpoint == "chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts: the text ones count
                content = "".join(
                    part.get("text", "")
                    for part in content
                    if isinstance(part, dict) and part.get("type") == "text"
                )
            parts.append(f"{message.get('role')}\x1e{content if isinstance(content, str) else ''}\x1f")
        return "".join(parts)
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else ""
    return ""


def prefix_keys(text: str, *, block_chars: int = 256, max_chars: int = 128 * 1024) -> tuple[bytes, ...]:
    """Keys of ``text``'s leading runs of whole blocks, shortest first.

    A key is taken after 1, 2, 3, 4, 6, 8, 12, 16, 24... blocks (each step about x1.4), so a long
    prompt costs one pass of hashing and a few dozen keys; a text shorter than a block is one key.
    """
    if not text:
        return ()
    data = text.encode("utf-8", "surrogatepass")[:max_chars]
    whole = len(data) // block_chars
    if whole == 0:
        return (_key(zlib.crc32(data), len(data)),)
    keys = []
    crc = 0
    done = 0
    view = memoryview(data)
    for blocks in _checkpoints(whole):
        crc = zlib.crc32(view[done * block_chars : blocks * block_chars], crc)
        done = blocks
        keys.append(_key(crc, blocks * block_chars))
    return tuple(keys)


def _key(crc: int, length: int) -> bytes:
    # CRC-32 and the length: a collision only sends a request to another replica's cache
    return crc.to_bytes(4, "big") + length.to_bytes(4, "big")


def _checkpoints(whole: int) -> list[int]:
    points, step = [], 1
    while step <= whole:
        points.append(step)
        step = step + 1 if step < 4 else step + (step // 2 if step & (step - 1) == 0 else step // 3)
    return points


class PrefixTable:
    """Where the most recent prefixes went; chooses a replica for a request's prefix keys.

    :param load_factor: a replica is passed over while its requests in flight, with this one,
        exceed this factor times the mean over the candidates (bounded-load consistent hashing).
    :param capacity: prefix keys remembered, least recently used forgotten first.
    """

    def __init__(self, *, load_factor: float = 1.5, capacity: int = 200_000) -> None:
        if load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.load_factor = load_factor
        self.capacity = capacity
        self._where: OrderedDict[bytes, str] = OrderedDict()

    def choose(self, candidates: Sequence[C], keys: Sequence[bytes]) -> C:
        """The replica for a request whose prompt has ``keys`` (non-empty ``candidates``); remembers it."""
        total = sum(replica.in_flight for replica in candidates)
        bound = math.ceil(self.load_factor * (total + 1) / len(candidates))
        chosen = None
        by_name = {replica.name: replica for replica in candidates}
        for key in reversed(keys):  # the longest known prefix first
            name = self._where.get(key)
            if name is not None:
                replica = by_name.get(name)
                if replica is not None and replica.in_flight + 1 <= bound:
                    chosen = replica
                break
        if chosen is None:
            # A prefix new here (or whose replica is too busy) is placed by consistent hashing of its
            # first block among the replicas at or under the mean load: no cache to gain, so no more.
            bound = math.ceil((total + 1) / len(candidates))
            first = keys[0]
            order = sorted(candidates, key=lambda r: _weight(first, r.affinity_key), reverse=True)
            chosen = next((r for r in order if r.in_flight + 1 <= bound), None)
            if chosen is None:
                chosen = min(candidates, key=lambda r: r.in_flight)
        self.remember(keys, chosen.name)
        return chosen

    def remember(self, keys: Sequence[bytes], replica: str) -> None:
        """Record that ``keys`` went to ``replica``."""
        where = self._where
        for key in keys:
            where[key] = replica
            where.move_to_end(key)
        while len(where) > self.capacity:
            where.popitem(last=False)

    def __len__(self) -> int:
        return len(self._where)


def _weight(key: bytes, replica: bytes) -> bytes:
    return hashlib.blake2b(key + b"\0" + replica, digest_size=8).digest()
