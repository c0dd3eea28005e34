"""SIGINT, SIGTERM and SIGHUP for ``llmgw dev``: at any moment, they stop everything it started.

``llmgw dev`` starts a server, agents and a gateway, each in a session of its
own (a Ctrl-C in the terminal reaches ``llmgw dev`` alone, which stops them in
order). :func:`stop_on_signals` turns each of these signals into
:class:`Stopped`, raised in the main thread wherever it is (starting a process,
waiting for replicas, serving), so that the ``finally`` that stops the cluster
always runs. Two windows must not be cut:

- between starting a process and recording it (else it runs on, unknown to
  the stop): :func:`deferred` holds a signal back until the process is recorded;
- the stop itself: once :func:`stopping` is entered, another signal only says
  that the stop is under way.

SIGINT is handled even when ``llmgw dev`` inherited it ignored, as a job put
in the background (``&``) by a non-interactive shell does: a script that
starts it in the background and later sends SIGINT stops it too.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Stopped", "stop_on_signals", "deferred", "stopping", "STOP_SIGNALS"]

#: the signals that stop ``llmgw dev``
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """A stop signal arrived; ``signum`` says which. A BaseException, so no ``except Exception`` eats it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    installed = False
    depth = 0
    pending: int | None = None
    stopping = False


_state = _State()


def _handler(signum: int, frame: object) -> None:
    if _state.stopping:
        print(f"llmgw dev: {signal.Signals(signum).name}: already stopping", file=sys.stderr, flush=True)
        return
    if _state.depth:
        _state.pending = signum
        return
    raise Stopped(signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise :class:`Stopped`; the previous handlers come back
    after it. Called by ``llmgw dev`` around everything it starts."""
    previous = {sig: signal.signal(sig, _handler) for sig in STOP_SIGNALS}
    _state.installed, _state.depth, _state.pending, _state.stopping = True, 0, None, False
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _state.installed = False


@contextmanager
def deferred() -> Iterator[None]:
    """Hold stop signals back within the block and raise :class:`Stopped` for one at its end.

    Called around starting a process and recording it; without :func:`stop_on_signals`, it does nothing.
    """
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if not _state.depth and _state.pending is not None and not _state.stopping:
            signum, _state.pending = _state.pending, None
            raise Stopped(signum)


@contextmanager
def stopping() -> Iterator[None]:
    """Within the block (the stop), a stop signal is reported, not raised: the stop runs to its end."""
    was = _state.stopping
    _state.stopping = True
    try:
        yield
    finally:
        _state.stopping = was
