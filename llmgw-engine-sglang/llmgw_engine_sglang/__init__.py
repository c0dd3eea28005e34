"""llmgw-engine-sglang: the llmgw plugin for SGLang.

It registers :class:`SglangEngine`, which builds ``python -m
sglang.launch_server`` commands for one node, or for every rank of a replica
spanning several nodes as SGLang's multi-node deployment guide has it: the same
command on each node with ``--nnodes``, ``--node-rank`` and rank 0's
``--dist-init-addr``, and ``--tp-size`` counting the GPUs of every node.
"""

from __future__ import annotations

from collections.abc import Sequence

import llmgw
from llmgw.engine import (
    Engine,
    HelpAndVersion,
    LoadMetrics,
    ProgressMetrics,
    openai_canary,
    version_at_least,
)
from llmgw.models import Command, LaunchSpec
from llmgw.version import distribution_version

__all__ = ["CONTINUES_SINCE", "LOAD", "PROGRESS", "SglangEngine", "__version__"]

__version__ = distribution_version("llmgw-engine-sglang")

#: the interpreter's arguments before SGLang's own: the entry point of every checked
#: version (0.5.23 recommends ``sglang serve`` and warns about this one, which still works)
MODULE = ("-m", "sglang.launch_server")

#: the first SGLang release whose chat completions take ``continue_final_message`` (with
#: ``add_generation_prompt: false``): sgl-project/sglang#4226, merged 2025-03-11, released in v0.4.4
CONTINUES_SINCE = "0.4.4"

_FEATURES = {
    "--model-path": "model source",
    "--served-model-name": "served model name",
    "--host": "HTTP address (on workers: their health endpoint)",
    "--port": "HTTP address (on workers: their health endpoint)",
    "--tp-size": "GPUs of the replica (tensor parallelism)",
    "--nnodes": "multi-node rendezvous",
    "--node-rank": "multi-node rendezvous",
    "--dist-init-addr": "multi-node rendezvous",
    "--enable-metrics": "liveness: token counters tell a busy replica from a hung one",
}

#: SGLang's own counters (served at /metrics with --enable-metrics): a canary that waits while
#: they grow found the replica busy, not hung
PROGRESS = ProgressMetrics(
    tokens=("sglang:generation_tokens_total", "sglang:prompt_tokens_total"),
    running=("sglang:num_running_reqs",),
)


#: SGLang's gauges of its queue and KV-cache token pool (with --enable-metrics)
LOAD = LoadMetrics(
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    kv_cache_usage=("sglang:token_usage",),
)


class SglangEngine(Engine):
    """Builds ``python -m sglang.launch_server`` commands: single-node, rank 0, and workers."""

    name = "sglang"
    #: SGLang releases whose launch_server help documents every flag used here
    checked_versions = ("0.5.3", "0.5.23")
    multi_node = True
    #: 503 while the server starts; then 200 only when a one-token generation
    #: succeeds (unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is off)
    health_path = "/health"
    #: the Python interpreter of SGLang's environment
    programs = ("python",)
    #: the help is the module's; ``python --version`` would be Python's: ask the sglang package
    help_and_version = {
        "python": HelpAndVersion(
            help_args=(*MODULE, "--help"), version_args=("-c", "import sglang; print(sglang.__version__)")
        )
    }
    flag_features = _FEATURES
    #: /health can stay 200 with a hung scheduler: a one-token completion, judged by SGLang's counters
    liveness_probe = openai_canary(PROGRESS)
    load_metrics = LOAD

    def continues_final_message(self, version: str | None, args: Sequence[str]) -> bool:
        """SGLang from :data:`CONTINUES_SINCE` continues a final assistant message (any arguments)."""
        return version_at_least(version, CONTINUES_SINCE)

    def build_command(self, spec: LaunchSpec) -> Command:
        """Build the ``sglang.launch_server`` command of one shard.

        Every rank gets the same command but for ``--node-rank`` and its own
        ``--host``/``--port``: rank 0 serves the API there, a worker only a
        health endpoint (SGLang's dummy health server on non-zero ranks).
        ``--tp-size`` is the GPUs of one node times the nodes; several nodes
        add ``--nnodes``, ``--node-rank`` and rank 0's ``--dist-init-addr``.
        ``--enable-metrics`` serves the token counters the liveness probe
        reads. The profile's args come last, on every rank.
        """
        tp_size = max(len(spec.gpus), 1) * spec.nnodes
        argv = [
            self.program_path(spec, "python"),
            *MODULE,
            "--model-path",
            spec.model_source,
            "--served-model-name",
            spec.served_name,
            "--host",
            spec.host,
            "--port",
            str(spec.port),
            "--enable-metrics",
            "--tp-size",
            str(tp_size),
        ]
        if spec.nnodes > 1:
            argv += [
                "--nnodes",
                str(spec.nnodes),
                "--node-rank",
                str(spec.rank),
                "--dist-init-addr",
                str(spec.dist_init_addr),
            ]
        argv += spec.extra_args
        return Command(argv=argv, env=self.device_env(spec))

    def option_args(self, command: Command) -> tuple[str, ...]:
        """The arguments after ``python -m sglang.launch_server``: the ones SGLang's help documents."""
        return tuple(command.argv[1 + len(MODULE) :])


@llmgw.hookimpl
def llmgw_register_engines() -> list[Engine]:
    """Register the SGLang engine, ``engine: sglang`` in a catalog."""
    return [SglangEngine()]
