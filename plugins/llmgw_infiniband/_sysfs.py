"""Reading RDMA adapters from a sysfs root shaped like ``/sys/class/infiniband``."""

from __future__ import annotations

import re
from pathlib import Path

from llmgw.models import Adapter, AdapterPort

__all__ = ["SysfsError", "read_adapters"]

_GUID = re.compile(r"^[0-9a-fA-F]{4}(:[0-9a-fA-F]{4}){3}$")
_STATE = re.compile(r"^(\d+):\s*([A-Z_]+)$")


class SysfsError(ValueError):
    """A file under the sysfs root that is missing, unreadable or malformed."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        super().__init__(f"{path}: {reason}")


def read_adapters(root: Path) -> tuple[Adapter, ...]:
    """Read every adapter under ``root`` (an existing directory), sorted by name.

    Called by the infiniband plugin once it knows ``root`` exists. Each
    ``<adapter>/`` needs ``node_guid`` and ``ports/<N>/{state,rate,link_layer}``;
    ``state`` reads like ``4: ACTIVE``.

    :returns: the adapters, each with its ports in number order.
    :raises SysfsError: naming the first file that is missing, unreadable or
        not in the expected shape.
    """
    adapters = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            raise SysfsError(entry, "expected a directory per adapter (like mlx5_0/)")
        adapters.append(_read_adapter(entry))
    return tuple(adapters)


def _read_adapter(path: Path) -> Adapter:
    guid = _read(path / "node_guid", "like b859:9f03:00d4:3f2a")
    if not _GUID.match(guid):
        raise SysfsError(path / "node_guid", f"{guid!r} is not a GUID like b859:9f03:00d4:3f2a")
    ports_dir = path / "ports"
    if not ports_dir.is_dir():
        raise SysfsError(ports_dir, "missing: expected a directory with one folder per port (1/)")
    try:
        entries = list(ports_dir.iterdir())
    except OSError as exc:
        raise SysfsError(ports_dir, f"cannot list it ({exc.strerror})") from None
    ports = []
    for entry in entries:
        if not entry.name.isdigit() or not entry.is_dir():
            raise SysfsError(entry, "expected one directory per port, named by its number (1/)")
        ports.append(_read_port(entry))
    return Adapter(name=path.name, node_guid=guid, ports=sorted(ports, key=lambda p: p.number))


def _read_port(path: Path) -> AdapterPort:
    state_text = _read(path / "state", "like '4: ACTIVE'")
    match = _STATE.match(state_text)
    if not match:
        raise SysfsError(path / "state", f"{state_text!r} is not a port state like '4: ACTIVE'")
    return AdapterPort(
        number=int(path.name),
        state=match.group(2),
        rate=_read(path / "rate", "like '400 Gb/sec (4X NDR)'"),
        link_layer=_read(path / "link_layer", "'InfiniBand' or 'Ethernet'"),
    )


def _read(path: Path, expected: str) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except FileNotFoundError:
        raise SysfsError(path, f"missing: expected a file holding a value {expected}") from None
    except OSError as exc:
        raise SysfsError(path, f"cannot read it ({exc.strerror}); expected {expected}") from None
    if not text:
        raise SysfsError(path, f"empty: expected a value {expected}")
    return text
