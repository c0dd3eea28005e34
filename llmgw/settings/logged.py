"""The log settings every long-running process has: ``log_format`` and ``log_level`` (and ``-v``)."""

from __future__ import annotations

import attrs

from llmgw.logs import LOG_FORMATS, LOG_LEVELS
from llmgw.settings.fields import setting

__all__ = ["LogSettings"]


@attrs.frozen(kw_only=True)
class LogSettings:
    """The base of a process's settings class: how it logs (:mod:`llmgw.logs`)."""

    log_format: str = setting(
        "text",
        choices=LOG_FORMATS,
        env="LLMGW_LOG_FORMAT",
        help="Log lines as text or as JSON objects (time, level, logger, message, fields).",
    )
    log_level: str = setting(
        "info", choices=LOG_LEVELS, env="LLMGW_LOG_LEVEL", help="Log from this level up (-v: debug)."
    )
