"""``llmgw gateway --workers N``: N gateway processes sharing one port.

The parent forks N workers before any event loop runs, then only supervises:
each worker is a whole gateway (its own routes feed, balancer, connection
pool) listening on the same address with ``SO_REUSEPORT``, so the kernel
spreads new connections across them. The parent forwards SIGTERM and SIGINT
to the workers, waits for them, and exits with the first failure's code when
one fails; a worker exits by itself when its parent dies (``PR_SET_PDEATHSIG``
on Linux), and all share the parent's process group, so killing the group
ends them all.

Metrics add up: the workers' counters and histograms go to files in a
directory of the parent's (prometheus-client's multiprocess mode), and
``GET /metrics`` on any worker sums them over every worker. The gauges read
from live state (requests in flight, breakers, routes) are those of the
worker that answered the scrape.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable

__all__ = ["run_workers", "MULTIPROC_ENV", "PARENT_ENV"]

log = logging.getLogger("llmgw.gateway")

#: prometheus-client's variable naming the directory of the workers' metric files
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: the supervising parent's pid, for the workers' ``process_*`` metrics
PARENT_ENV = "LLMGW_GATEWAY_PARENT"
_PR_SET_PDEATHSIG = 1


def run_workers(workers: int, serve_one: Callable[[int], None]) -> int:
    """Fork ``workers`` processes that each call ``serve_one(index)``; supervise them until all exit.

    Called by ``llmgw gateway`` when ``--workers`` is over 1, before anything
    starts an event loop. Returns the exit code for the parent: 0 when every
    worker ended well (after a signal), else the first failing worker's code.
    """
    metrics_dir = tempfile.mkdtemp(prefix="llmgw-gateway-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    os.environ[PARENT_ENV] = str(os.getpid())
    parent = os.getpid()
    children: dict[int, int] = {}
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if signum == signal.SIGINT and _terminal_signals_us():
            return  # Ctrl-C: the terminal sent it to the workers too (they share our process group)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(workers):
            pid = os.fork()
            if pid == 0:
                _become_worker(parent, previous)
                code = 0
                try:
                    serve_one(index)
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException:
                    log.exception("gateway worker %d failed", index)
                    code = 1
                finally:
                    logging.shutdown()
                os._exit(code)
            children[pid] = index
        log.info("gateway: %d workers (pids %s)", workers, " ".join(map(str, children)))
        result = 0
        while children:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            index = children.pop(pid, None)
            if index is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            if code == 0 or (stopping and code < 0):
                continue  # ended well, or by the signal that stops them all
            if not stopping:
                log.error("gateway worker %d (pid %d) exited with %d: stopping the others", index, pid, code)
                forward(signal.SIGTERM, None)
            if result == 0:
                result = code if code > 0 else 1
        return result
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.environ.pop(MULTIPROC_ENV, None)
        os.environ.pop(PARENT_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _become_worker(parent: int, handlers: dict) -> None:
    """In a fresh worker: default signal handling, and die with the parent."""
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _terminal_signals_us() -> bool:
    """Whether our process group is the foreground one of a terminal (which signals the whole group)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False
