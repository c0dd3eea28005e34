"""llmgw-engine-vllm: the llmgw plugin for vLLM.

It registers :class:`VllmEngine`, which builds ``vllm serve`` commands: one
node, or every rank of a replica spanning several nodes without Ray, as vLLM's
"Parallelism and Scaling" guide describes it (``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port``; ``--headless`` on the workers). Tensor
parallelism spans the GPUs of one node and each node is a pipeline stage.

LoRA adapters (a model with ``adapters:``, ``spec.lora`` set): every rank gets
``--enable-lora --max-loras N --max-lora-rank R`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, and adapters are loaded and unloaded
on the running replica with ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's "Dynamically serving LoRA Adapters"); a
request names the adapter as its ``model``. ``--max-loras`` bounds the adapters
in one batch; vLLM registers any number at run time, llmgw keeps at most N
loaded. ``--max-lora-rank`` takes only {1, 8, 16, 32, 64, 128, 256, 320, 512} in
the checked versions: the rank is rounded up to the next of them. The runtime
endpoints exist from vLLM 0.6.1 (vllm-project/vllm#6566); both checked versions
document every LoRA flag used (so does 0.11.0, with ``--max-lora-rank`` any integer).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

import llmgw
from llmgw.engine import (
    Engine,
    HelpAndVersion,
    HttpCall,
    LoadMetrics,
    openai_canary,
    parse_argparse_flags,
    version_at_least,
)
from llmgw.models import Command, LaunchSpec, LoraSpec
from llmgw.version import distribution_version

__all__ = [
    "CONTINUES_SINCE",
    "LOAD",
    "LORA_RANKS",
    "PROGRESS",
    "VllmEngine",
    "lora_rank",
    "__version__",
    "parse_vllm_help",
    "split_host_port",
]

__version__ = distribution_version("llmgw-engine-vllm")

#: ``vllm serve --help=all`` ends with this note on JSON arguments, whose
#: example lines (``   --json-arg.key1 value1``) are not option definitions.
JSON_EPILOG = "When passing JSON CLI arguments"
_EPILOG_LINE = re.compile(rf"^{JSON_EPILOG}", re.MULTILINE)
_SUMMARY = re.compile(r"^Config Groups:", re.MULTILINE)

_FEATURES = {
    "--served-model-name": "served model name",
    "--host": "HTTP address",
    "--port": "HTTP address",
    "--tensor-parallel-size": "GPUs of a node (tensor parallelism)",
    "--pipeline-parallel-size": "one pipeline stage per node",
    "--distributed-executor-backend": "multi-node without Ray",
    "--nnodes": "multi-node rendezvous",
    "--node-rank": "multi-node rendezvous",
    "--master-addr": "multi-node rendezvous",
    "--master-port": "multi-node rendezvous",
    "--headless": "multi-node workers (no API server)",
    "--enable-lora": "LoRA adapters",
    "--max-loras": "LoRA adapters (max_adapters)",
    "--max-lora-rank": "LoRA adapters (max_adapter_rank)",
}

#: the values ``--max-lora-rank`` accepts (its choices in ``vllm serve --help=all`` of 0.33.0 and 0.34.0)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: the environment variable that turns on vLLM's runtime load/unload endpoints
RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
#: seconds a load may take: vLLM reads the adapter's weights from disk and checks them
LORA_LOAD_TIMEOUT = 120.0


def lora_rank(rank: int) -> int:
    """The smallest value of :data:`LORA_RANKS` at least ``rank``; raises ValueError above 512."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"max_adapter_rank {rank}: vLLM's --max-lora-rank is at most {LORA_RANKS[-1]}")


def split_host_port(address: str) -> tuple[str, str]:
    """``"HOST:PORT"`` (or ``"[v6]:PORT"``) as ``(host, port)``, brackets removed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.removeprefix("[").removesuffix("]"), port


def parse_vllm_help(text: str) -> frozenset[str]:
    """The flags ``vllm serve --help=all`` documents, from option definition lines only.

    The help is argparse's, grouped by config class; the note on JSON
    arguments at its end shows example command lines, which define nothing.
    """
    match = _EPILOG_LINE.search(text)
    return parse_argparse_flags(text[: match.start()] if match else text)


#: vLLM's gauges of its queue and KV cache (``gpu_cache_usage_perc`` before vLLM's V1 engine renamed it)
LOAD = LoadMetrics(
    waiting=("vllm:num_requests_waiting",),
    running=("vllm:num_requests_running",),
    kv_cache_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
)
#: vLLM's own token counters at /metrics (on by default; ``--disable-log-stats`` freezes them, and then a
#: canary with no answer in time counts as a hang even on a busy replica)
PROGRESS = LOAD.progress(tokens=("vllm:generation_tokens_total", "vllm:prompt_tokens_total"))

#: the first vLLM release whose chat completions take ``continue_final_message`` (with
#: ``add_generation_prompt: false``): vllm-project/vllm#8942, merged 2024-09-30, released in v0.6.3
CONTINUES_SINCE = "0.6.3"


class VllmEngine(Engine):
    """Builds ``vllm serve`` commands: single-node, rank 0, and headless workers."""

    name = "vllm"
    #: vLLM releases whose ``vllm serve --help=all`` documents every flag used here
    checked_versions = ("0.33.0", "0.34.0")
    multi_node = True
    #: 200 once the engine serves; vLLM's API server binds it only after the model loaded
    health_path = "/health"
    programs = ("vllm",)
    #: plain ``--help`` prints only a summary of the groups; without
    #: ``VLLM_TARGET_DEVICE=cpu`` the help exits 1 on a machine with no GPU
    help_and_version = {
        "vllm": HelpAndVersion(help_args=("serve", "--help=all"), help_env={"VLLM_TARGET_DEVICE": "cpu"})
    }
    flag_features = _FEATURES
    #: /health stays 200 while a dead or hung EngineCore leaves requests hanging: a one-token
    #: completion every few seconds, judged by vLLM's token counters when it gets no answer
    liveness_probe = openai_canary(PROGRESS)
    load_metrics = LOAD
    serves_lora = True

    def continues_final_message(self, version: str | None, args: Sequence[str]) -> bool:
        """vLLM from :data:`CONTINUES_SINCE` continues a final assistant message (any arguments)."""
        return version_at_least(version, CONTINUES_SINCE)

    def build_command(self, spec: LaunchSpec) -> Command:
        """Build the ``vllm serve`` command of one shard.

        Every rank: the model, ``--tensor-parallel-size`` = the node's GPUs and
        the profile's args. Rank 0 also serves HTTP on ``spec.host:spec.port``
        under the served name. Several nodes: ``--pipeline-parallel-size`` =
        ``nnodes``, the multiprocessing backend, the node's rank and rank 0's
        ``dist_init_addr`` as ``--master-addr``/``--master-port`` on every rank,
        and ``--headless`` on the workers, which serve no API. With
        ``spec.lora``, every rank also gets ``--enable-lora``, ``--max-loras``
        and ``--max-lora-rank`` (rounded up to a value vLLM accepts) and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
        """
        argv = [self.program_path(spec, "vllm"), "serve", spec.model_source]
        if spec.rank == 0:
            argv += ["--served-model-name", spec.served_name, "--host", spec.host, "--port", str(spec.port)]
        argv += ["--tensor-parallel-size", str(max(len(spec.gpus), 1))]
        if spec.nnodes > 1:
            master_addr, master_port = split_host_port(str(spec.dist_init_addr))
            argv += [
                "--pipeline-parallel-size",
                str(spec.nnodes),
                "--distributed-executor-backend",
                "mp",
                "--nnodes",
                str(spec.nnodes),
                "--node-rank",
                str(spec.rank),
                "--master-addr",
                master_addr,
                "--master-port",
                master_port,
            ]
            if spec.rank > 0:
                argv.append("--headless")
        env = self.device_env(spec)
        if spec.lora is not None:
            argv += [
                "--enable-lora",
                "--max-loras",
                str(spec.lora.max_loaded),
                "--max-lora-rank",
                str(lora_rank(spec.lora.max_rank)),
            ]
            env.update(RUNTIME_LORA_ENV)
        argv += spec.extra_args
        return Command(argv=argv, env=env)

    def widest_spec(self) -> LaunchSpec:
        """The default multi-node widest spec with LoRA adapters, so engine-check checks their flags."""
        return attrs.evolve(super().widest_spec(), lora=LoraSpec(max_loaded=4, max_rank=16))

    def lora_load(self, name: str, path: str) -> HttpCall:
        """``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` (runtime LoRA updating).

        Called by the agent when the server asks a replica to load adapter ``name`` from ``path``.
        :returns: the call; vLLM answers 200 ``Success: LoRA adapter 'NAME' added successfully.``, 400 when
        the name is already loaded or the adapter is unreadable or its rank above ``--max-lora-rank``, 404
        when the path holds no adapter.
        """
        return HttpCall(
            "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout=LORA_LOAD_TIMEOUT
        )

    def lora_unload(self, name: str) -> HttpCall:
        """``POST /v1/unload_lora_adapter {"lora_name"}``.

        Called by the agent when the server asks a replica to unload adapter ``name``. :returns: the call;
        vLLM answers 200, or 404 when no adapter of that name is loaded.
        """
        return HttpCall("POST", "/v1/unload_lora_adapter", {"lora_name": name}, timeout=30.0)

    def parse_help(self, text: str) -> frozenset[str]:
        """The flags ``vllm serve --help=all`` documents (see :func:`parse_vllm_help`)."""
        return parse_vllm_help(text)

    def help_warnings(self, program: str, text: str) -> list[str]:
        """The summary of plain ``--help``, or a ``--help=all`` without its closing note."""
        if _SUMMARY.search(text):
            return ["it is the summary `vllm serve --help` prints, not `vllm serve --help=all`"]
        if not _EPILOG_LINE.search(text):
            return [
                "it lacks the note on JSON arguments that `vllm serve --help=all` ends with, "
                "so it looks cut short"
            ]
        return []


@llmgw.hookimpl
def llmgw_register_engines() -> list[Engine]:
    """Register the vLLM engine, ``engine: vllm`` in a catalog."""
    return [VllmEngine()]
