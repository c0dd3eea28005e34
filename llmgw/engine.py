"""The Engine base class: what an engine plugin registers.

An engine turns a :class:`~llmgw.models.LaunchSpec` into a
:class:`~llmgw.models.Command`, names its health path, and reads its own
``--help`` into the set of flags it documents. It does no I/O: the agent runs
the command, probes the health path and captures the help text.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping, Sequence
from typing import ClassVar

import attrs

from llmgw.models import Command, LaunchSpec

__all__ = [
    "Engine",
    "HelpAndVersion",
    "HttpCall",
    "LivenessProbe",
    "LoadMetrics",
    "ProgressMetrics",
    "help_and_version_of",
    "old_api_uses",
    "openai_canary",
    "parse_argparse_flags",
    "rendezvous_args",
    "serving_args",
    "version_at_least",
]


@attrs.frozen
class ProgressMetrics:
    """Where an engine's own Prometheus metrics show that it still produces tokens.

    The agent reads them when a liveness probe got no answer in time: if the
    ``tokens`` counters grew meanwhile, the engine is busy (the probe waited
    in its queue), not hung.
    """

    #: sample names of counters that grow with every token processed; their sum is compared
    tokens: tuple[str, ...] = attrs.field(converter=tuple)
    #: sample names of gauges counting the requests being decoded (named in the report of a hang)
    running: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: the HTTP path on rank 0 that serves them in Prometheus' text format
    path: str = "/metrics"


@attrs.frozen
class LoadMetrics:
    """Where an engine's own Prometheus gauges show how loaded it is: the autoscaler's signals.

    The agent reads them from every ready rank 0 every few seconds and sends
    them with its sync. For each signal the first name the engine serves is
    read (engines rename their gauges between versions), summed over its labels.
    """

    #: gauges of the requests queued, not yet running (vLLM's ``vllm:num_requests_waiting``)
    waiting: tuple[str, ...] = attrs.field(converter=tuple)
    #: gauges of the requests being decoded
    running: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: gauges of the share of the KV cache in use, from 0 to 1; () when the engine reports none
    kv_cache_usage: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: the HTTP path on rank 0 that serves them in Prometheus' text format
    path: str = "/metrics"

    def progress(self, tokens: Sequence[str]) -> ProgressMetrics:
        """The :class:`ProgressMetrics` of an engine whose token counters are ``tokens``: these ``running``
        gauges and ``path``; an engine module calls it to name each gauge once for both."""
        return ProgressMetrics(tokens=tokens, running=self.running, path=self.path)


@attrs.frozen
class LivenessProbe:
    """A request to rank 0 whose answer within ``timeout`` seconds proves the engine still serves.

    The agent sends it every ``interval`` seconds once the shard is ready,
    beside the health check; any HTTP answer passes. No answer in time (or a
    broken connection) makes the shard ``unhealthy``, unless ``progress``
    shows the engine produced tokens while the probe waited: a busy engine
    is not a hung one.
    """

    method: str
    path: str
    body: Mapping[str, object] | None = None
    timeout: float = 10.0
    interval: float = 5.0
    #: the body key that gets the shard's served model name (``"model"`` for OpenAI's API)
    model_field: str | None = None
    #: the engine's metrics that tell busy from hung; None: no answer in time is a hang
    progress: ProgressMetrics | None = None

    def request_body(self, served_name: str) -> Mapping[str, object] | None:
        """The body to send to a shard serving ``served_name``: ``body``, with ``model_field`` set."""
        if self.model_field is None:
            return self.body
        return {**(self.body or {}), self.model_field: served_name}


def openai_canary(
    progress: ProgressMetrics | None = None, *, timeout: float = 10.0, interval: float = 5.0
) -> LivenessProbe:
    """The liveness probe of an OpenAI-compatible engine: a one-token greedy completion of its model.

    ``Engine.liveness_probe`` is this by default (without ``progress``); an
    engine that exposes token counters passes them, so a busy replica is not
    taken for a hung one.
    """
    return LivenessProbe(
        method="POST",
        path="/v1/completions",
        body={"prompt": "a", "max_tokens": 1, "temperature": 0},
        timeout=timeout,
        interval=interval,
        model_field="model",
        progress=progress,
    )


@attrs.frozen
class HttpCall:
    """One HTTP request the agent sends to a replica's rank 0 on an engine's behalf (an adapter load, say).

    Any 2xx answer is success; any other answer fails, and its body is what the operator is shown.
    """

    method: str
    path: str
    #: sent as JSON; None sends no body
    body: object = None
    #: seconds the call may take before it counts as failed (a load reads the adapter from disk)
    timeout: float = 60.0


@attrs.frozen
class HelpAndVersion:
    """How one of an engine's programs is made to print its full help and its version.

    engine-check ``--binary`` and the agent run ``PATH *help_args`` with
    ``help_env`` added to their own environment; the agent runs
    ``PATH *version_args`` for the engine's first program at start.
    """

    #: the arguments after the program's path that print its whole help
    help_args: tuple[str, ...] = attrs.field(converter=tuple, default=("--help",))
    #: environment variables the help command needs, added to the caller's
    help_env: Mapping[str, str] = attrs.field(factory=dict)
    #: the arguments that print the engine's version (an interpreter, ``python -m ...``, asks the package)
    version_args: tuple[str, ...] = attrs.field(converter=tuple, default=("--version",))


def help_and_version_of(engine: Engine, program: str) -> HelpAndVersion:
    """How ``program`` of ``engine`` prints its help and version: its entry, else ``--help``/``--version``.

    Called by engine-check and the agent before they run one of the engine's programs.
    """
    return engine.help_and_version.get(program) or HelpAndVersion()


#: Engine methods of llmgw 0.1 that are facts now: name -> what to write instead
_OLD_METHODS = {
    "help_argv": "help_argv(program) is now the class attribute "
    "`help_and_version = {PROGRAM: HelpAndVersion(help_args=(...))}`",
    "help_env": "help_env(program) is now the class attribute "
    "`help_and_version = {PROGRAM: HelpAndVersion(help_env={...})}`",
    "version_argv": "version_argv(program) is now the class attribute "
    "`help_and_version = {PROGRAM: HelpAndVersion(version_args=(...))}`",
    "flag_features": "flag_features() is now the class attribute `flag_features = {FLAG: FEATURE}`",
    "liveness_probe": "liveness_probe(spec) is now the class attribute "
    "`liveness_probe = LivenessProbe(...)` (or None)",
}


def old_api_uses(engine: object) -> list[str]:
    """What ``engine`` still writes the llmgw 0.1 way, one sentence each saying what to write instead.

    Called by the plugin manager when a plugin registers an engine: an engine
    with any is not registered (``llmgw plugins`` lists its plugin as failed).
    ``help_argv``, ``help_env`` and ``version_argv`` are no Engine names any
    more; ``flag_features`` and ``liveness_probe`` are, as values, not methods.
    """
    return [advice for name, advice in _OLD_METHODS.items() if callable(getattr(type(engine), name, None))]


class Engine(abc.ABC):
    """One inference engine llmgw can launch.

    :meth:`build_command` is the one method a subclass must write. The rest
    are facts, set as class attributes (``name``, ``checked_versions`` and
    ``programs`` have no default), and methods with defaults that fit an
    argparse program printing its whole help for ``--help``.
    """

    #: the name profiles use in ``engine:``; unique across all plugins
    name: ClassVar[str]
    #: engine versions this plugin's commands were checked against
    checked_versions: ClassVar[tuple[str, ...]]
    #: the programs this engine runs, by the name the agent's configuration
    #: uses for their paths; the first runs rank 0
    programs: ClassVar[tuple[str, ...]]
    #: whether one replica can span several nodes
    multi_node: ClassVar[bool] = False
    #: HTTP path on rank 0 that answers 200 once the replica serves
    health_path: ClassVar[str] = "/health"
    #: rank 0 dials the other ranks once, at start (llama.cpp's RPC): the
    #: agent starts rank 0 only once every other rank's address accepts TCP
    wait_for_workers: ClassVar[bool] = False
    #: the request that proves rank 0 still serves, beyond its health path,
    #: sent by the agent once rank 0 is ready: a health path stays 200 while
    #: requests hang (a dead vLLM EngineCore, a hung llama.cpp RPC worker).
    #: The default is :func:`openai_canary` without progress metrics; set
    #: ``openai_canary(ProgressMetrics(...))`` when the engine counts its
    #: tokens, your own probe for another API, or None to rely on health alone
    liveness_probe: ClassVar[LivenessProbe | None] = openai_canary()
    #: the engine's gauges of its queue and KV cache, which the agent reads
    #: from every ready rank 0 for the autoscaler; None: it reports none (a
    #: catalog cannot then scale a model of this engine on them)
    load_metrics: ClassVar[LoadMetrics | None] = None
    #: program -> how it prints its help and version; a program not listed
    #: answers ``--help`` and ``--version`` with no extra environment
    help_and_version: ClassVar[Mapping[str, HelpAndVersion]] = {}
    #: flag -> the llmgw feature that makes :meth:`build_command` emit it;
    #: engine-check prints it next to each flag (``--nnodes``: "multi-node
    #: rendezvous"), so an operator knows what a missing flag breaks
    flag_features: ClassVar[Mapping[str, str]] = {}

    @abc.abstractmethod
    def build_command(self, spec: LaunchSpec) -> Command:
        """Build the command that starts the shard ``spec`` describes.

        Called by the agent for every shard it starts, and by engine-check for
        the widest spec.

        :param spec: the shard to start; ``spec.rank`` 0 serves HTTP.
        :returns: the argv, environment and working directory of the shard.
        """

    def widest_spec(self) -> LaunchSpec:
        """A launch spec that makes :meth:`build_command` use every flag it ever emits.

        engine-check builds it (every rank) and checks each flag against the
        engine's real ``--help``. The default is one node with two GPUs, or,
        for a :attr:`multi_node` engine, three such nodes on a fabric, with a
        dist-init address and every rank's address in ``peer_addrs``; override
        it when a flag needs more (profile args, say).
        """
        one_node = LaunchSpec(
            model_source="/models/example", served_name="example", host="10.0.0.1", port=8000, gpus=(0, 1)
        )
        if not self.multi_node:
            return one_node
        return attrs.evolve(
            one_node,
            nnodes=3,
            dist_init_addr="10.0.0.1:29500",
            peer_addrs=("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"),
            adapters=("mlx5_0", "mlx5_1"),
        )

    def parse_help(self, text: str) -> frozenset[str]:
        """Read the flags an engine's ``--help`` output documents.

        The default reads argparse-style option definitions. Override for
        engines whose help is shaped otherwise.

        :param text: what the engine printed for ``--help``.
        :returns: every documented spelling, long and short (``--port``, ``-p``).
        """
        return parse_argparse_flags(text)

    def parse_version(self, text: str) -> str | None:
        """The version in what the version command printed (stdout, else stderr).

        :returns: a string comparable with :attr:`checked_versions`, or None
            when the text holds no version. The default takes the last word
            of the first non-empty line (``vllm 0.34.0`` gives ``0.34.0``).
        """
        for line in text.splitlines():
            if line.split():
                return line.split()[-1]
        return None

    def program_path(self, spec: LaunchSpec, program: str) -> str:
        """The path of ``program`` on the node: configured, or its bare name."""
        return spec.executables.get(program, program)

    def device_env(self, spec: LaunchSpec) -> dict[str, str]:
        """The environment that gives a shard its GPUs and its fabric's adapters.

        ``CUDA_VISIBLE_DEVICES`` lists ``spec.gpus`` (empty: no GPU at all);
        ``NCCL_IB_HCA`` lists ``spec.adapters`` with NCCL's exact-name prefix
        ``=``, so ``mlx5_1`` does not also select ``mlx5_10``; it is left
        out when the replica is on no fabric.
        """
        env = {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in spec.gpus)}
        if spec.adapters:
            env["NCCL_IB_HCA"] = "=" + ",".join(spec.adapters)
        return env

    def option_args(self, command: Command) -> tuple[str, ...]:
        """The part of ``command.argv`` that the program's ``--help`` speaks about.

        engine-check reads the flags to check from it. The default is
        everything after ``argv[0]``; override it when the command starts
        with another program's arguments (``python -m sglang.launch_server``).
        """
        return tuple(command.argv[1:])

    def help_warnings(self, program: str, text: str) -> list[str]:
        """Signs, known to this engine, that ``text`` is not the full help of ``program``.

        engine-check also applies its own checks (the help must define
        ``--help``; an argparse usage line must not name flags no option line
        defines); add here what only your engine knows, such as a section
        its full help always ends with. The default finds none.

        :returns: one sentence per problem, without the program's name
            (engine-check puts it in front); flags reported missing from a
            help with warnings are marked as possibly caused by them.
        """
        return []

    #: whether this engine serves LoRA adapters on top of its base model; a catalog that gives adapters to
    #: a model whose profile runs an engine without them is refused, naming the engine
    serves_lora: ClassVar[bool] = False
    #: the engine loads adapters only at start (llama.cpp's ``--lora``): the server lists every adapter of
    #: the model in :attr:`llmgw.models.LoraSpec.at_start`, the agent stages each to a path on the node
    #: before the engine starts, and a ready replica is routed for all of them (no load or unload call)
    lora_at_start: ClassVar[bool] = False

    def lora_load(self, name: str, path: str) -> HttpCall | None:
        """The call that loads adapter ``name`` from directory ``path`` on a running replica.

        Called by the agent when the server asks a replica to load an adapter, once the adapter's
        files are complete on the node. The agent sends it to rank 0 and reports the outcome.

        :returns: the call; None when loading needs no call (an engine that loaded every adapter at
            start). The default, for an engine that does not serve adapters, raises NotImplementedError.
        """
        raise NotImplementedError(f"engine {self.name} does not serve LoRA adapters")

    def lora_unload(self, name: str) -> HttpCall | None:
        """The call that unloads adapter ``name`` from a running replica, freeing its slot.

        Called by the agent when the server asks a replica to unload an adapter (to make room).

        :returns: the call; None when unloading needs no call. The default raises NotImplementedError.
        """
        raise NotImplementedError(f"engine {self.name} does not serve LoRA adapters")

    def lora_request_fields(self, name: str, served_name: str, known: Sequence[str]) -> Mapping[str, object]:
        """The fields the gateway sets in an OpenAI request body so that this engine answers with adapter
        ``name``.

        Called by the server as it builds the routes feed, once per adapter loaded on a replica; the
        gateway merges the fields into the client's body (replacing keys it names) before relaying.

        :param served_name: the base model's served name on the replica.
        :param known: every adapter name of the model, in the order of :attr:`LoraSpec.at_start`.
        :returns: the fields; the default, vLLM's and the sim's way, is ``{"model": name}``.
        """
        return {"model": name}

    def lora_base_request_fields(self, served_name: str, known: Sequence[str]) -> Mapping[str, object]:
        """The fields the gateway sets in an OpenAI request body for the *base* model on a replica that
        serves adapters, so that no adapter answers it.

        Called by the server as it builds the routes feed, once per ready replica whose model has adapters;
        the gateway merges the fields into a base-model request's body (replacing keys it names) before
        relaying. An engine whose adapters apply to every request unless a request says otherwise needs it:
        llama-server at some builds leaves ``--lora-init-without-apply`` adapters at scale 1
        (ggml-org/llama.cpp#28674), and zeroes them for a request that lists them.

        :param served_name: the base model's served name on the replica.
        :param known: every adapter name of the model, in the order of :attr:`LoraSpec.at_start`.
        :returns: the fields; the default, for engines that answer the base model by its name (vLLM,
            SGLang, the sim), is ``{}``.
        """
        return {}

    def continues_final_message(self, version: str | None, args: Sequence[str]) -> bool:
        """Whether a replica of this engine continues a chat's final assistant message.

        That is: given ``continue_final_message: true`` and ``add_generation_prompt: false``
        (vLLM's and SGLang's names, from Hugging Face's chat templates) or its own way of
        reading a last assistant message as the start of the answer (llama.cpp's assistant
        prefill), it goes on from that text instead of starting a new message. Called by the
        server for every ready replica as it answers the routes feed; the gateway continues a
        stream broken mid-way on another replica only when this is true for that replica.

        :param version: the engine's version as the replica's node reported it (None: unknown).
        :param args: the profile's extra arguments (a flag may turn the mechanism off).
        :returns: True when that version with those arguments has the mechanism; the default,
            for engines that have not said, is False.
        """
        return False

    def __repr__(self) -> str:
        return f"<Engine {self.name}>"


def serving_args(
    spec: LaunchSpec, model: str = "--model", served_name: str = "--served-model-name"
) -> list[str]:
    """``--model SOURCE --served-model-name NAME --host HOST --port PORT``: what rank 0 serves, and where.

    Called by an engine's :meth:`Engine.build_command`; ``model`` and ``served_name`` are the engine's
    spellings of the first two flags (llama.cpp: ``-m``, ``--alias``). :returns: the eight arguments.
    """
    served = [model, spec.model_source, served_name, spec.served_name]
    return [*served, "--host", spec.host, "--port", str(spec.port)]


def rendezvous_args(spec: LaunchSpec) -> list[str]:
    """``--nnodes N --node-rank R --dist-init-addr HOST:PORT`` for a shard of a multi-node replica, else [].

    Called by the :meth:`Engine.build_command` of an engine taking these spellings (SGLang, the sim): every
    rank gets rank 0's dist-init address. :returns: the six arguments, or none for a one-node replica.
    """
    if spec.nnodes <= 1:
        return []
    ranks = ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.rank)]
    return [*ranks, "--dist-init-addr", str(spec.dist_init_addr)]


def version_at_least(version: str | None, minimum: str) -> bool:
    """Whether the dotted release ``version`` (``0.6.3``, ``0.6.3.post1``, ``0.34.0rc1``) is at least
    ``minimum``; False for None or a version without a leading number."""
    if version is None:
        return False
    found = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    if found is None:
        return False
    have = tuple(int(part) for part in found.group(1).split("."))
    need = tuple(int(part) for part in minimum.split("."))
    return have + (0,) * (len(need) - len(have)) >= need


# An option's own definition line: indented, then one or more comma-separated
# spellings (each optionally followed by a metavar) before the description.
_DEFINITION = re.compile(r"^\s{1,8}(-[^\s].*?)(?:\s{2,}|$)")
_SPELLING = re.compile(r"^(--?[A-Za-z0-9][A-Za-z0-9_.\-]*)")


def parse_argparse_flags(text: str) -> frozenset[str]:
    """Flags documented by argparse-style help text.

    Only an option's own definition line counts: a flag mentioned inside
    another flag's description is not documented by it. ``--x/--no-x`` and
    ``-a, --alpha`` give every spelling.

    :returns: the set of spellings, e.g. ``{"--port", "-p", "--no-x"}``.
    """
    flags: set[str] = set()
    for line in text.splitlines():
        match = _DEFINITION.match(line)
        if not match:
            continue
        for part in re.split(r",\s*|/(?=-)", match.group(1)):
            spelling = _SPELLING.match(part.strip())
            if spelling:
                flags.add(spelling.group(1).rstrip(".,"))
    return frozenset(flags)
