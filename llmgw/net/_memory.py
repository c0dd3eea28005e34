"""Giving freed memory back to the system once large bodies or many connections went (``malloc_trim``).

Python returns a freed body of 31 MiB to the C allocator, but glibc keeps what it freed in its heaps
(and raises its mmap threshold after such a buffer, so the next ones land in the heap too): a gateway sent
eight huge bodies stayed at its peak, 437 MB, after they were answered. :class:`MemoryReturn` counts what
the server freed and, once a burst of frees is over (a stream of large requests trims once, not per request),
calls ``gc.collect()`` and ``malloc_trim(0)`` (in a worker thread). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys

import trio

__all__ = ["MemoryReturn", "CONNECTION_BYTES", "LARGE_BODY"]

log = logging.getLogger("llmgw.net.server")

#: what one closed connection is counted as freeing (its TLS state, buffers, tasks), roughly
CONNECTION_BYTES = 64 * 1024
#: a request body at least this large is counted when it is released
LARGE_BODY = 1024 * 1024
#: freed bytes counted before a trim is due
_TRIM_AFTER = 16 * 1024 * 1024
#: seconds without a free that end a burst: a trim waits for them once due
_SETTLE = 1.0
#: glibc's mallopt parameter: buffers at least this large are mapped on their own, and unmapped when freed
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1024 * 1024


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    return libc


_LIBC = _glibc()
if _LIBC is not None:
    # a fixed threshold: glibc's own grows to 32 MiB after the first huge buffer is freed
    _LIBC.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


class MemoryReturn:
    """Counts what an HTTP server freed; :meth:`run` trims the C heap a moment after enough was."""

    def __init__(self) -> None:
        #: bytes counted as freed since the last trim
        self.freed = 0
        #: trims done so far
        self.trims = 0
        self._due = trio.Event()

    def note(self, freed: int) -> None:
        """Count ``freed`` bytes (a large body released, a connection closed); called by the server."""
        self.freed += freed
        if self.freed >= _TRIM_AFTER:
            self._due.set()

    async def run(self) -> None:
        """Trim whenever due, for as long as the server accepts connections (cancelled with it)."""
        if _LIBC is None:
            return
        while True:
            await self._due.wait()
            counted = -1
            while counted != self.freed:  # the burst goes on: trim once it is over, what it left too
                counted = self.freed
                await trio.sleep(_SETTLE)
            self._due = trio.Event()
            freed, self.freed = self.freed, 0
            gc.collect()  # closed connections leave cycles (tasks, tracebacks) the collector has not met yet
            await trio.to_thread.run_sync(_LIBC.malloc_trim, 0)
            self.trims += 1
            log.debug("gave freed memory back to the system (%d MB counted freed)", freed >> 20)
