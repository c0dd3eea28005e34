"""llmgw-engine-llamacpp: the llmgw plugin for llama.cpp.

It registers :class:`LlamaCppEngine`. One node runs ``llama-server``. A replica
on several nodes runs, as llama.cpp's RPC guide has it, llama.cpp's RPC worker
on every other node (``rpc-server``; named ``ggml-rpc-server`` in newer
builds, so its path comes from the agent's configuration) and ``llama-server``
on rank 0 with ``--rpc`` listing the workers: rank 0 dials them, so the
workers must be up first, and no dist-init address is used.

Readiness is rank 0's ``/health`` (503 while the model loads, then 200). A lost
worker does not show there: the head aborts (SIGABRT) at its next decode, and a
hung worker makes requests hang while ``/health`` still answers 200. So the
engine asks the agent for two things (``wait_for_workers`` and
``liveness_probe``): start rank 0 only once every worker's port accepts
connections (rank 0 dials them once and aborts ~11 ms after start if one is
not up), and, once ready, send a 1-token completion every few seconds: a lost
worker turns it into an immediate abort, a hung one into a probe with no
answer, and either way the replica is torn down and rebuilt.

LoRA adapters: llama-server loads them only at start (``lora_at_start``). Rank 0
gets ``--lora FILE`` once per adapter of ``spec.lora.at_start`` (their order is
their id: 0, 1, ...) and ``--lora-init-without-apply``, so no adapter applies by
default; a request selects one with llama-server's per-request
``lora: [{"id": ID, "scale": 1.0}]`` (ggml-org/llama.cpp#10994, January 2025;
both checked commits), every other adapter listed at scale 0, and a base-model
request lists them all at scale 0 (some builds leave
``--lora-init-without-apply`` adapters at scale 1: ggml-org/llama.cpp#28674).
Loading and unloading need no call: an adapter added to the model takes a
restart. The files are GGUF LoRA adapters (``convert_lora_to_gguf.py``), not
PEFT directories. ``--lora`` is repeated rather than comma-joined: 4227c9b
takes one file per ``--lora``, 0c1e570 also splits its value on commas, so a
path with a comma is refused. There is no rank limit; every adapter is loaded,
so llmgw's catalog refuses more adapters than the profile's ``max_adapters``.
The server lists every adapter of the model in ``spec.lora.at_start`` and the
agent stages each one to a file before rank 0 starts. Requests with different
adapters are not batched together by llama-server.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import attrs

import llmgw
from llmgw.engine import Engine, LivenessProbe, serving_args
from llmgw.models import Command, LaunchSpec, LoraSpec
from llmgw.version import distribution_version
from llmgw_engine_llamacpp.helptext import parse_llamacpp_help

__all__ = [
    "CONTINUES_AT",
    "LIVENESS_PROBE",
    "LlamaCppEngine",
    "NO_PREFILL",
    "__version__",
    "lora_args",
    "parse_llamacpp_help",
    "worker_addresses",
]

__version__ = distribution_version("llmgw-engine-llamacpp")

SERVER = "llama-server"
#: the RPC worker's role; the agent's configuration gives its path (rpc-server or ggml-rpc-server)
WORKER = "rpc-server"
#: more layers than any model has: offload them all to the GPUs and RPC workers
ALL_LAYERS = "999"
#: ggml attaches gdb to print a backtrace on abort, delaying a lost worker's
#: head exit by up to a second; llmgw wants the exit at once
ENV = {"GGML_NO_BACKTRACE": "1"}

_FEATURES = {
    "-m": "model source",
    "--alias": "served model name",
    "--host": "listen address (llama-server: HTTP; rpc-server: the RPC rank 0 dials)",
    "--port": "listen address (llama-server: HTTP; rpc-server: the RPC rank 0 dials)",
    "-ngl": "offload to GPUs and RPC workers",
    "--rpc": "multi-node: the workers rank 0 dials",
    "--lora": "LoRA adapters (loaded at start)",
    "--lora-init-without-apply": "LoRA adapters (applied per request)",
}
_SECTION_END = "----- example-specific params -----"
_WORKER_USAGE = re.compile(r"^Usage: \S*rpc-server", re.MULTILINE)


#: a real decode, as cheap as one can be; any HTTP answer counts as alive
#: (a 4xx/5xx means the server's loop works): only no answer in time fails
LIVENESS_PROBE = LivenessProbe(
    method="POST",
    path="/completion",
    body={"prompt": "a", "n_predict": 1, "temperature": 0, "cache_prompt": False},
    timeout=10.0,
    interval=5.0,
)


def worker_addresses(spec: LaunchSpec) -> list[str]:
    """The ``host:port`` of every worker of ``spec``'s replica, in rank order.

    ``spec.peer_addrs`` holds every rank's address (rank 0's first), or only
    the other ranks'; both are understood.

    :raises ValueError: it holds neither ``nnodes`` nor ``nnodes - 1`` addresses.
    """
    peers = list(spec.peer_addrs)
    if len(peers) == spec.nnodes:
        return peers[1:]
    if len(peers) == spec.nnodes - 1:
        return peers
    raise ValueError(
        f"llama.cpp rank 0 dials its {spec.nnodes - 1} workers: peer_addrs must give their "
        f"host:port, got {peers}"
    )


#: llama.cpp commits known to continue a last assistant message (its "assistant prefill":
#: ggml-org/llama.cpp#13174, merged 2025-04-30; on by default, ``--no-prefill-assistant`` turns it off,
#: ggml-org/llama.cpp#13608); both checked commits have it (4227c9b's help documents the flag). Versions
#: are commits, which do not order: another commit counts as without it until listed here.
#: (#23012, 2026-05, also reads ``continue_final_message``; older builds ignore that field.)
CONTINUES_AT = frozenset({"4227c9b", "0c1e570"})
#: the flags that turn the assistant prefill off
NO_PREFILL = frozenset({"--no-prefill-assistant"})


class LlamaCppEngine(Engine):
    """Builds ``llama-server`` commands, and the RPC worker's on the other ranks."""

    name = "llamacpp"
    #: llama.cpp commits whose help documents every flag used here (0c1e570 is release b11312)
    checked_versions = ("4227c9b", "0c1e570")
    multi_node = True
    health_path = "/health"
    programs = (SERVER, WORKER)
    flag_features = _FEATURES
    serves_lora = True
    #: llama-server loads adapters only from ``--lora`` at start
    lora_at_start = True

    def parse_version(self, text: str) -> str | None:
        """The commit ``llama-server --version`` prints is the version.

        Older builds print ``version: 6123 (4227c9b)``; 0c1e570 prints
        ``version: 0.5.0-dev (build 11312, commit 0c1e570)``.
        """
        match = re.search(r"version:\s*\S+\s*\((?:build\s+\d+,\s*commit\s+)?([0-9a-f]{7,40})\)", text)
        return match.group(1)[:7] if match else None

    #: rank 0 dials every worker once, at start, and aborts if one does not
    #: answer: the agent starts rank 0 only once every worker's port accepts
    #: connections
    wait_for_workers = True
    #: ``/health`` stays 200 when an RPC worker is lost (the head aborts at
    #: its next decode) or hangs (requests, ``/metrics`` and ``/slots`` hang
    #: too): only a real decode shows either, so the agent sends a 1-token
    #: greedy completion every few seconds once rank 0 is ready. A lost worker
    #: turns it into an immediate abort (the shard exits); a hung one into a
    #: probe that times out.
    liveness_probe = LIVENESS_PROBE

    def continues_final_message(self, version: str | None, args: Sequence[str]) -> bool:
        """llama-server at a commit of :data:`CONTINUES_AT` continues a last assistant message, unless
        the profile turns its assistant prefill off."""
        return version in CONTINUES_AT and not NO_PREFILL.intersection(args)

    def build_command(self, spec: LaunchSpec) -> Command:
        """Build the command of one shard.

        Rank 0: ``llama-server -m MODEL --alias NAME --host --port -ngl N``,
        ``--rpc`` with every worker's address when there are several nodes,
        then the profile's args. ``-ngl`` offloads every layer when there are
        GPUs or workers, none on a lone CPU node. A worker:
        ``rpc-server --host --port`` on its own address, the one rank 0 dials
        (the profile's args are ``llama-server``'s, not the worker's).
        With ``spec.lora``, rank 0 also gets ``--lora FILE`` per adapter of
        ``spec.lora.at_start`` and ``--lora-init-without-apply``.

        :raises ValueError: ``spec.lora`` lists no adapter at start, or an
            adapter's path holds a comma.
        """
        env = {**self.device_env(spec), **ENV}
        if spec.rank > 0:
            argv = [self.program_path(spec, WORKER), "--host", spec.host, "--port", str(spec.port)]
            return Command(argv=argv, env=env)
        workers = worker_addresses(spec) if spec.nnodes > 1 else []
        argv = [self.program_path(spec, SERVER), *serving_args(spec, model="-m", served_name="--alias")]
        argv += ["-ngl", ALL_LAYERS if spec.gpus or workers else "0"]
        if workers:
            argv += ["--rpc", ",".join(workers)]
        if spec.lora is not None:
            argv += lora_args(spec.lora)
        argv += spec.extra_args
        return Command(argv=argv, env=env)

    def widest_spec(self) -> LaunchSpec:
        """The default multi-node widest spec with two adapters at start: engine-check checks their flags."""
        adapters = (("sql", "/adapters/sql.gguf"), ("chat", "/adapters/chat.gguf"))
        return attrs.evolve(super().widest_spec(), lora=LoraSpec(max_loaded=2, at_start=adapters))

    def lora_load(self, name: str, path: str) -> None:
        """None: every adapter was loaded at start (``--lora``), and a request selects it by id.

        Called by the agent when the server asks a replica to load adapter ``name``.
        """
        return None

    def lora_unload(self, name: str) -> None:
        """None: an adapter stays loaded until the replica restarts; a request not listing it leaves it out.

        Called by the agent when the server asks a replica to unload adapter ``name``.
        """
        return None

    def lora_request_fields(self, name: str, served_name: str, known: Sequence[str]) -> Mapping[str, object]:
        """``{"lora": [{"id": i, "scale": 1.0 or 0.0}, ...]}``: adapter ``name`` at scale 1, every other at 0.

        Called by the server for each adapter of a replica, as it builds the routes feed; ``known`` is the
        model's adapters in ``--lora`` order, which is llama-server's id order.

        :raises ValueError: ``name`` is not in ``known``.
        """
        if name not in known:
            raise ValueError(f"adapter {name!r} is not one llama-server loaded at start: {list(known)}")
        return {"lora": [{"id": i, "scale": 1.0 if other == name else 0.0} for i, other in enumerate(known)]}

    def lora_base_request_fields(self, served_name: str, known: Sequence[str]) -> Mapping[str, object]:
        """``{"lora": [{"id": i, "scale": 0.0}, ...]}`` for every adapter, so the base model answers alone.

        Called by the server for a replica whose model has adapters; some llama-server builds apply
        ``--lora-init-without-apply`` adapters at scale 1 to requests that do not list them
        (ggml-org/llama.cpp#28674). :returns: ``{}`` when there are no adapters.
        """
        return {"lora": [{"id": i, "scale": 0.0} for i in range(len(known))]} if known else {}

    def parse_help(self, text: str) -> frozenset[str]:
        """The flags a llama.cpp help documents (see :func:`parse_llamacpp_help`)."""
        return parse_llamacpp_help(text)

    def help_warnings(self, program: str, text: str) -> list[str]:
        """One program's help given for the other, or a ``llama-server`` help missing its last section."""
        if program == SERVER:
            if _WORKER_USAGE.search(text):
                return ["it is the RPC worker's help, not llama-server's"]
            if _SECTION_END not in text:
                return [
                    f"it lacks the `{_SECTION_END}` section every llama-server help has "
                    "(with --host, --port and --alias), so it looks cut short"
                ]
        elif "----- common params -----" in text:
            return ["it is llama-server's help, not the RPC worker's"]
        return []


def lora_args(lora: LoraSpec) -> list[str]:
    """llama-server's LoRA arguments for ``lora``: ``--lora FILE`` per adapter at start, in id order, and
    ``--lora-init-without-apply``.

    Called by :meth:`LlamaCppEngine.build_command` for rank 0.

    :raises ValueError: ``lora.at_start`` is empty (llama-server cannot load an adapter later), or a path
        holds a comma (0c1e570 would split it in two).
    """
    if not lora.at_start:
        raise ValueError(
            "spec.lora.at_start is empty: llama-server loads LoRA adapters only at start, "
            "so every adapter of the model must be listed there"
        )
    argv: list[str] = []
    for name, path in lora.at_start:
        if "," in path:
            raise ValueError(
                f"LoRA adapter {name!r}: path {path!r} holds a comma, which llama-server's --lora "
                "splits on (comma-separated adapters); rename the file"
            )
        argv += ["--lora", path]
    return [*argv, "--lora-init-without-apply"]


@llmgw.hookimpl
def llmgw_register_engines() -> list[Engine]:
    """Register the llama.cpp engine, ``engine: llamacpp`` in a catalog."""
    return [LlamaCppEngine()]
