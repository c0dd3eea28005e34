"""Parsing the CSV that ``nvidia-smi --query-gpu`` prints."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.models import GPU

__all__ = ["QUERY_FIELDS", "NO_DEVICES", "CsvError", "parse_gpu_csv"]

#: The fields discovery asks for, in the order it asks for them.
QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.free",
    "pci.bus_id",
    "driver_version",
)

#: What nvidia-smi prints (on stdout) when the driver works but lists no GPU.
NO_DEVICES = "No devices were found"

#: Values nvidia-smi prints for a field a GPU cannot report.
_UNAVAILABLE = {"[N/A]", "N/A", "[Not Supported]", "[Unknown Error]"}


class CsvError(ValueError):
    """A line of nvidia-smi output that is not the CSV discovery asked for."""


def parse_gpu_csv(text: str) -> tuple[tuple[GPU, ...], tuple[str, ...]]:
    """Parse ``--format=csv,noheader,nounits`` output of :data:`QUERY_FIELDS`.

    Called by the nvidia plugin on the stdout of a successful run. Spaces after
    commas are ignored, a unit suffix (``81559 MiB``) is tolerated, and a GPU
    name containing commas is kept whole. A memory value nvidia-smi cannot
    report (``[N/A]``, ``[Not Supported]``) counts as 0 MiB and yields a note.

    :returns: the GPUs in output order, and notes (one line each) about values
        that were not available.
    :raises CsvError: naming the line number and text that cannot be parsed.
    """
    if text.strip() == NO_DEVICES:
        return (), ()
    gpus: list[GPU] = []
    notes: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        gpu, line_notes = _parse_line(number, line)
        gpus.append(gpu)
        notes.extend(line_notes)
    return tuple(gpus), tuple(notes)


def _parse_line(number: int, line: str) -> tuple[GPU, list[str]]:
    def fail(reason: str) -> CsvError:
        return CsvError(f"cannot parse line {number} of its output {line!r}: {reason}")

    head = line.split(",", 2)
    tail = head[-1].rsplit(",", 4) if len(head) == 3 else []
    if len(head) != 3 or len(tail) != 5:
        expected = ", ".join(QUERY_FIELDS)
        raise fail(f"expected {len(QUERY_FIELDS)} comma-separated fields ({expected})")
    values = [v.strip() for v in head[:2] + tail]
    index_text, uuid, name, total_text, free_text, bus_id, driver = values
    if not index_text.isdigit():
        raise fail(f"index {index_text!r} is not a number")
    index = int(index_text)
    for field, value in (("uuid", uuid), ("name", name), ("pci.bus_id", bus_id)):
        if not value or value in _UNAVAILABLE:
            raise fail(f"{field} is {repr(value) if value else 'empty'}, expected a value")
    notes: list[str] = []
    total = _memory(index, uuid, "memory.total", total_text, notes, fail)
    free = _memory(index, uuid, "memory.free", free_text, notes, fail)
    gpu = GPU(
        index=index,
        uuid=uuid,
        name=name,
        memory_total_mib=total,
        memory_free_mib=free,
        pci_bus_id=bus_id,
        driver_version=driver,
    )
    return gpu, notes


def _memory(
    index: int, uuid: str, field: str, text: str, notes: list[str], fail: Callable[[str], CsvError]
) -> int:
    if text in _UNAVAILABLE:
        notes.append(
            f"nvidia-smi reports {field} of GPU {index} ({uuid}) as {text}; counted as 0 MiB, "
            "so profiles with min_gpu_memory_mib will not use it"
        )
        return 0
    number = text.removesuffix("MiB").strip()
    if not number.isdigit():
        raise fail(f"{field} {text!r} is not a number of MiB")
    return int(number)
