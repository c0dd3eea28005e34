"""Built-in plugin: RDMA fabric adapter discovery from sysfs.

The agent calls :func:`llmgw_discover_adapters`; it reads
``settings.ib_root`` (default ``/sys/class/infiniband``). A missing root is an
island node (``status="not-found"``), not an error; a root that cannot be read
is ``failed`` with the file named. Tests point ``settings.ib_root`` at a
directory from :func:`llmgw.testing.fakes.write_ib_sysfs`.
"""

from __future__ import annotations

from pathlib import Path

from llmgw import hookimpl
from llmgw.models import AdapterReport, DiscoverySettings

from ._sysfs import SysfsError, read_adapters

__all__ = ["SOURCE", "SysfsError", "discover_adapters", "llmgw_discover_adapters", "read_adapters"]

#: ``AdapterReport.source`` of every report this plugin makes.
SOURCE = "llmgw_infiniband"


def discover_adapters(settings: DiscoverySettings) -> AdapterReport:
    """Read the adapters under ``settings.ib_root``.

    Called by the plugin's hookimpl, in the agent's worker thread.

    :returns: an :class:`AdapterReport`: ``not-found`` when the root does not
        exist (an island node), ``failed`` naming the file that is missing,
        unreadable or malformed, else ``ok`` with 0..N adapters.
    """
    root = Path(settings.ib_root)
    if not root.exists():
        return AdapterReport(
            source=SOURCE,
            status="not-found",
            problem=(
                f"no InfiniBand sysfs at {root} (no RDMA driver loaded): an island node; "
                "pass --ib-root if the adapters are listed elsewhere"
            ),
        )
    if not root.is_dir():
        return _failed(f"{root}: expected a directory of adapters, found a file")
    try:
        adapters = read_adapters(root)
    except SysfsError as exc:
        return _failed(str(exc))
    except OSError as exc:
        return _failed(f"{root}: cannot list it ({exc.strerror})")
    return AdapterReport(source=SOURCE, status="ok", adapters=adapters)


def _failed(message: str) -> AdapterReport:
    return AdapterReport(source=SOURCE, status="failed", problem=f"adapter discovery failed: {message}")


@hookimpl
def llmgw_discover_adapters(settings: DiscoverySettings) -> AdapterReport:
    """Report the RDMA adapters under ``settings.ib_root``; never ``None``."""
    return discover_adapters(settings)
