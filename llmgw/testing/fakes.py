"""Fake hardware for tests: an ``nvidia-smi`` script and a sysfs InfiniBand tree.

For users and plugin authors testing on machines with no GPU and no
InfiniBand. Point discovery at them the way an operator would::

    from llmgw.models import DiscoverySettings
    from llmgw.testing.fakes import make_gpus, write_fake_nvidia_smi, write_ib_sysfs

    smi = write_fake_nvidia_smi(tmp_path / "nvidia-smi", make_gpus(8))
    ib = write_ib_sysfs(tmp_path / "ib", {"mlx5_0": "ACTIVE", "mlx5_1": "DOWN"})
    settings = DiscoverySettings(nvidia_smi=str(smi), ib_root=str(ib))

or on the command line: ``llmgw discover --nvidia-smi PATH --ib-root DIR``.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from llmgw.models import GPU, Adapter, AdapterPort

__all__ = [
    "DRIVER_FAILURE",
    "PORT_STATES",
    "make_adapters",
    "make_gpus",
    "write_fake_nvidia_smi",
    "write_ib_sysfs",
]

#: What a real nvidia-smi prints (on stdout, exit code 9) when the driver is not loaded.
DRIVER_FAILURE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)

#: Port state words and the numbers sysfs prints before them (``4: ACTIVE``).
PORT_STATES: Mapping[str, int] = {
    "NOP": 0,
    "DOWN": 1,
    "INIT": 2,
    "ARMED": 3,
    "ACTIVE": 4,
    "ACTIVE_DEFER": 5,
}

# The fake's program; the data it lists is prepended as FAKE (a JSON string).
_SCRIPT = r"""
import json
import sys
import time

FAKE = json.loads(FAKE)
UNITS = {"memory.total": "MiB", "memory.free": "MiB", "memory.used": "MiB"}
ALIASES = {"gpu_name": "name", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id"}
FIELDS = {"index", "uuid", "name", "memory.total", "memory.free", "memory.used",
          "pci.bus_id", "driver_version", "count"}
USAGE = "Please run 'nvidia-smi -h' for help."


def value(gpu, field, gpus):
    if field == "count":
        return str(len(gpus))
    if field == "memory.used":
        return str(gpu["memory.total"] - gpu["memory.free"])
    return str(gpu[field])


def main(argv):
    if FAKE["hang"]:
        while True:
            time.sleep(3600)
    if FAKE["fail"] is not None:
        print(FAKE["fail"])
        return FAKE["exit_code"]
    if FAKE["output"] is not None:
        sys.stdout.write(FAKE["output"])
        return 0
    query = fmt = None
    list_gpus = False
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg.startswith("--query-gpu="):
            query = arg.partition("=")[2]
        elif arg == "--query-gpu" and args:
            query = args.pop(0)
        elif arg.startswith("--format="):
            fmt = arg.partition("=")[2]
        elif arg == "--format" and args:
            fmt = args.pop(0)
        elif arg in ("-L", "--list-gpus"):
            list_gpus = True
        else:
            print(f"Invalid combination of input arguments. {USAGE}")
            return 2
    gpus = FAKE["gpus"]
    if query is not None:
        if fmt is None:
            print(f'"--format" has to be specified when querying. {USAGE}')
            return 2
        options = fmt.split(",")
        for option in options:
            if option not in ("csv", "noheader", "nounits"):
                print(f'"{option}" is not a valid format option. {USAGE}')
                return 2
        if "csv" not in options:
            print(f'"--format" needs "csv". {USAGE}')
            return 2
        asked = [f.strip() for f in query.split(",")]
        for field in asked:
            if ALIASES.get(field, field) not in FIELDS:
                print(f'Field "{field}" is not a valid field to query.')
                print()
                print(USAGE)
                return 2
    if not gpus:
        print("No devices were found")
        return 6
    if list_gpus or query is None:
        for gpu in gpus:
            print(f"GPU {gpu['index']}: {gpu['name']} (UUID: {gpu['uuid']})")
        return 0
    canonical = [ALIASES.get(f, f) for f in asked]
    if "noheader" not in options:
        names = [f + (f" [{UNITS[c]}]" if c in UNITS else "") for f, c in zip(asked, canonical)]
        print(", ".join(names))
    for gpu in gpus:
        values = []
        for field in canonical:
            text = value(gpu, field, gpus)
            if field in UNITS and "nounits" not in options:
                text += " " + UNITS[field]
            values.append(text)
        print(", ".join(values))
    return 0


sys.exit(main(sys.argv[1:]))
"""


def make_gpus(
    n: int,
    name: str = "NVIDIA H100 80GB HBM3",
    memory_mib: int = 81559,
    *,
    seed: str = "node",
    driver_version: str = "550.54.15",
) -> list[GPU]:
    """Make ``n`` identical GPUs with indexes 0..n-1, all memory free.

    UUIDs derive from ``seed`` and the index, so two fake nodes given
    different seeds never share a GPU UUID, and the same seed always gives
    the same UUIDs.

    :returns: a list of :class:`~llmgw.models.GPU`.
    """
    gpus = []
    for index in range(n):
        digest = hashlib.sha256(f"{seed}/{index}".encode()).digest()
        gpus.append(
            GPU(
                index=index,
                uuid=f"GPU-{uuid.UUID(bytes=digest[:16])}",
                name=name,
                memory_total_mib=memory_mib,
                memory_free_mib=memory_mib,
                pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
                driver_version=driver_version,
            )
        )
    return gpus


def write_fake_nvidia_smi(
    path: str | Path,
    gpus: Sequence[GPU] | None = None,
    *,
    fail: str | None = None,
    exit_code: int = 9,
    output: str | None = None,
    hang: bool = False,
) -> Path:
    """Write an executable script at ``path`` that behaves like ``nvidia-smi``.

    It honours ``--query-gpu=FIELDS`` (fields in the order asked: ``index``,
    ``uuid``, ``name``, ``memory.total``, ``memory.free``, ``memory.used``,
    ``pci.bus_id``, ``driver_version``, ``count``) and
    ``--format=csv[,noheader][,nounits]``, and ``-L``. Like the real one, it
    prints ``No devices were found`` and exits 6 when ``gpus`` is empty or
    ``None``, and rejects an unknown field with exit code 2.

    :param gpus: what it lists (see :func:`make_gpus`); ``None`` lists none.
    :param fail: a message to print on stdout before exiting with
        ``exit_code``, as the real one does when the driver is gone
        (:data:`DRIVER_FAILURE`, exit code 9).
    :param output: text to print verbatim (exit code 0) instead of answering
        the query, for testing parsers against odd output.
    :param hang: never answer, as nvidia-smi does on a hung driver, for
        testing timeouts (the caller must kill it).
    :returns: the script's path. It runs this interpreter
        (``sys.executable``) through ``/bin/sh``.
    """
    path = Path(path)
    data = {
        "gpus": [_gpu_record(gpu) for gpu in gpus or ()],
        "fail": fail,
        "exit_code": exit_code,
        "output": output,
        "hang": hang,
    }
    # A file that is both a shell script and Python: sh execs the interpreter
    # on this file; Python sees the exec line as a string literal.
    header = f"#!/bin/sh\n''''exec {shlex.quote(sys.executable)} \"$0\" \"$@\" # '''\n"
    path.write_text(header + f"FAKE = {json.dumps(data)!r}\n" + _SCRIPT, encoding="utf-8")
    path.chmod(0o755)
    return path


def _gpu_record(gpu: GPU) -> dict[str, object]:
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "memory.total": gpu.memory_total_mib,
        "memory.free": gpu.memory_free_mib,
        "pci.bus_id": gpu.pci_bus_id,
        "driver_version": gpu.driver_version,
    }


def make_adapters(
    spec: Mapping[str, str | Sequence[str]],
    *,
    rate: str = "400 Gb/sec (4X NDR)",
    link_layer: str = "InfiniBand",
) -> list[Adapter]:
    """Make adapters from ``{"mlx5_0": "ACTIVE", "mlx5_1": ["ACTIVE", "DOWN"]}``.

    A string is the state of port 1; a sequence gives ports 1..N in order.
    Node GUIDs derive from the adapter name.

    :returns: a list of :class:`~llmgw.models.Adapter`, in the mapping's order.
    :raises ValueError: a state that is not one of :data:`PORT_STATES`.
    """
    adapters = []
    for name, states in spec.items():
        states = [states] if isinstance(states, str) else list(states)
        ports = []
        for number, state in enumerate(states, start=1):
            if state not in PORT_STATES:
                known = ", ".join(PORT_STATES)
                raise ValueError(f"adapter {name} port {number}: state {state!r}; use one of {known}")
            ports.append(AdapterPort(number=number, state=state, rate=rate, link_layer=link_layer))
        adapters.append(Adapter(name=name, node_guid=_guid(name), ports=ports))
    return adapters


def write_ib_sysfs(
    root: str | Path, adapters: Mapping[str, str | Sequence[str]] | Sequence[Adapter]
) -> Path:
    """Write a directory shaped like ``/sys/class/infiniband`` under ``root``.

    For each adapter: ``<name>/node_guid``, ``<name>/node_type`` and
    ``<name>/ports/<N>/{state,phys_state,rate,link_layer}``, with contents as
    the kernel writes them (``4: ACTIVE``). ``adapters`` is a list of
    :class:`~llmgw.models.Adapter` or the mapping :func:`make_adapters` takes.

    :returns: ``root``, to pass as ``--ib-root`` or ``DiscoverySettings.ib_root``.
    """
    root = Path(root)
    if isinstance(adapters, Mapping):
        adapters = make_adapters(adapters)
    root.mkdir(parents=True, exist_ok=True)
    for adapter in adapters:
        base = root / adapter.name
        (base / "ports").mkdir(parents=True, exist_ok=True)
        (base / "node_guid").write_text(adapter.node_guid + "\n")
        (base / "node_type").write_text("1: CA\n")
        for port in adapter.ports:
            port_dir = base / "ports" / str(port.number)
            port_dir.mkdir(parents=True, exist_ok=True)
            number = PORT_STATES.get(port.state, 0)
            physical = "5: LinkUp" if port.state in ("ACTIVE", "ARMED", "INIT") else "3: Disabled"
            (port_dir / "state").write_text(f"{number}: {port.state}\n")
            (port_dir / "phys_state").write_text(physical + "\n")
            (port_dir / "rate").write_text(port.rate + "\n")
            (port_dir / "link_layer").write_text(port.link_layer + "\n")
    return root


def _guid(name: str) -> str:
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return ":".join(digest[i : i + 4] for i in range(0, 16, 4))
