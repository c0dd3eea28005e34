"""Why a shard failed, as the agent reports it: the :class:`~llmgw.wire.causes.FailureCause` of an exit.

The supervisor reports a shard ``exited`` or ``unhealthy`` with a cause
(:attr:`ObservedShard.cause <llmgw.wire.ObservedShard>`); the server records
it on the replica and both count it in their failure metrics. Most causes
follow from what the supervisor saw (a failed health check, a liveness
canary, a process that ended); an engine that ended or stopped answering its
health check is read once more: its last log lines say whether it ran out of
GPU memory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from llmgw.wire.causes import FailureCause

__all__ = ["log_cause", "OOM_LINE", "TAIL_LINES"]

#: how many of the engine's last log lines are read for a cause
TAIL_LINES = 40
#: a line of an engine that ran out of GPU memory: PyTorch's ``torch.OutOfMemoryError: CUDA out of
#: memory`` (vLLM, SGLang), the CUDA runtime's ``CUDA error: out of memory``, ROCm's ``HIP out of
#: memory``, llama.cpp's ``cudaMalloc failed: out of memory``
OOM_LINE = re.compile(
    r"OutOfMemoryError|(CUDA|HIP|GPU)( error:)? out of memory|cudaMalloc failed: out of memory"
    r"|CUBLAS_STATUS_ALLOC_FAILED",
    re.IGNORECASE,
)


def log_cause(log_path: Path, seen: FailureCause) -> FailureCause:
    """The cause of an engine that exited or failed its health check (``seen``), read in its log.

    Called by the supervisor (in a worker thread) before it reports the shard.

    :returns: :attr:`FailureCause.OOM` when one of the engine's last
        :data:`TAIL_LINES` log lines says the GPU ran out of memory, else ``seen``.
    """
    if any(OOM_LINE.search(line) for line in _tail(log_path, TAIL_LINES)):
        return FailureCause.OOM
    return seen


def _tail(path: Path, count: int) -> list[str]:
    """The last ``count`` lines of ``path`` (from its last 32 KiB; none when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 32768))
            text = handle.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-count:]
