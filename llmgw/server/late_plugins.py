"""Plugins installed after this server started, which it has not loaded: named when a catalog needs one.

The server loads its plugins (and so its engines) once, when it starts. A
distribution installed later (``pip install llmgw-engine-foo``) is seen by
``llmgw ctl validate``, which runs in a new process, but not by the running
server, whose ``apply`` then says that no plugin provides the engine. This
module takes a record of the ``llmgw`` entry points when the server's code is
imported, and :func:`installed_since_start` names those that appeared since,
from the installed metadata (nothing is imported).
"""

from __future__ import annotations

from importlib import metadata

from llmgw.plugins import ENTRY_POINT_GROUP

__all__ = ["installed_since_start", "late_plugin_note"]


def _entry_points() -> dict[tuple[str, str], str]:
    """``(entry point name, distribution) -> version`` of every installed ``llmgw`` plugin."""
    found = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        found[(ep.name, dist.name if dist else "?")] = dist.version if dist else "?"
    return found


_AT_START = _entry_points()


def installed_since_start() -> list[str]:
    """``DISTRIBUTION VERSION`` of each plugin installed (or upgraded) since this process started."""
    now = _entry_points()
    return sorted(
        {
            f"{dist} {version}"
            for (name, dist), version in now.items()
            if _AT_START.get((name, dist)) != version
        }
    )


def late_plugin_note(problems: list[str]) -> str | None:
    """A line to add to a catalog's problems when it names a missing engine and plugins came since start.

    Called by the server when a catalog fails to validate; None when no engine is missing or nothing
    was installed since the server started.
    """
    if not any("no plugin provides engine" in problem for problem in problems):
        return None
    late = installed_since_start()
    if not late:
        return None
    return (
        f"plugins installed after this server started, which it has not loaded: {', '.join(late)}; a server "
        "loads its plugins when it starts: restart it (every server, when there are several) to use them"
    )
