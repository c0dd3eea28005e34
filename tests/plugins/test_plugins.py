"""The plugin manager, ``llmgw plugins`` and ``llmgw ctl engines``."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

import llmgw
from llmgw.engine import Engine
from llmgw.errors import DuplicateEngineError, PluginError, UnknownEngineError
from llmgw.models import Command, LaunchSpec
from llmgw.plugins import BUILTIN_PLUGINS, PluginRecord, Plugins, get_plugin_manager
from llmgw.provision import MachineRequest, Provisioner


def write_distribution(
    site: Path, name: str, version: str, entry_points: dict[str, str], modules: dict[str, str]
) -> Path:
    """Lay out an installed distribution as an installer would: modules and a dist-info."""
    site.mkdir(parents=True, exist_ok=True)
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = ["[llmgw]"] + [f"{ep} = {target}" for ep, target in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return site


def run_llmgw(
    exe: str, *args: str, env: dict[str, str], site: Path | None = None
) -> subprocess.CompletedProcess:
    """Run the real console script, with ``site`` on its import path when given."""
    env = dict(env)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=60)


class _FakeEngine(Engine):
    name = "fake"
    checked_versions = ("1.0",)
    programs = ("fake-engine",)

    def build_command(self, spec: LaunchSpec) -> Command:
        return Command(argv=[self.program_path(spec, "fake-engine"), "--port", str(spec.port)])

    def widest_spec(self) -> LaunchSpec:
        return LaunchSpec(model_source="/m", served_name="m", host="127.0.0.1", port=1)


class EnginePlugin:
    def __init__(self, *engines: Engine) -> None:
        self.engines = list(engines)

    @llmgw.hookimpl
    def llmgw_register_engines(self) -> list[Engine]:
        return self.engines


def broken_distribution(site: Path, source: str) -> Path:
    """``llmgw-engine-broken`` 0.3.1 installed in ``site``: its entry point's module is ``source``."""
    entry_points, modules = {"broken": "llmgw_engine_broken"}, {"llmgw_engine_broken": source}
    return write_distribution(site, "llmgw-engine-broken", "0.3.1", entry_points, modules)


class TestPluginsCommand:
    """``llmgw plugins`` as an operator runs it."""

    def test_lists_builtins_and_sim_with_versions(self, llmgw_exe, clean_env):
        """Both discovery plugins and the sim engine are listed with their distribution versions."""
        result = run_llmgw(llmgw_exe, "plugins", "--json", env=clean_env)
        assert result.returncode == 0, result.stderr
        records = {r["name"]: r for r in json.loads(result.stdout)}
        for builtin in BUILTIN_PLUGINS:
            assert records[builtin]["distribution"] == "llmgw"
            assert records[builtin]["version"] == metadata.version("llmgw")
            assert records[builtin]["status"] == "loaded"
        assert records["llmgw_nvidia"]["hooks"] == ["llmgw_discover_gpus"]
        assert records["llmgw_infiniband"]["hooks"] == ["llmgw_discover_adapters"]
        sim = records["sim"]
        assert sim["distribution"] == "llmgw-engine-sim"
        assert sim["version"] == metadata.version("llmgw-engine-sim")
        assert sim["engines"] == ["sim"]
        assert sim["hooks"] == ["llmgw_register_engines"]

    def test_broken_distribution_is_listed_with_its_error(self, llmgw_exe, clean_env, tmp_path):
        """A plugin that fails to import is listed with its error; the others still load."""
        site = broken_distribution(tmp_path / "site", "import a_module_that_is_not_installed\n")
        result = run_llmgw(llmgw_exe, "plugins", "--json", env=clean_env, site=site)
        assert result.returncode == 1, "a failed plugin must make `llmgw plugins` exit 1"
        records = {r["name"]: r for r in json.loads(result.stdout)}
        broken = records["broken"]
        assert broken["status"] == "failed"
        assert broken["distribution"] == "llmgw-engine-broken"
        assert broken["version"] == "0.3.1"
        assert "a_module_that_is_not_installed" in broken["error"]
        assert records["sim"]["status"] == "loaded"
        assert records["llmgw_nvidia"]["status"] == "loaded"

    def test_table_names_the_broken_plugin_on_stderr(self, llmgw_exe, clean_env, tmp_path):
        """The table view prints a failed plugin's error on stderr, by name."""
        site = broken_distribution(tmp_path / "site", "raise RuntimeError('engine plugin exploded')\n")
        result = run_llmgw(llmgw_exe, "plugins", env=clean_env, site=site)
        assert result.returncode == 1
        assert "broken" in result.stdout and "failed" in result.stdout
        assert "broken: RuntimeError: engine plugin exploded" in result.stderr

    def test_empty_allowlist_loads_no_installed_plugin(self, llmgw_exe, clean_env):
        """LLMGW_LOAD_PLUGINS set but empty disables every installed plugin, not the built-ins."""
        env = {**clean_env, "LLMGW_LOAD_PLUGINS": ""}
        result = run_llmgw(llmgw_exe, "plugins", "--json", env=env)
        assert result.returncode == 0, result.stderr
        records = {r["name"]: r for r in json.loads(result.stdout)}
        assert records["sim"]["status"] == "disabled"
        assert "LLMGW_LOAD_PLUGINS" in records["sim"]["error"]
        assert records["llmgw_nvidia"]["status"] == "loaded"

    def test_allowlist_by_distribution_name(self, llmgw_exe, clean_env, tmp_path):
        """LLMGW_LOAD_PLUGINS naming a distribution loads it and leaves the others out."""
        site = broken_distribution(tmp_path / "site", "raise RuntimeError('must not be imported')\n")
        env = {**clean_env, "LLMGW_LOAD_PLUGINS": "llmgw-engine-sim"}
        result = run_llmgw(llmgw_exe, "plugins", "--json", env=env, site=site)
        assert result.returncode == 0, result.stderr
        records = {r["name"]: r for r in json.loads(result.stdout)}
        assert records["sim"]["status"] == "loaded"
        assert records["broken"]["status"] == "disabled"

    def test_allowlist_naming_nothing_installed_is_reported(self, llmgw_exe, clean_env):
        """A name in LLMGW_LOAD_PLUGINS that matches no plugin is an error, not silence."""
        env = {**clean_env, "LLMGW_LOAD_PLUGINS": "llmgw-engine-sim,llmgw-engine-vlm"}
        result = run_llmgw(llmgw_exe, "plugins", "--json", env=env)
        assert result.returncode == 1
        records = {r["name"]: r for r in json.loads(result.stdout)}
        assert "no installed plugin has that name" in records["llmgw-engine-vlm"]["error"]

    def test_trace_prints_hook_calls(self, llmgw_exe, clean_env):
        """LLMGW_TRACE_PLUGINS shows each hook call on stderr."""
        env = {**clean_env, "LLMGW_TRACE_PLUGINS": "1"}
        result = run_llmgw(llmgw_exe, "ctl", "engines", env=env)
        assert result.returncode == 0, result.stderr
        assert "llmgw_register_engines" in result.stderr


class TestCtlEngines:
    """``llmgw ctl engines``."""

    def test_lists_sim_with_checked_versions(self, llmgw_exe, clean_env):
        """The sim engine is listed with its plugin and the versions it was checked against."""
        result = run_llmgw(llmgw_exe, "ctl", "engines", "--json", env=clean_env)
        assert result.returncode == 0, result.stderr
        engines = {e["name"]: e for e in json.loads(result.stdout)}
        assert engines["sim"]["plugin"] == "sim"
        assert engines["sim"]["distribution"] == "llmgw-engine-sim"
        assert engines["sim"]["checked_versions"] == [metadata.version("llmgw-engine-sim")]
        assert engines["sim"]["multi_node"] is True

    def test_duplicate_engine_names_both_distributions(self, llmgw_exe, clean_env, tmp_path):
        """A second distribution registering `sim` is refused, naming both distributions."""
        site = write_distribution(
            tmp_path / "site",
            "llmgw-engine-othersim",
            "2.0.0",
            {"othersim": "llmgw_engine_othersim"},
            {
                "llmgw_engine_othersim": """
                import llmgw
                from llmgw_engine_sim import SimEngine

                @llmgw.hookimpl
                def llmgw_register_engines():
                    return [SimEngine()]
                """
            },
        )
        result = run_llmgw(llmgw_exe, "ctl", "engines", env=clean_env, site=site)
        assert result.returncode == 1
        assert "engine 'sim' is registered twice" in result.stderr
        assert "llmgw-engine-sim" in result.stderr and "llmgw-engine-othersim 2.0.0" in result.stderr
        assert "Traceback" not in result.stderr


def load_failing(plugin: object) -> tuple[Plugins, PluginRecord]:
    """A manager loading ``plugin`` alone, and its record, which must say it failed."""
    manager = get_plugin_manager(entry_points=False, plugins=[plugin])
    record = next(r for r in manager.records() if r.name == type(plugin).__name__)
    assert record.status == "failed", record
    return manager, record


class TestPluginManager:
    """``get_plugin_manager`` with explicit plugins, as tests and embedders call it."""

    def test_builds_fresh_each_call(self):
        """Two calls give two independent managers: nothing is registered on import."""
        first = get_plugin_manager(entry_points=False, plugins=[EnginePlugin(_FakeEngine())])
        second = get_plugin_manager(entry_points=False)
        assert "fake" in first.engines()
        assert "fake" not in second.engines()

    def test_misspelt_hook_is_a_load_error(self):
        """A hookimpl whose name matches no hook is refused with the name in the error."""

        class Misspelt:
            @llmgw.hookimpl
            def llmgw_register_engine(self):
                return []

        _, record = load_failing(Misspelt())
        assert "llmgw_register_engine" in record.error

    def test_wrong_hook_argument_is_a_load_error(self):
        """A hookimpl asking for an argument the hook does not have is refused."""

        class WrongArgs:
            @llmgw.hookimpl
            def llmgw_discover_gpus(self, nvidia_smi_path):
                return None

        _, record = load_failing(WrongArgs())
        assert "nvidia_smi_path" in record.error

    def test_register_hook_raising_is_recorded_against_the_plugin(self):
        """A plugin whose engine registration raises is listed as failed; asking for engines says which."""

        class Raises:
            @llmgw.hookimpl
            def llmgw_register_engines(self):
                raise RuntimeError("no CUDA toolkit")

        manager, record = load_failing(Raises())
        assert "no CUDA toolkit" in record.error
        with pytest.raises(PluginError, match="'Raises'.*no CUDA toolkit"):
            manager.engines()

    def test_non_engine_return_is_refused(self):
        """Registering something that is not an Engine is an error naming the plugin."""

        class NotAnEngine:
            @llmgw.hookimpl
            def llmgw_register_engines(self):
                return ["vllm"]

        manager = get_plugin_manager(entry_points=False, plugins=[NotAnEngine()])
        with pytest.raises(PluginError, match="NotAnEngine.*'vllm', not a Engine instance"):
            manager.engines()

    def test_duplicate_engine_raises(self):
        """Two plugins registering one engine name raise DuplicateEngineError naming both."""
        first, second = EnginePlugin(_FakeEngine()), EnginePlugin(_FakeEngine())
        manager = get_plugin_manager(entry_points=False, plugins=[first, second])
        with pytest.raises(DuplicateEngineError, match="engine 'fake' is registered twice"):
            manager.engines()

    def test_unknown_engine_lists_the_known_ones(self):
        """Asking for an engine nobody provides lists the engines there are."""
        manager = get_plugin_manager(entry_points=False, plugins=[EnginePlugin(_FakeEngine())])
        with pytest.raises(UnknownEngineError, match=r"'vllm' \(engines there are: fake\)"):
            manager.engine("vllm")


def test_hook_llmgw_register_engines():
    """Engines registered through the hook are collected with their plugin and versions."""
    manager = get_plugin_manager(entry_points=False, plugins=[EnginePlugin(_FakeEngine())])
    record = manager.engines()["fake"]
    assert record.plugin == "EnginePlugin"
    assert record.checked_versions == ("1.0",)
    assert isinstance(record.engine, _FakeEngine)


def test_hook_llmgw_register_provisioners():
    """Provisioners registered through the hook are found by name; duplicates are refused."""

    class Fake(Provisioner):
        name = "fakevisor"

        def exists_command(self, request: MachineRequest) -> Command:
            return Command(argv=["fakevisor", "status", str(request.vmid)])

        def create_commands(self, request: MachineRequest) -> list[Command]:
            return [Command(argv=["fakevisor", "create", str(request.vmid)])]

    class Plugin:
        @llmgw.hookimpl
        def llmgw_register_provisioners(self):
            return [Fake()]

    manager = get_plugin_manager(entry_points=False, plugins=[Plugin()])
    assert isinstance(manager.provisioners()["fakevisor"], Fake)
    record = next(r for r in manager.records() if r.name == "Plugin")
    assert record.provisioners == ("fakevisor",)
    twice = get_plugin_manager(entry_points=False, plugins=[Plugin(), Plugin()])
    with pytest.raises(PluginError, match="provisioner 'fakevisor' is registered twice"):
        twice.provisioners()

    class llmgw_engine_extras(Plugin):  # noqa: N801 - a plugin named like an engine distribution
        pass

    named = get_plugin_manager(entry_points=False, plugins=[Plugin(), llmgw_engine_extras()])
    with pytest.raises(PluginError) as info:
        named.provisioners()
    assert type(info.value) is PluginError, "a duplicate provisioner is not a duplicate engine"
