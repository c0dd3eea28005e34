"""The errors llmgw shows to its users.

Every error an operator can cause or fix subclasses :class:`LlmgwError`; the
CLI prints its message and exits with its ``exit_code``. Anything else that
escapes is a bug in llmgw.
"""

from __future__ import annotations

__all__ = [
    "LlmgwError",
    "CatalogError",
    "PluginError",
    "DuplicateEngineError",
    "UnknownEngineError",
    "FabricError",
]


class LlmgwError(Exception):
    """An error the user can act on; its message says what to do."""

    exit_code = 1


class CatalogError(LlmgwError):
    """A catalog that does not validate; ``problems`` holds one line per mistake."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = "\n".join(f"  {problem}" for problem in self.problems)
        count = len(self.problems)
        noun = "error" if count == 1 else "errors"
        super().__init__(f"{source}: {count} {noun}\n{lines}")


class PluginError(LlmgwError):
    """A plugin that breaks a rule of the plugin contract."""


class DuplicateEngineError(PluginError):
    """Two plugins registered an engine under the same name."""


class UnknownEngineError(LlmgwError):
    """An engine name that no installed plugin provides."""


class FabricError(LlmgwError):
    """A ``--fabric`` declaration this node's adapters cannot satisfy."""
