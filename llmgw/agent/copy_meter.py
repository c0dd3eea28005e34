"""Progress of one copy for ``ctl replicas``: ``fetching 40% (19 of 48 MB, 35 MB/s)``."""

from __future__ import annotations

import time
from collections.abc import Callable

from llmgw.wire import StagingProgress

__all__ = ["PROGRESS_EVERY", "CopyMeter", "Progress"]

#: seconds between two progress reports of one copy
PROGRESS_EVERY = 0.5

#: ``progress(detail, staged=None)``: a line for people; when fetching, the copy's StagingProgress
Progress = Callable[..., None]


class CopyMeter:
    """Bytes of a copy present, shown as ``LABEL 40% (...)`` at most every :data:`PROGRESS_EVERY`."""

    def __init__(self, total: int, present: int, progress: Progress, label: str = "fetching") -> None:
        self.total, self.present, self.progress, self.label = total, present, progress, label
        self.started, self.start_bytes, self.shown = time.monotonic(), present, 0.0

    def add(self, size: int) -> None:
        """Count ``size`` more bytes (negative: bytes thrown away); shows the line when it is time."""
        self.present += size
        now = time.monotonic()
        if now - self.shown >= PROGRESS_EVERY:
            self.shown = now
            self.show()

    def show(self) -> None:
        """Show the line now."""
        rate = (self.present - self.start_bytes) / max(time.monotonic() - self.started, 1e-6) / 1e6
        percent = 100 * self.present // max(self.total, 1)
        sizes = f"{self.present / 1e6:.0f} of {self.total / 1e6:.0f} MB"
        self.progress(
            f"{self.label} {percent}% ({sizes}, {rate:.0f} MB/s)",
            StagingProgress(self.present, self.total, rate * 1e6),
        )
