"""The Engine API of llmgw 0.2: facts as class attributes, a default widest spec, and engines written
for llmgw 0.1 refused with what to change."""

from __future__ import annotations

import json

import pytest
from test_plugins import EnginePlugin, run_llmgw, write_distribution

from llmgw.engine import Engine, HelpAndVersion, LivenessProbe, help_and_version_of, openai_canary
from llmgw.enginecheck import check_engine, widest_commands
from llmgw.errors import PluginError
from llmgw.models import Command, LaunchSpec
from llmgw.plugins import get_plugin_manager
from llmgw.testing.pytest_plugin import HELP_DIR_ENV, find_engine_help_dir

#: an engine written against llmgw 0.1: every fact a method
OLD_ENGINE = """
    import llmgw
    from llmgw.engine import Engine
    from llmgw.models import Command, LaunchSpec


    class OldEngine(Engine):
        name = "old"
        checked_versions = ("1.0",)
        programs = ("old-server",)

        def build_command(self, spec):
            return Command(argv=["old-server", "--port", str(spec.port)])

        def widest_spec(self):
            return LaunchSpec(model_source="/m", served_name="m", host="127.0.0.1", port=1)

        def help_argv(self, program):
            return ("--help-all",)

        def help_env(self, program):
            return {}

        def version_argv(self, program):
            return ("-V",)

        def flag_features(self):
            return {"--port": "HTTP address"}

        def liveness_probe(self, spec):
            return None


    @llmgw.hookimpl
    def llmgw_register_engines():
        return [OldEngine()]
"""

#: what the refusal says, one sentence per method, in this order
ADVICE = [
    "help_argv(program) is now the class attribute "
    "`help_and_version = {PROGRAM: HelpAndVersion(help_args=(...))}`",
    "help_env(program) is now the class attribute "
    "`help_and_version = {PROGRAM: HelpAndVersion(help_env={...})}`",
    "version_argv(program) is now the class attribute "
    "`help_and_version = {PROGRAM: HelpAndVersion(version_args=(...))}`",
    "flag_features() is now the class attribute `flag_features = {FLAG: FEATURE}`",
    "liveness_probe(spec) is now the class attribute `liveness_probe = LivenessProbe(...)` (or None)",
]


class Minimal(Engine):
    """Only what an engine must write: its name, versions, programs and build_command."""

    name = "minimal"
    checked_versions = ("1.0",)
    programs = ("minimal-server",)

    def build_command(self, spec: LaunchSpec) -> Command:
        argv = [self.program_path(spec, "minimal-server"), "--port", str(spec.port)]
        if spec.nnodes > 1:
            argv += ["--rank", str(spec.rank), "--peers", ",".join(spec.peer_addrs)]
        return Command(argv=argv, env=self.device_env(spec))


class MultiNode(Minimal):
    name = "multi"
    multi_node = True


class OldButValid(Minimal):
    """Written for llmgw 0.1 with only what is still the API: build_command and its own widest_spec."""

    name = "oldvalid"

    def widest_spec(self) -> LaunchSpec:
        return LaunchSpec(model_source="/m", served_name="m", host="127.0.0.1", port=7)


def old_style(**methods) -> Engine:
    """A Minimal engine with some of llmgw 0.1's methods defined."""
    return type("Old", (Minimal,), {"name": "old", **methods})()


class TestFacts:
    """What an engine that writes only build_command gets."""

    def test_defaults(self):
        """--help and --version, no extra environment, OpenAI's one-token canary, no flag labels."""
        engine = Minimal()
        expected = HelpAndVersion(("--help",), {}, ("--version",))
        assert help_and_version_of(engine, "minimal-server") == expected
        assert engine.liveness_probe == openai_canary() and engine.flag_features == {}
        probe = engine.liveness_probe
        assert (probe.method, probe.path, probe.progress) == ("POST", "/v1/completions", None)
        assert probe.request_body("served") == {
            "prompt": "a",
            "max_tokens": 1,
            "temperature": 0,
            "model": "served",
        }

    def test_help_and_version_per_program(self):
        """A program's entry is used; a program without one gets the defaults."""

        class Two(Minimal):
            programs = ("a", "b")
            help_and_version = {"a": HelpAndVersion(help_args=("serve", "--help=all"), help_env={"X": "1"})}

        assert help_and_version_of(Two(), "a").help_args == ("serve", "--help=all")
        assert help_and_version_of(Two(), "a").version_args == ("--version",)
        assert help_and_version_of(Two(), "b") == HelpAndVersion()

    def test_single_node_widest_spec(self):
        """One node, two GPUs, no fabric."""
        spec = Minimal().widest_spec()
        assert (spec.nnodes, spec.gpus, spec.adapters, spec.dist_init_addr) == (1, (0, 1), (), None)

    def test_multi_node_widest_spec(self):
        """Three nodes on a fabric, each rank's address known: every rank builds."""
        spec = MultiNode().widest_spec()
        assert spec.nnodes == 3 and len(spec.peer_addrs) == 3 and spec.adapters
        assert [s.rank for s, _, _ in widest_commands(MultiNode())] == [0, 1, 2]

    def test_engine_check_reads_the_facts(self):
        """engine-check labels flags from flag_features, as before."""

        class Labelled(Minimal):
            flag_features = {"--port": "HTTP address"}

        help_text = "usage: minimal-server [-h] [--port PORT]\n  -h, --help   help\n  --port PORT  port\n"
        report = check_engine(Labelled(), {"minimal-server": help_text})
        assert report.ok and [(f.flag, f.feature) for f in report.flags] == [("--port", "HTTP address")]


class TestOldEngines:
    """Engines written for llmgw 0.1: refused, saying what to change, unless they are still valid."""

    def test_old_but_valid_keeps_working(self):
        """An engine defining only build_command and widest_spec (abstract in 0.1) still loads."""
        engines = get_plugin_manager(plugins=[EnginePlugin(OldButValid())], entry_points=False).engines()
        assert engines["oldvalid"].engine.widest_spec().port == 7

    @pytest.mark.parametrize(
        ("method", "advice"),
        [
            ("help_argv", ADVICE[0]),
            ("help_env", ADVICE[1]),
            ("version_argv", ADVICE[2]),
            ("flag_features", ADVICE[3]),
            ("liveness_probe", ADVICE[4]),
        ],
    )
    def test_each_old_method_is_named(self, method, advice):
        """Each method that is a fact now refuses the engine, with the attribute to write instead."""
        engine = old_style(**{method: lambda self, *args: None})
        plugins = get_plugin_manager(plugins=[EnginePlugin(engine)], entry_points=False)
        with pytest.raises(PluginError) as caught:
            plugins.engines()
        assert str(caught.value) == f"plugin 'EnginePlugin': engine 'old': {advice}; see docs/plugins.md"

    def test_others_still_listed(self):
        """The refused engine's plugin is failed; another plugin's engine is still there."""
        refused, kept = EnginePlugin(old_style(help_argv=lambda self, p: ())), EnginePlugin(Minimal())
        plugins = get_plugin_manager(plugins=[refused, kept], entry_points=False)
        records = {r.name: r for r in plugins.records() if not r.builtin}
        failed, loaded = records["EnginePlugin"], records["EnginePlugin-2"]
        assert failed.status == "failed" and "help_argv(program) is now" in failed.error
        assert loaded.status == "loaded" and loaded.engines == ("minimal",)

    def test_llmgw_plugins_lists_it_failed(self, tmp_path, llmgw_exe, clean_env):
        """An installed 0.1 engine is listed failed by ``llmgw plugins``, naming it, its distribution and
        every change; the other plugins load."""
        site = write_distribution(
            tmp_path / "site", "llmgw-engine-old", "1.0", {"old": "old_engine"}, {"old_engine": OLD_ENGINE}
        )
        result = run_llmgw(llmgw_exe, "plugins", "--json", env=clean_env, site=site)
        assert result.returncode == 1, "a failed plugin makes `llmgw plugins` exit 1"
        records = {r["name"]: r for r in json.loads(result.stdout)}
        assert records["old"]["status"] == "failed"
        assert records["old"]["error"] == (
            "engine 'old' (dist llmgw-engine-old): " + "; ".join(ADVICE) + "; see docs/plugins.md"
        )
        assert records["sim"]["status"] == "loaded"


def test_liveness_probe_is_a_value():
    """An engine names its probe once, as a LivenessProbe."""

    class Probed(Minimal):
        liveness_probe = LivenessProbe("POST", "/completion", body={"n_predict": 1})

    assert Probed.liveness_probe.path == "/completion"


class TestEngineHelpDir:
    """Where the engine_help_dir fixture finds the real help texts."""

    def test_nearest_shared_folder_above(self, tmp_path):
        """shared/engine-help in the nearest folder above the tests' root (beside the repository)."""
        (tmp_path / "shared" / "engine-help").mkdir(parents=True)
        start = tmp_path / "repo" / "llmgw-engine-foo"
        start.mkdir(parents=True)
        assert find_engine_help_dir(start, environ={}) == tmp_path / "shared" / "engine-help"

    def test_variable_wins_and_absent_is_none(self, tmp_path):
        """LLMGW_ENGINE_HELP_DIR names the folder; a missing one, or none found, is None."""
        assert find_engine_help_dir(tmp_path, environ={HELP_DIR_ENV: str(tmp_path)}) == tmp_path
        assert find_engine_help_dir(tmp_path, environ={HELP_DIR_ENV: str(tmp_path / "no")}) is None
        # The machine may have a shared/engine-help above the temporary folder; none is made up below it.
        above = next(
            (p / "shared/engine-help" for p in tmp_path.parents if (p / "shared/engine-help").is_dir()), None
        )
        assert find_engine_help_dir(tmp_path, environ={}) == above
