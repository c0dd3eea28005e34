"""What the agent makes of the server's answers, its own errors, and its certificate files."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

__all__ = ["describe", "error_type", "server_message", "file_stamp"]


def file_stamp(*paths: Path) -> tuple:
    """What tells a rewritten file from the one read before: inode, size and mtime of each (None if gone)."""
    stamps = []
    for path in paths:
        try:
            info = path.stat()
        except OSError:
            stamps.append(None)
            continue
        stamps.append((info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(stamps)


def describe(exc: BaseException) -> str:
    """``exc`` for a log line: its type, message and cause (``no answer in time`` for a timeout)."""
    if isinstance(exc, trio.TooSlowError):
        return "no answer in time"
    text = str(exc) or type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) and str(cause) not in text:
        text = f"{text} ({cause})"
    return f"{type(exc).__name__}: {text}"


def error_type(response: httpx.Response) -> str | None:
    """The ``type`` of the server's ErrorReply (``revoked``...), or None."""
    try:
        return str(response.json()["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return None


def server_message(response: httpx.Response) -> str:
    """The message of the server's ErrorReply, else the start of the body or the reason phrase."""
    try:
        data = response.json()
        return str(data["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300] or response.reason_phrase
