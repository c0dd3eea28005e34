"""llmgw-engine-sglang: the llmgw plugin for SGLang.

It registers :class:`SglangEngine`, which builds ``python -m
sglang.launch_server`` commands for one node, or for every rank of a replica
spanning several nodes as SGLang's multi-node deployment guide has it: the same
command on each node with ``--nnodes``, ``--node-rank`` and rank 0's
``--dist-init-addr``, and ``--tp-size`` counting the GPUs of every node.

LoRA adapters (a model with ``adapters:``, ``spec.lora`` set), as SGLang's "LoRA
Serving" guide has dynamic loading: every rank gets ``--enable-lora``,
``--max-lora-rank R`` and ``--lora-target-modules all`` (given at start, as the
guide advises when no ``--lora-paths`` fixes them), ``--max-loras-per-batch N+1``
(SGLang counts base-model requests as one adapter of a batch, so N adapters and
the base model share one) and ``--max-loaded-loras N+1`` (it must be at least the
per-batch value; llmgw itself keeps at most N loaded). Adapters are loaded and
unloaded on the running replica with ``POST /load_lora_adapter`` and
``/unload_lora_adapter``; a request names one with ``lora_path`` (the adapter's
name) beside the base model's ``model``, which every checked version takes on
its OpenAI endpoints. ``model: "BASE:ADAPTER"`` is read only from 0.5.4
(sgl-project/sglang#11570, October 2025), so it is not used. Both checked
versions document every LoRA flag used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

import llmgw
from llmgw.engine import (
    Engine,
    HelpAndVersion,
    HttpCall,
    LoadMetrics,
    openai_canary,
    rendezvous_args,
    serving_args,
    version_at_least,
)
from llmgw.models import Command, LaunchSpec, LoraSpec
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
    "--enable-lora": "LoRA adapters",
    "--max-lora-rank": "LoRA adapters (max_adapter_rank)",
    "--lora-target-modules": "LoRA adapters (any target module, for adapters loaded at run time)",
    "--max-loras-per-batch": "LoRA adapters (max_adapters, plus the base model)",
    "--max-loaded-loras": "LoRA adapters (max_adapters)",
}

#: seconds a load may take: SGLang reads the adapter's weights from disk
LORA_LOAD_TIMEOUT = 120.0

#: SGLang's gauges of its queue and KV-cache token pool (served at /metrics with --enable-metrics)
LOAD = LoadMetrics(
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    kv_cache_usage=("sglang:token_usage",),
)
#: SGLang's own token counters beside them: a canary that waits while they grow found the replica busy,
#: not hung
PROGRESS = LOAD.progress(tokens=("sglang:generation_tokens_total", "sglang:prompt_tokens_total"))


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
    serves_lora = True

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
        reads. With ``spec.lora`` every rank also gets SGLang's LoRA flags
        (see the module's docstring). The profile's args come last, on every rank.
        """
        tp_size = max(len(spec.gpus), 1) * spec.nnodes
        argv = [self.program_path(spec, "python"), *MODULE, *serving_args(spec, model="--model-path")]
        argv += ["--enable-metrics", "--tp-size", str(tp_size), *rendezvous_args(spec)]
        if spec.lora is not None:
            slots = str(spec.lora.max_loaded + 1)
            argv += [
                "--enable-lora",
                "--max-lora-rank",
                str(spec.lora.max_rank),
                "--lora-target-modules",
                "all",
                "--max-loras-per-batch",
                slots,
                "--max-loaded-loras",
                slots,
            ]
        argv += spec.extra_args
        return Command(argv=argv, env=self.device_env(spec))

    def widest_spec(self) -> LaunchSpec:
        """The default multi-node widest spec with LoRA adapters, so engine-check checks their flags."""
        return attrs.evolve(super().widest_spec(), lora=LoraSpec(max_loaded=4, max_rank=16))

    def lora_load(self, name: str, path: str) -> HttpCall:
        """``POST /load_lora_adapter {"lora_name", "lora_path"}``.

        Called by the agent when the server asks a replica to load adapter ``name`` from ``path``.
        :returns: the call; SGLang answers 200 with ``{"success": true, ...}``, or 400 with the reason in
        ``error_message``.
        """
        return HttpCall(
            "POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout=LORA_LOAD_TIMEOUT
        )

    def lora_unload(self, name: str) -> HttpCall:
        """``POST /unload_lora_adapter {"lora_name"}``.

        Called by the agent when the server asks a replica to unload adapter ``name``. :returns: the call.
        """
        return HttpCall("POST", "/unload_lora_adapter", {"lora_name": name}, timeout=30.0)

    def lora_request_fields(self, name: str, served_name: str, known: Sequence[str]) -> Mapping[str, object]:
        """``{"model": served_name, "lora_path": name}``: the base model, and the adapter by its loaded name.

        Called by the server for each adapter loaded on a replica, as it builds the routes feed; the gateway
        sets these fields in the client's body. ``lora_path`` names a loaded adapter in every checked version
        (``model: "BASE:ADAPTER"`` only from 0.5.4).
        """
        return {"model": served_name, "lora_path": name}

    def option_args(self, command: Command) -> tuple[str, ...]:
        """The arguments after ``python -m sglang.launch_server``: the ones SGLang's help documents."""
        return tuple(command.argv[1 + len(MODULE) :])


@llmgw.hookimpl
def llmgw_register_engines() -> list[Engine]:
    """Register the SGLang engine, ``engine: sglang`` in a catalog."""
    return [SglangEngine()]
