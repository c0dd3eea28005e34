"""llmgw-engine-sim: the simulated inference engine and its llmgw plugin.

The engine itself is the ``llmgw-sim`` program (see :mod:`llmgw_engine_sim.process`):
a real OpenAI-compatible HTTP server with real multi-node rendezvous, that
needs no GPU. This module is the plugin: it registers :class:`SimEngine`,
which builds ``llmgw-sim`` command lines from launch specs.

LoRA adapters: the sim serves them as vLLM does (see :mod:`llmgw_engine_sim.lora`):
``--enable-lora --max-loras N --max-lora-rank R`` from ``spec.lora``, loaded and unloaded
on the running replica with ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``,
and asked for by name in a request's ``model``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

import llmgw
from llmgw.engine import Engine, HttpCall, LoadMetrics, openai_canary, rendezvous_args
from llmgw.models import Command, LaunchSpec, LoraSpec
from llmgw.version import distribution_version
from llmgw_engine_sim.flags import option_args
from llmgw_engine_sim.lora_options import LoraOptions

__all__ = ["LOAD", "LORA_LOAD_TIMEOUT", "PROGRESS", "SimEngine", "__version__"]

__version__ = distribution_version("llmgw-engine-sim")

#: the sim's gauges at /metrics of its queue and of its seats taken, named as vLLM's
LOAD = LoadMetrics(
    waiting=("vllm:num_requests_waiting",),
    running=("vllm:num_requests_running",),
    kv_cache_usage=("vllm:kv_cache_usage_perc",),
)
#: the sim's token counters beside them, named as vLLM's
PROGRESS = LOAD.progress(tokens=("vllm:generation_tokens_total", "vllm:prompt_tokens_total"))


#: seconds an adapter load may take before the agent counts it failed (the sim's ``--lora-load-time`` is
#: 0.5 s by default; a load waits for another of the same name first)
LORA_LOAD_TIMEOUT = 60.0


class SimEngine(Engine):
    """Builds ``llmgw-sim`` commands: single-node, rank 0, and workers."""

    name = "sim"
    #: the sim engine ships with its plugin: it is checked against itself
    checked_versions = (__version__,)
    multi_node = True
    #: the catalog accepts ``adapters:`` on sim models (the sim's LoRA API is its own distribution's)
    serves_lora = True
    health_path = "/health"
    programs = ("llmgw-sim",)
    #: the canary vLLM and SGLang get, quicker: the sim answers in milliseconds unless busy
    #: (``--max-num-seqs``) or hung (``--hang-after-requests``), which its counters tell apart
    liveness_probe = openai_canary(PROGRESS, timeout=5.0, interval=2.0)
    load_metrics = LOAD
    serves_lora = True
    flag_features = {
        "--enable-lora": "LoRA adapters",
        "--max-loras": "LoRA adapters (max_adapters)",
        "--max-lora-rank": "LoRA adapters (max_adapter_rank)",
    }

    def continues_final_message(self, version: str | None, args: Sequence[str]) -> bool:
        """The sim always continues a final assistant message (``continue_final_message``), token for
        token as the unbroken answer would have gone on."""
        return True

    def build_command(self, spec: LaunchSpec) -> Command:
        """Build the ``llmgw-sim`` command of one shard.

        Rank 0 gets ``--host``/``--port`` and binds ``--dist-init-addr``;
        workers get their node's ``--host`` (to join from) but no port: they
        serve nothing. With ``spec.lora`` every rank also gets ``--enable-lora
        --max-loras N --max-lora-rank R``; the profile's args come last (a
        ``--lora-load-time`` there sets the sim's load time).
        """
        argv = [
            self.program_path(spec, "llmgw-sim"),
            "--model",
            spec.model_source,
            "--served-model-name",
            spec.served_name,
        ]
        argv += ["--host", spec.host]
        if spec.rank == 0:
            argv += ["--port", str(spec.port)]
        argv += rendezvous_args(spec)
        if spec.lora is not None:
            lora = LoraOptions(enabled=True, max_loras=spec.lora.max_loaded, max_lora_rank=spec.lora.max_rank)
            argv += option_args(lora, "enabled", "max_loras", "max_lora_rank")
        argv += list(spec.extra_args)
        return Command(argv=argv, env=self.device_env(spec))

    def widest_spec(self) -> LaunchSpec:
        """The default multi-node widest spec, with profile args and LoRA adapters: every flag llmgw emits."""
        return attrs.evolve(
            super().widest_spec(),
            extra_args=("--time-to-first-token", "0.01"),
            lora=LoraSpec(max_loaded=4, max_rank=16),
        )

    def lora_load(self, name: str, path: str) -> HttpCall:
        """vLLM's ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``, which the sim serves.

        Called by the agent when the server asks a replica to load adapter ``name`` from the directory
        ``path``. :returns: the call; the sim answers 200 once loaded (``--lora-load-time`` later), 400/404
        naming the adapter and the reason when it cannot load it, 409 when its ``--max-loras`` slots are full.
        """
        return HttpCall(
            "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout=LORA_LOAD_TIMEOUT
        )

    def lora_unload(self, name: str) -> HttpCall:
        """vLLM's ``POST /v1/unload_lora_adapter {"lora_name"}``, which the sim serves.

        Called by the agent when the server asks a replica to unload adapter ``name``. :returns: the call;
        the sim answers 200, or 404 when no adapter of that name is loaded.
        """
        return HttpCall("POST", "/v1/unload_lora_adapter", {"lora_name": name}, timeout=10.0)


@llmgw.hookimpl
def llmgw_register_engines() -> list[Engine]:
    """Register the simulated engine, ``engine: sim`` in a catalog."""
    return [SimEngine()]
