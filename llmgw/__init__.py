"""llmgw: run large language models on a fleet of GPU machines.

The public surface is small: :data:`hookimpl` for plugins, the records in
:mod:`llmgw.models`, the :class:`~llmgw.engine.Engine` base class, and
:mod:`llmgw.testing` for plugin authors.
"""

from __future__ import annotations

from importlib import metadata

import pluggy

__all__ = ["__version__", "hookimpl"]

#: Marks a plugin function as an implementation of an llmgw hook.
hookimpl = pluggy.HookimplMarker("llmgw")

try:
    __version__ = metadata.version("llmgw")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
