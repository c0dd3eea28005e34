"""A LoRA adapter's folder as engines read it: PEFT's ``adapter_config.json``, and the rank it declares.

vLLM, SGLang and the PEFT library read an adapter from a folder holding
``adapter_config.json`` (its ``r``, and per-module ranks in ``rank_pattern``)
beside the weights. An engine started with a largest rank (the profile's
``max_adapter_rank``) refuses a larger one at load time, with a message of its
own; :func:`adapter_problem` says so before the load, in llmgw's words.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ADAPTER_CONFIG", "adapter_problem", "adapter_rank"]

#: the file that makes a folder a PEFT LoRA adapter
ADAPTER_CONFIG = "adapter_config.json"
#: the largest adapter_config.json read (a real one is about 1 kB)
_CONFIG_LIMIT = 1024 * 1024


class _Unreadable(ValueError):
    """The adapter's config is missing or not what PEFT writes; the message says which."""


def adapter_rank(directory: Path) -> int:
    """The largest LoRA rank ``directory``'s ``adapter_config.json`` declares (``r``, ``rank_pattern``).

    Blocking: call it from a worker thread.

    :raises ValueError: the file is missing, too large, not JSON, or has no integer ``r``.
    """
    path = directory / ADAPTER_CONFIG
    try:
        with path.open("rb") as file:
            text = file.read(_CONFIG_LIMIT + 1)
    except FileNotFoundError:
        raise _Unreadable(f"no {ADAPTER_CONFIG} in {directory}: not a PEFT LoRA adapter") from None
    except OSError as exc:
        raise _Unreadable(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if len(text) > _CONFIG_LIMIT:
        raise _Unreadable(f"{path}: larger than {_CONFIG_LIMIT} bytes: not an adapter's config")
    try:
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Unreadable(f"{path}: not JSON: {exc}") from None
    rank = config.get("r") if isinstance(config, dict) else None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _Unreadable(f"{path}: expected a positive integer 'r' (the LoRA rank), got {rank!r}")
    pattern = config.get("rank_pattern") or {}
    ranks = (
        [r for r in pattern.values() if isinstance(r, int) and not isinstance(r, bool)]
        if isinstance(pattern, dict)
        else []
    )
    return max([rank, *ranks])


def adapter_problem(directory: Path, max_rank: int) -> str | None:
    """What keeps the adapter in ``directory`` from loading on an engine started with ``max_rank``; None
    when nothing does.

    Called by the agent once an adapter's copy is staged, before it asks a
    replica to load it: the answer is the reason the load failed (for the
    client and ``ctl events``). Blocking: call it from a worker thread.

    :param max_rank: the profile's ``max_adapter_rank`` (:attr:`llmgw.models.LoraSpec.max_rank`).
    """
    try:
        rank = adapter_rank(directory)
    except ValueError as exc:
        return str(exc)
    if rank > max_rank:
        return (
            f"its LoRA rank is {rank}, above the profile's max_adapter_rank {max_rank} "
            "(raise max_adapter_rank in the catalog: its replicas restart with it)"
        )
    return None
