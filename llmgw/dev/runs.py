"""What one run of a local cluster leaves in its state dir: its logs, and the processes it started.

Each :class:`~llmgw.dev.cluster.LocalCluster` writes its processes' logs to a
folder of its own, ``logs/<UTC time>``, with ``logs/latest`` pointing at it;
the :data:`KEEP_RUNS` most recent folders are kept, older ones removed. So a
run's logs never mix with an earlier run's.

It also records every process it starts (pid and start time) in
``processes.json``. A run that was not stopped (``llmgw dev`` killed with
SIGKILL, a machine that went to sleep in a test) leaves its server, agents
and gateway running, holding their ports; the next run on that state dir ends
them first (:func:`stop_leftovers`), so it never meets "Address already in use"
from its own predecessor.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import time
from datetime import UTC, datetime
from pathlib import Path

from llmgw.agent.launcher import group_members
from llmgw.agent.records import ProcessRecords, end_groups

__all__ = ["KEEP_RUNS", "new_log_dir", "record_process", "stop_leftovers", "forget_processes", "port_in_use"]

#: how many runs' log folders are kept under ``<state dir>/logs``
KEEP_RUNS = 10

_RECORD = "processes.json"
_RUN_NAME = re.compile(r"(\d{8}T\d{6}Z)(?:-(\d+))?")


def new_log_dir(state_dir: Path) -> Path:
    """Make this run's log folder in ``state_dir/logs``, point ``logs/latest`` at it, drop old ones.

    :returns: the new folder (``logs/20261203T091500Z``; ``-2``, ``-3``... for later runs in that second)
    """
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    this_second = [order[1] for order in map(_run_order, logs.iterdir()) if order and order[0] == stamp]
    n = max(this_second, default=0) + 1
    while True:  # after every run of this second (another process may take a name meanwhile)
        run = logs / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            run.mkdir()
            break
        except FileExistsError:
            n += 1
    latest = logs / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    latest.symlink_to(run.name)
    for old in sorted(filter(None, map(_run_order, logs.iterdir())))[:-KEEP_RUNS]:
        shutil.rmtree(old[2], ignore_errors=True)
    for stray in logs.glob("*.log"):  # logs of runs from before folders per run
        stray.unlink(missing_ok=True)
    return run


def _run_order(folder: Path) -> tuple[str, int, Path] | None:
    """``(time, n, folder)`` for a run's log folder (``20261203T091500Z-2``), None for anything else."""
    found = _RUN_NAME.fullmatch(folder.name)
    if not found or folder.is_symlink() or not folder.is_dir():
        return None
    return found[1], int(found[2] or 1), folder


def _start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22); None: gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def record_process(state_dir: Path, name: str, pid: int) -> None:
    """Add process ``pid`` (``name``: server, agent-node-1, gateway...) to the state dir's record.

    Called right after each process of the cluster starts.
    """
    path = state_dir / _RECORD
    entries = _read(path)
    entries.append({"name": name, "pid": pid, "start_time": _start_time(pid)})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1) + "\n")
    tmp.replace(path)


def _read(path: Path) -> list[dict]:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return entries if isinstance(entries, list) else []


def stop_leftovers(state_dir: Path, grace: float = 15.0) -> list[str]:
    """End every process an earlier run on ``state_dir`` recorded that still runs, and forget the record.

    Each recorded process leads its own process group; its group gets SIGTERM (gateways, then agents, then
    servers), and SIGKILL after ``grace`` seconds; then the engines the agents left (their records). A pid
    now used by another program (its start time differs) is left alone. Called when a local cluster is
    made, before it starts anything.

    :returns: ``name (pid N)`` of each process that was ended
    """
    path = state_dir / _RECORD
    alive = [
        e
        for e in _read(path)
        if isinstance(e, dict)
        and isinstance(e.get("pid"), int)
        and _start_time(e["pid"]) == e.get("start_time")
    ]
    known = {e["pid"] for e in alive}
    alive += [{"name": name, "pid": pid} for pid, name in _unrecorded(state_dir) if pid not in known]
    order = {"gateway": 0, "server": 2}
    alive.sort(key=lambda e: order.get(str(e.get("name", "")).split("-")[0], 1))
    for entry in alive:
        _signal_group(entry["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_group_runs(e["pid"]) for e in alive):
        time.sleep(0.1)
    for entry in alive:
        if _group_runs(entry["pid"]):
            _signal_group(entry["pid"], signal.SIGKILL)
    for run_dir in state_dir.glob("nodes/*/agent/run"):
        # stopped agents leave their engines for the next agent to adopt: these are ended for good
        records = ProcessRecords(run_dir)
        end_groups(records, records.group_records(), grace)
    path.unlink(missing_ok=True)
    return [f"{e.get('name')} (pid {e['pid']})" for e in alive]


def _unrecorded(state_dir: Path) -> list[tuple[int, str]]:
    """``(pid, name)`` of llmgw server, agent and gateway processes of ``state_dir`` leading their own group.

    A run killed with SIGKILL between starting a process and recording it leaves one the record does not
    name; its command line names files under the state dir (``--state-dir``, ``--cert``).
    """
    marker = str(state_dir.resolve()) + "/"
    found = []
    for entry in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            pid = int(entry.parent.name)
            argv = entry.read_bytes().decode(errors="replace").split("\0")
            if pid == os.getpid() or os.getpgid(pid) != pid or _start_time(pid) is None:
                continue
        except (OSError, ValueError):
            continue
        role = next((a for a in argv if a in ("server", "agent", "gateway")), None)
        if role is not None and any(marker in a for a in argv) and any(a.endswith("llmgw") for a in argv):
            found.append((pid, role))
    return found


def forget_processes(state_dir: Path) -> None:
    """Drop the record of processes; called once every process of a cluster was stopped and waited for."""
    (state_dir / _RECORD).unlink(missing_ok=True)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_runs(pgid: int) -> bool:
    return bool(group_members(pgid))


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` (a connection is accepted)."""
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0
