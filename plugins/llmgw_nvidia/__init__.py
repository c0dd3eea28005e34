"""Built-in plugin: GPU discovery with ``nvidia-smi``.

The agent calls :func:`llmgw_discover_gpus`; it runs ``settings.nvidia_smi
--query-gpu=... --format=csv,noheader,nounits`` and tells "not there",
"failed" and "found N GPUs" apart (see :class:`llmgw.models.GpuReport`).
Tests point ``settings.nvidia_smi`` at a script from
:func:`llmgw.testing.fakes.write_fake_nvidia_smi`.
"""

from __future__ import annotations

from llmgw import hookimpl
from llmgw.models import DiscoverySettings, GpuReport

from ._parse import NO_DEVICES, QUERY_FIELDS, CsvError, parse_gpu_csv
from ._run import SOURCE, discover_gpus, query_argv

__all__ = [
    "NO_DEVICES",
    "QUERY_FIELDS",
    "SOURCE",
    "CsvError",
    "discover_gpus",
    "llmgw_discover_gpus",
    "parse_gpu_csv",
    "query_argv",
]


@hookimpl
def llmgw_discover_gpus(settings: DiscoverySettings) -> GpuReport:
    """Report this node's GPUs as ``nvidia-smi`` lists them; never ``None``."""
    return discover_gpus(settings)
