"""Running nvidia-smi and turning what happened into a :class:`GpuReport`."""

from __future__ import annotations

import os
import shutil
import subprocess

from llmgw.models import DiscoverySettings, GpuReport

from ._parse import NO_DEVICES, QUERY_FIELDS, CsvError, parse_gpu_csv

__all__ = ["SOURCE", "query_argv", "discover_gpus"]

#: ``GpuReport.source`` of every report this plugin makes.
SOURCE = "llmgw_nvidia"


def query_argv(program: str) -> list[str]:
    """The argv discovery runs: ``program`` with the query of :data:`QUERY_FIELDS`."""
    return [program, "--query-gpu=" + ",".join(QUERY_FIELDS), "--format=csv,noheader,nounits"]


def discover_gpus(settings: DiscoverySettings) -> GpuReport:
    """Run ``settings.nvidia_smi`` (no shell, ``settings.timeout``) and report.

    Called by the plugin's hookimpl, in the agent's worker thread.

    :returns: a :class:`GpuReport` with ``status`` ``not-found`` (the program
        is missing, not on PATH, or not executable), ``failed`` (it exited
        non-zero, timed out or printed lines that are not the CSV asked for;
        the problem starts with ``nvidia-smi failed:``), or ``ok`` with 0..N
        GPUs (``problem`` then holds notes on values nvidia-smi could not give).
    """
    program, missing = _locate(settings.nvidia_smi)
    if program is None:
        return GpuReport(source=SOURCE, status="not-found", problem=missing)
    argv = query_argv(program)
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            encoding="utf-8",
            errors="replace",
            timeout=settings.timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return _failed(
            f"no answer within {settings.timeout:g} s (ran {' '.join(argv)}); "
            "a hung driver does this: check dmesg, or raise the discovery timeout"
        )
    except OSError as exc:  # vanished, or its interpreter/format cannot be executed
        return GpuReport(
            source=SOURCE,
            status="not-found",
            problem=f"nvidia-smi not found at {program}: cannot execute it ({exc.strerror})",
        )
    said = " ".join(line.strip() for line in (proc.stdout + "\n" + proc.stderr).splitlines())
    said = " ".join(said.split())
    if proc.returncode != 0:
        if said == NO_DEVICES:
            return GpuReport(source=SOURCE, status="ok")
        message = said or "it printed nothing"
        return _failed(f"{message} (exit code {proc.returncode}, ran {program})")
    try:
        gpus, notes = parse_gpu_csv(proc.stdout)
    except CsvError as exc:
        return _failed(f"{exc} (ran {' '.join(argv)})")
    return GpuReport(source=SOURCE, status="ok", gpus=gpus, problem="; ".join(notes) or None)


def _failed(message: str) -> GpuReport:
    return GpuReport(source=SOURCE, status="failed", problem=f"nvidia-smi failed: {message}")


def _locate(program: str) -> tuple[str | None, str | None]:
    """The path to run, or None and why it cannot be run."""
    if os.sep not in program:
        found = shutil.which(program)
        if found is None:
            search = os.environ.get("PATH", "")
            return None, (
                f"nvidia-smi not found at PATH: no executable {program!r} in {search or '(empty)'}; "
                "install the NVIDIA driver or pass --nvidia-smi /path/to/nvidia-smi"
            )
        return found, None
    if not os.path.exists(program):
        return None, (
            f"nvidia-smi not found at {program}: no such file; pass --nvidia-smi with the path of nvidia-smi"
        )
    if os.path.isdir(program):
        return None, f"nvidia-smi not found at {program}: it is a directory, expected the program"
    if not os.access(program, os.X_OK):
        return None, (
            f"nvidia-smi not found at {program}: the file is not executable (chmod +x it, "
            "or pass --nvidia-smi with the real nvidia-smi)"
        )
    return program, None
