"""What every llmgw process shares to be scraped: rendering a registry, ``process_*``, a plain metrics port.

The server and the agent serve ``GET /metrics`` and ``GET /health`` on a
separate plain-HTTP address (``--metrics-listen HOST:PORT``) through
:func:`observability_handler`; the gateway serves them on its own port.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder

from llmgw.net._records import Request, Response

__all__ = [
    "Health",
    "render_registry",
    "observability_handler",
    "register_process_collectors",
    "ScrapeCollector",
    "ProcessGroupCollector",
]

#: ``(status code, JSON body)`` of ``GET /health``: 200 only when healthy
Health = tuple[int, dict]


def render_registry(registry: CollectorRegistry, accept: str | None) -> Response:
    """``registry`` in the exposition format the scraper asks for (``Accept``), as a 200 response."""
    encoder, content_type = choose_encoder(accept or "")
    return Response(200, (("content-type", content_type),), encoder(registry))


def observability_handler(
    registry: Callable[[], CollectorRegistry],
    health: Callable[[], Awaitable[Health]],
    extra: Mapping[str, Callable[[], object]] | None = None,
) -> Callable[[Request], Awaitable[Response]]:
    """An HTTP handler answering ``GET /metrics``, ``GET /health`` and ``extra`` (everything else: 404).

    Used for ``--metrics-listen``: that port serves nothing but these, so it
    needs no client certificate and can face a Prometheus without one.
    ``extra`` maps more paths to functions returning a JSON-able answer
    (the server's Prometheus service discovery of engines, ``/sd/engines``).
    """
    extra = dict(extra or {})
    paths = ("/metrics", "/health", *extra)

    async def handle(request: Request) -> Response:
        if request.path not in paths:
            return Response.json(404, {"error": f"no such endpoint: {request.path} (try {', '.join(paths)})"})
        if request.method not in ("GET", "HEAD"):
            return Response.json(405, {"error": f"{request.method} is not allowed on {request.path}"})
        if request.path == "/metrics":
            return render_registry(registry(), request.header("accept"))
        if request.path in extra:
            return Response.json(200, extra[request.path]())
        status, body = await health()
        return Response.json(status, body)

    return handle


def register_process_collectors(registry: CollectorRegistry) -> None:
    """Add ``process_*`` (this process: CPU, memory, open files, start time) and ``python_info``."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)


class ScrapeCollector:
    """A collector whose families are all read at scrape time (subclasses define ``collect``).

    It describes no family, so registering it neither calls ``collect`` before
    what it reads exists nor checks its names against the registry's.
    """

    def describe(self) -> list[Metric]:
        return []


class ProcessGroupCollector(ScrapeCollector):
    """``process_*`` for a parent and its children, one ``pid`` label each (``llmgw gateway --workers``).

    With several worker processes each scrape is answered by one of them;
    reporting only its own CPU and memory would show a different process at
    every scrape. This collector reads ``/proc`` for the supervising parent and
    every child of it at scrape time, so any worker reports them all
    (``sum(process_resident_memory_bytes)`` is the whole gateway).
    """

    def __init__(self, parent: int, proc: str = "/proc") -> None:
        self.parent = parent
        self.proc = proc

    def pids(self) -> list[int]:
        """The parent and its live children."""
        found = [self.parent]
        tasks = Path(self.proc, str(self.parent), "task")
        try:
            for task in tasks.iterdir():
                children = (task / "children").read_text().split()
                found += [int(pid) for pid in children if int(pid) not in found]
        except OSError:
            found += [pid for pid in _children_by_scan(self.proc, self.parent) if pid not in found]
        return found

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for pid in self.pids():
            for family in ProcessCollector(pid=lambda pid=pid: pid, proc=self.proc, registry=None).collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "pid": str(pid)}, sample.value)
        yield from families.values()


def _children_by_scan(proc: str, parent: int) -> Iterable[int]:
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            stat = Path(proc, entry, "stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == parent:
            yield int(entry)
