"""The llama.cpp plugin: commands from launch specs (LoRA too), help parsing, engine-check on real helps."""

from __future__ import annotations

import re

import attrs
import pytest
from llmgw_engine_llamacpp import LlamaCppEngine, lora_args, parse_llamacpp_help, worker_addresses

from llmgw.enginecheck import check_engine
from llmgw.models import LaunchSpec, LoraSpec
from llmgw.testing.contract import EngineContract, flag_value, read_help_files
from llmgw.testing.engine_checks import real_help_fixture, shard_serving, shard_spec, version_fixture


class TestLlamaCppContract(EngineContract):
    """The llama.cpp engine passes the conformance suite against each checked commit's real help."""

    distribution = "llmgw-engine-llamacpp"
    engine_class = LlamaCppEngine
    help_files = {p: f"llamacpp-{{version}}-{p}.txt" for p in ("llama-server", "rpc-server")}


def help_files(engine_help_dir, version: str) -> dict[str, str]:
    """Program -> its saved help at one llama.cpp commit."""
    return read_help_files(engine_help_dir, TestLlamaCppContract.help_files, version)


version = version_fixture(LlamaCppEngine)
#: program -> its real help at one checked commit
real_helps = real_help_fixture(TestLlamaCppContract)
#: rank 0 of a three-node replica, with every rank's address and profile args
SPEC = shard_spec(
    {"llama-server": "/opt/llama/bin/llama-server", "rpc-server": "/opt/llama/bin/ggml-rpc-server"},
    nnodes=3,
    peer_addrs=("10.0.0.5:20001", "10.0.0.6:20011", "10.0.0.7:20021"),
    extra_args=("-np", "4", "--metrics"),
)


def rank(r: int, **changes) -> LaunchSpec:
    """SPEC as rank ``r``, on that rank's own address from peer_addrs."""
    host, port = SPEC.peer_addrs[r].split(":")
    return attrs.evolve(SPEC, rank=r, host=host, port=int(port), **changes)


class TestCommands:
    """What the agent starts for each shard, as llama.cpp's RPC guide has it."""

    def test_single_node_on_gpus(self):
        """One node: llama-server with the model, alias, address and every layer on the GPUs."""
        spec = attrs.evolve(SPEC, nnodes=1, dist_init_addr=None, peer_addrs=(), adapters=())
        command = LlamaCppEngine().build_command(spec)
        assert command.argv == (
            "/opt/llama/bin/llama-server",
            *shard_serving("-m", "--alias"),
            "-ngl",
            "999",
            "-np",
            "4",
            "--metrics",
        )
        assert command.env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "GGML_NO_BACKTRACE": "1"}

    def test_single_node_on_cpu(self):
        """No GPUs: no layer offloaded, and no GPU visible."""
        spec = attrs.evolve(SPEC, nnodes=1, dist_init_addr=None, peer_addrs=(), adapters=(), gpus=())
        command = LlamaCppEngine().build_command(spec)
        assert flag_value(command.argv, "-ngl") == "0"
        assert command.env["CUDA_VISIBLE_DEVICES"] == ""

    def test_rank_zero_dials_every_worker(self):
        """Rank 0 is llama-server with --rpc listing the workers' addresses in rank order."""
        argv = LlamaCppEngine().build_command(SPEC).argv
        assert argv[0] == "/opt/llama/bin/llama-server"
        assert flag_value(argv, "--rpc") == "10.0.0.6:20011,10.0.0.7:20021"
        assert flag_value(argv, "-ngl") == "999"
        assert argv[-3:] == ("-np", "4", "--metrics")

    def test_workers_bind_what_rank_zero_dials(self):
        """Each worker runs the configured RPC worker on its own host:port, the address rank 0 dials."""
        engine = LlamaCppEngine()
        dialled = flag_value(engine.build_command(SPEC).argv, "--rpc").split(",")
        for r in (1, 2):
            command = engine.build_command(rank(r))
            assert command.argv[0] == "/opt/llama/bin/ggml-rpc-server"
            bound = f"{flag_value(command.argv, '--host')}:{flag_value(command.argv, '--port')}"
            assert bound == dialled[r - 1]
            assert "-np" not in command.argv, "profile args are llama-server's, not the worker's"

    def test_rank_zero_on_cpu_still_offloads_to_workers(self):
        """A CPU-only rank 0 still offloads every layer: its workers are RPC devices."""
        command = LlamaCppEngine().build_command(attrs.evolve(SPEC, gpus=()))
        assert flag_value(command.argv, "-ngl") == "999"

    def test_peer_addrs_of_the_other_ranks_only(self):
        """peer_addrs holding only the workers' addresses gives the same --rpc."""
        spec = attrs.evolve(SPEC, peer_addrs=SPEC.peer_addrs[1:])
        assert worker_addresses(spec) == worker_addresses(SPEC) == ["10.0.0.6:20011", "10.0.0.7:20021"]

    def test_missing_worker_addresses(self):
        """Rank 0 of a multi-node replica without its workers' addresses is refused."""
        with pytest.raises(ValueError, match="peer_addrs must give"):
            LlamaCppEngine().build_command(attrs.evolve(SPEC, peer_addrs=()))

    def test_worker_path_defaults_to_the_role_name(self):
        """Without a configured path the worker is looked up on PATH as rpc-server."""
        command = LlamaCppEngine().build_command(rank(1, executables={}))
        assert command.argv[0] == "rpc-server"


class TestHelpParsing:
    """parse_help reads llama.cpp's own help format."""

    def test_server_spellings(self, real_helps):
        """Short and long forms, aliases and ``[on|off|auto]`` metavars."""
        flags = parse_llamacpp_help(real_helps["llama-server"])
        assert {
            "-m",
            "--model",
            "-a",
            "--alias",
            "--host",
            "--port",
            "-ngl",
            "--gpu-layers",
            "--n-gpu-layers",
            "--rpc",
            "-np",
            "--parallel",
            "--metrics",
            "-fa",
            "--flash-attn",
            "-h",
            "--help",
            "--usage",
        } <= flags

    def test_worker_spellings(self, real_helps):
        """The RPC worker takes -H/--host and -p/--port in both layouts of its help."""
        assert {"-H", "--host", "-p", "--port", "-h", "--help", "-d", "--device"} <= parse_llamacpp_help(
            real_helps["rpc-server"]
        )

    def test_removed_flags_are_not_documented(self, engine_help_dir):
        """A flag listed with "the argument has been removed" is not documented; before that it was."""
        old = parse_llamacpp_help(help_files(engine_help_dir, "4227c9b")["llama-server"])
        new_text = help_files(engine_help_dir, "0c1e570")["llama-server"]
        assert "--draft, --draft-n, --draft-max N       the argument has been removed" in new_text
        new = parse_llamacpp_help(new_text)
        assert {"--draft", "--draft-n", "--draft-max", "--draft-min"} <= old
        assert not {"--draft", "--draft-n", "--draft-max", "--draft-min", "--spec-ngram-size-n"} & new

    def test_renames_between_the_checked_commits(self, engine_help_dir):
        """--no-mmap and --mlock gave way to --load-mode; the help's own record of the renames."""
        old = parse_llamacpp_help(help_files(engine_help_dir, "4227c9b")["llama-server"])
        new = parse_llamacpp_help(help_files(engine_help_dir, "0c1e570")["llama-server"])
        assert {"--no-mmap", "--mlock"} <= old and not {"--no-mmap", "--mlock"} & new
        assert "--load-mode" in new and "--load-mode" not in old

    def test_section_titles_define_nothing(self):
        """``----- common params -----`` is a title, and description lines define nothing."""
        text = (
            "----- common params -----\n\n"
            "--rpc SERVERS                           comma-separated list of RPC servers\n"
            "                                        --port is not defined here\n"
        )
        assert parse_llamacpp_help(text) == {"--rpc"}


class TestEngineCheck:
    """engine-check on real llama.cpp help: one help per program."""

    def test_passes_on_each_checked_commit(self, real_helps):
        """Every flag of rank 0 and the workers is documented, and each help looks complete."""
        report = check_engine(LlamaCppEngine(), real_helps)
        assert report.ok and not report.warnings
        assert {(f.program, f.flag) for f in report.flags} == {
            ("llama-server", "-m"),
            ("llama-server", "--alias"),
            ("llama-server", "--host"),
            ("llama-server", "--port"),
            ("llama-server", "-ngl"),
            ("llama-server", "--rpc"),
            ("llama-server", "--lora"),
            ("llama-server", "--lora-init-without-apply"),
            ("rpc-server", "--host"),
            ("rpc-server", "--port"),
        }

    def test_rpc_renamed_longer(self, real_helps):
        """--rpc renamed --rpc-servers on its option line is named missing."""
        server = real_helps["llama-server"]
        renamed = server.replace("\n--rpc SERVERS ", "\n--rpc-servers SERVERS ", 1)
        assert renamed != server
        report = check_engine(LlamaCppEngine(), {**real_helps, "llama-server": renamed})
        assert [(f.program, f.flag, f.possibly_truncated) for f in report.missing] == [
            ("llama-server", "--rpc", False)
        ]

    def test_helps_swapped(self, real_helps):
        """The worker's help given for llama-server (and back) is called out, and flags go missing."""
        swapped = {"llama-server": real_helps["rpc-server"], "rpc-server": real_helps["llama-server"]}
        report = check_engine(LlamaCppEngine(), swapped)
        assert any("the RPC worker's help, not llama-server's" in w for w in report.warnings)
        assert any("llama-server's help, not the RPC worker's" in w for w in report.warnings)
        # (4227c9b's worker takes -m too: its memory size, not a model)
        assert {f.flag for f in report.missing} >= {"--alias", "-ngl", "--rpc"}

    @pytest.mark.parametrize("half", ["first", "second"])
    def test_half_a_server_help_looks_truncated(self, real_helps, half):
        """Either half of llama-server's help draws a truncation warning; what it lacks is marked."""
        lines = real_helps["llama-server"].splitlines(keepends=True)
        cut = len(lines) // 2
        text = "".join(lines[:cut] if half == "first" else lines[cut:])
        report = check_engine(LlamaCppEngine(), {**real_helps, "llama-server": text})
        assert any(w.startswith("llama-server:") for w in report.warnings)
        assert report.missing and all(f.possibly_truncated for f in report.missing)


def test_version_is_the_commit():
    """The version llama-server prints is read as its commit, the spelling checked_versions uses."""
    engine = LlamaCppEngine()
    assert engine.parse_version("version: 11312 (0c1e57098)\nbuilt with cc") == "0c1e570"
    assert engine.parse_version("version: 1 (4227c9b)") in engine.checked_versions
    assert engine.parse_version("usage: llama-server") is None


class TestFailureDetection:
    """What the agent needs to run llama.cpp's RPC replicas and see a lost or hung worker."""

    def test_rank_zero_waits_for_workers(self):
        """Rank 0 dials its workers once and aborts if one is not up: the agent must start it last."""
        assert LlamaCppEngine.wait_for_workers is True

    def test_liveness_probe_is_a_real_one_token_decode(self):
        """/health stays 200 with a lost or hung worker: the probe is a 1-token completion with a timeout."""
        probe = LlamaCppEngine.liveness_probe
        assert (probe.method, probe.path) == ("POST", "/completion")
        assert probe.body["n_predict"] == 1
        assert 0 < probe.timeout <= 30 and 0 < probe.interval <= 30

    @pytest.mark.parametrize(
        ("text", "version"),
        [
            ("version: 1 (4227c9b)\nbuilt with cc", "4227c9b"),
            ("version: 0.5.0-dev (build 11312, commit 0c1e570)\nbuilt with GNU 12", "0c1e570"),
            ("version: 0.5.0-dev (build 0, commit unknown)", None),
        ],
    )
    def test_version_of_old_and_new_builds(self, text, version):
        """Both --version formats give the commit; a build without git gives none."""
        assert LlamaCppEngine().parse_version(text) == version


class TestContinuation:
    """Which llama-server builds continue a last assistant message (the assistant prefill)."""

    @pytest.mark.parametrize("commit", ["4227c9b", "0c1e570"])
    def test_checked_commits_continue(self, commit):
        """Both checked commits prefill a last assistant message by default."""
        assert LlamaCppEngine().continues_final_message(commit, ("-c", "4096")) is True

    def test_no_prefill_flag_turns_it_off(self):
        """With ``--no-prefill-assistant`` a last assistant message is read as whole: no continuation."""
        assert LlamaCppEngine().continues_final_message("0c1e570", ("--no-prefill-assistant",)) is False

    @pytest.mark.parametrize("commit", ["abcdef1", None])
    def test_unknown_commits_do_not(self, commit):
        """A commit not known to have the prefill does not count (commits do not order)."""
        assert LlamaCppEngine().continues_final_message(commit, ()) is False


#: the adapters of LORA_SPEC, by name and file
AT_START = (("sql", "/adapters/sql.gguf"), ("chat", "/adapters/chat.gguf"), ("poem", "/adapters/poem.gguf"))
#: a one-node replica on one GPU, its adapters loaded at start
LORA_SPEC = attrs.evolve(
    SPEC,
    nnodes=1,
    dist_init_addr=None,
    peer_addrs=(),
    adapters=(),
    extra_args=(),
    gpus=(0,),
    lora=LoraSpec(max_loaded=3, at_start=AT_START),
)


class TestLoraCommand:
    """Every adapter is loaded at start, in id order, applied to no request by default."""

    def test_one_lora_flag_per_adapter_in_order(self):
        """Rank 0 gets --lora FILE per adapter in at_start order, then --lora-init-without-apply."""
        argv = LlamaCppEngine().build_command(LORA_SPEC).argv
        files = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--lora"]
        assert files == ["/adapters/sql.gguf", "/adapters/chat.gguf", "/adapters/poem.gguf"]
        assert "--lora-init-without-apply" in argv

    def test_workers_get_no_adapters(self):
        """RPC workers only hold layers: no LoRA flag (rpc-server has none)."""
        spec = attrs.evolve(
            LORA_SPEC,
            nnodes=2,
            rank=1,
            dist_init_addr="10.0.0.5:20002",
            peer_addrs=("10.0.0.5:20001", "10.0.0.6:20011"),
            host="10.0.0.6",
        )
        argv = LlamaCppEngine().build_command(spec).argv
        assert not [arg for arg in argv if "lora" in arg]

    def test_adapters_must_be_given_at_start(self):
        """A LoraSpec with nothing at start is an error naming the field: llama-server cannot load later."""
        with pytest.raises(ValueError, match="spec.lora.at_start is empty"):
            LlamaCppEngine().build_command(attrs.evolve(LORA_SPEC, lora=LoraSpec(max_loaded=3)))

    def test_comma_in_a_path(self):
        """A path with a comma is refused, naming the adapter: 0c1e570 splits --lora values on commas."""
        with pytest.raises(ValueError, match="LoRA adapter 'sql'.*comma"):
            lora_args(LoraSpec(max_loaded=1, at_start=(("sql", "/adapters/a,b.gguf"),)))


class TestLoraCalls:
    """No call loads or unloads; a request chooses its adapter by id."""

    def test_load_and_unload_need_no_call(self):
        """Every adapter was loaded at start: load and unload are no calls."""
        assert LlamaCppEngine.lora_at_start
        assert LlamaCppEngine().lora_load("sql", "/adapters/sql.gguf") is None
        assert LlamaCppEngine().lora_unload("sql") is None

    def test_request_selects_by_id(self):
        """The chosen adapter at scale 1 by its --lora position, every other at 0."""
        known = [name for name, _ in AT_START]
        assert LlamaCppEngine().lora_request_fields("chat", "llama-8b", known) == {
            "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}, {"id": 2, "scale": 0.0}]
        }

    def test_base_request_zeroes_every_adapter(self):
        """A base-model request lists every adapter at scale 0 (some builds apply them otherwise)."""
        known = [name for name, _ in AT_START]
        assert LlamaCppEngine().lora_base_request_fields("llama-8b", known) == {
            "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}, {"id": 2, "scale": 0.0}]
        }
        assert LlamaCppEngine().lora_base_request_fields("llama-8b", []) == {}

    def test_unknown_adapter(self):
        """An adapter llama-server was not started with is an error naming it."""
        with pytest.raises(ValueError, match="'other' is not one llama-server loaded at start"):
            LlamaCppEngine().lora_request_fields("other", "llama-8b", ["sql"])


class TestLoraEngineCheck:
    """engine-check knows the LoRA flags from the real help texts."""

    def test_accepted_with_their_feature(self, real_helps):
        """Both checked commits document --lora and --lora-init-without-apply on llama-server."""
        report = check_engine(LlamaCppEngine(), real_helps)
        assert report.ok and not report.warnings
        features = {(f.program, f.flag): f.feature for f in report.flags}
        assert features[("llama-server", "--lora")] == "LoRA adapters (loaded at start)"
        assert (
            features[("llama-server", "--lora-init-without-apply")] == "LoRA adapters (applied per request)"
        )

    def test_a_help_without_lora_init_without_apply_says_so(self, real_helps):
        """A llama-server help without --lora-init-without-apply fails, naming the flag and what it serves."""
        server = real_helps["llama-server"]
        lacking = re.sub(r"^--lora-init-without-apply .*\n", "", server, count=1, flags=re.MULTILINE)
        assert lacking != server
        report = check_engine(LlamaCppEngine(), {**real_helps, "llama-server": lacking})
        [missing] = report.missing
        assert (missing.program, missing.flag) == ("llama-server", "--lora-init-without-apply")
        assert missing.feature == "LoRA adapters (applied per request)"
