"""How every long-running llmgw process logs: one line per record on stderr, as text or as JSON.

``llmgw server``, ``gateway`` (its ``--workers`` too: they inherit the
parent's setup when forked) and ``agent`` take ``--log-format text|json``,
``--log-level`` and ``-v`` (:class:`llmgw.settings.LogSettings`) and call
:func:`configure_logging` once, before anything starts; ``llmgw-sim`` takes
the same two flags. A JSON line is one object::

    {"time": "2026-12-03T09:14:07.123Z", "level": "info", "logger": "llmgw.gateway",
     "message": "...", "pid": 4242, "replica": "chat-0"}

``time`` is UTC (RFC 3339, milliseconds), ``level`` one of the ``--log-level``
names, every ``extra=`` field of the call is a key of its own (values JSON
cannot hold are written as their ``str``), and a traceback is in
``exception``. The formatter is the standard library's ``logging.Formatter``
and ``json``: python-json-logger would add a dependency for the same thirty
lines, and its field names need configuring to come out like these.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

__all__ = [
    "LOG_FORMATS",
    "LOG_LEVELS",
    "TEXT_FORMAT",
    "JsonFormatter",
    "configure_logging",
    "configured",
    "current_format",
]

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
#: the text line of every llmgw process
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
#: loggers of libraries that log every request at INFO: quiet unless the level is debug
_CHATTY = ("httpx", "httpx2", "httpcore", "hpack")  # httpx2: huggingface_hub's HTTP client
#: what every LogRecord has: anything else on a record came from ``extra=``
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, pid, the ``extra=`` fields, a traceback.

    ``fields`` are written in every line (``llmgw-sim`` adds its rank).
    """

    def __init__(self, fields: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON (no newline inside, whatever the message holds)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        doc: dict[str, Any] = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
            **self.fields,
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in doc:
                doc[key] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


class _Handler(logging.StreamHandler):
    """The handler :func:`configure_logging` installs (so a second call replaces it, not adds one)."""

    log_format = "text"


def configured() -> bool:
    """Whether :func:`configure_logging` has run in this process (or the process it was forked from)."""
    return current_format() is not None


def current_format() -> str | None:
    """The format :func:`configure_logging` set (``text`` or ``json``), or None before it ran."""
    found = [h for h in logging.getLogger().handlers if isinstance(h, _Handler)]
    return found[-1].log_format if found else None


def configure_logging(log_format: str = "text", level: str = "info", stream: TextIO | None = None) -> None:
    """Send every log record from ``level`` up to ``stream`` (stderr) as ``log_format`` lines.

    Called once by each long-running command before it starts anything (and
    again by tests). Below debug, the HTTP libraries' per-request lines are
    left out; Python warnings become log records. In ``json``, an exception
    nothing caught is logged as one JSON line too, not as a bare traceback.

    :raises ValueError: an unknown format or level.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LOG_LEVELS)}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    handler = _Handler(stream if stream is not None else sys.stderr)
    handler.log_format = log_format
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level.upper())
    quiet = level.lower() != "debug"
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.NOTSET)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught if log_format == "json" else sys.__excepthook__


def _log_uncaught(kind: type[BaseException], error: BaseException, trace: Any) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, error, trace)
        return
    logging.getLogger("llmgw").critical("uncaught exception", exc_info=(kind, error, trace))
