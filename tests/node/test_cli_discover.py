"""``llmgw discover`` and the discover_node helper the agent shares with it."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner, Result

from llmgw import hookimpl
from llmgw.errors import FabricError
from llmgw.models import DiscoverySettings, Fabric, GpuReport
from llmgw.node.cli import discover
from llmgw.node.discovery import discover_node
from llmgw.plugins import get_plugin_manager
from llmgw.testing.fakes import DRIVER_FAILURE, make_gpus, write_fake_nvidia_smi, write_ib_sysfs

ADAPTERS = {"mlx5_0": "ACTIVE", "mlx5_1": "ACTIVE", "mlx5_2": "ACTIVE", "mlx5_3": "DOWN"}


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, Path]:
    """A fake node: two H100s and four adapters, mlx5_3 down."""
    smi = write_fake_nvidia_smi(tmp_path / "nvidia-smi", make_gpus(2))
    ib = write_ib_sysfs(tmp_path / "ib", ADAPTERS)
    return smi, ib


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(discover, [str(a) for a in args], catch_exceptions=False)


def run_json(*args: str | Path) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


class TestCommand:
    """What an operator sees from llmgw discover."""

    def test_table_shows_gpus_adapters_and_fabrics(self, node: tuple[Path, Path]) -> None:
        """GPUs, each adapter port with its state, and the resolved fabric are all shown."""
        smi, ib = node
        result = run("--nvidia-smi", smi, "--ib-root", ib, "--fabric", "ib-a")
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert lines[0] == "GPUs (llmgw_nvidia: 2 GPUs)"
        for gpu in make_gpus(2):
            assert gpu.uuid in result.stdout
        assert any(line.split()[:3] == ["mlx5_3", "1", "DOWN"] for line in lines)
        assert any(line.split() == ["ib-a", "mlx5_0,", "mlx5_1"] for line in lines)
        assert "Problems" not in result.stdout

    def test_json_has_the_same_facts(self, node: tuple[Path, Path]) -> None:
        """--json gives GPUs, adapters with activity, fabrics and no problems."""
        smi, ib = node
        data = run_json("--nvidia-smi", smi, "--ib-root", ib, "--fabric", "ib-a:mlx5_2")
        assert data["gpus"] == [attrs.asdict(g) for g in make_gpus(2)]
        assert [(a["name"], a["active"]) for a in data["adapters"]] == [
            ("mlx5_0", True), ("mlx5_1", True), ("mlx5_2", True), ("mlx5_3", False)
        ]
        assert data["fabrics"] == [{"name": "ib-a", "adapters": ["mlx5_2"]}]
        assert data["problems"] == []

    def test_missing_failing_and_zero_gpus_are_distinct(self, tmp_path: Path) -> None:
        """Missing, failing and empty nvidia-smi all exit 0 but report three different things."""
        missing = run_json("--nvidia-smi", tmp_path / "absent", "--ib-root", tmp_path / "no-ib")
        failing = run_json(
            "--nvidia-smi", write_fake_nvidia_smi(tmp_path / "bad", fail=DRIVER_FAILURE),
            "--ib-root", tmp_path / "no-ib",
        )
        empty = run_json(
            "--nvidia-smi", write_fake_nvidia_smi(tmp_path / "none", []),
            "--ib-root", tmp_path / "no-ib",
        )
        statuses = [d["reports"][0]["status"] for d in (missing, failing, empty)]
        assert statuses == ["not-found", "failed", "ok"]
        assert missing["problems"] == [
            f"nvidia-smi not found at {tmp_path / 'absent'}: no such file; "
            "pass --nvidia-smi with the path of nvidia-smi"
        ]
        assert failing["problems"][0].startswith("nvidia-smi failed: NVIDIA-SMI has failed")
        assert (empty["gpus"], empty["problems"]) == ([], [])

    def test_table_lists_problems(self, tmp_path: Path) -> None:
        """A failing nvidia-smi shows under Problems, with its message."""
        smi = write_fake_nvidia_smi(tmp_path / "bad", fail=DRIVER_FAILURE)
        result = run("--nvidia-smi", smi, "--ib-root", tmp_path / "no-ib")
        assert result.exit_code == 0
        problems = result.stdout.split("\nProblems\n")[1]
        assert problems.startswith("- nvidia-smi failed: NVIDIA-SMI has failed")

    def test_island_node_is_not_a_problem(self, node: tuple[Path, Path], tmp_path: Path) -> None:
        """No InfiniBand root and no --fabric: an island, no problem listed."""
        smi, _ = node
        result = run("--nvidia-smi", smi, "--ib-root", tmp_path / "no-ib")
        assert result.exit_code == 0
        assert "none: an island node" in result.stdout
        assert "Problems" not in result.stdout

    def test_bad_fabric_exits_1_with_the_reason(self, node: tuple[Path, Path]) -> None:
        """A --fabric naming a down adapter exits 1 with the adapter, its state and a fix."""
        smi, ib = node
        result = run("--nvidia-smi", smi, "--ib-root", ib, "--fabric", "ib-b:mlx5_2,mlx5_3")
        assert result.exit_code == 1
        assert result.stderr == (
            "error: --fabric ib-b: adapter mlx5_3 is DOWN (port 1); "
            "name active adapters or bring the port up\n"
        )
        assert result.stdout == ""

    def test_malformed_fabric_exits_1(self, node: tuple[Path, Path]) -> None:
        """A malformed --fabric exits 1 quoting it."""
        smi, ib = node
        result = run("--nvidia-smi", smi, "--ib-root", ib, "--fabric", "ib-a:")
        assert result.exit_code == 1
        assert result.stderr.startswith("error: --fabric 'ib-a:': no adapter after ':'")

    def test_fabric_without_adapters_root_says_where_it_looked(
        self, node: tuple[Path, Path], tmp_path: Path
    ) -> None:
        """A fabric on a node whose --ib-root is absent fails naming the root."""
        smi, _ = node
        result = run("--nvidia-smi", smi, "--ib-root", tmp_path / "no-ib", "--fabric", "ib-a")
        assert result.exit_code == 1
        assert "no RDMA adapter" in result.stderr
        assert str(tmp_path / "no-ib") in result.stderr


class Recorder:
    """A GPU discovery plugin that records its calls and returns what it is given."""

    def __init__(self, result: object = None, error: Exception | None = None) -> None:
        self.calls: list[DiscoverySettings] = []
        self.result = result
        self.error = error

    @hookimpl
    def llmgw_discover_gpus(self, settings: DiscoverySettings) -> object:
        self.calls.append(settings)
        if self.error is not None:
            raise self.error
        return self.result


class TestDiscoverNode:
    """The helper the agent calls: merged facts and one problem line each."""

    def settings(self, node: tuple[Path, Path]) -> DiscoverySettings:
        return DiscoverySettings(nvidia_smi=str(node[0]), ib_root=str(node[1]))

    def test_returns_gpus_adapters_fabrics_and_problems(self, node: tuple[Path, Path]) -> None:
        """It unpacks as (gpus, adapters, fabrics, problems)."""
        plugins = get_plugin_manager(entry_points=False)
        gpus, adapters, fabrics, problems = discover_node(plugins, self.settings(node), ["ib-a"])
        assert gpus == tuple(make_gpus(2))
        assert [a.name for a in adapters] == sorted(ADAPTERS)
        assert fabrics == (Fabric("ib-a", ("mlx5_0", "mlx5_1")),)
        assert problems == ()

    def test_a_plugin_that_raises_is_a_problem_and_others_still_report(
        self, node: tuple[Path, Path]
    ) -> None:
        """One broken plugin becomes a problem naming it; the built-in GPUs are still found."""
        broken = Recorder(error=RuntimeError("boom"))
        plugins = get_plugin_manager(plugins=[broken], entry_points=False)
        result = discover_node(plugins, self.settings(node), [])
        assert len(result.gpus) == 2
        assert result.problems == ("plugin 'Recorder': llmgw_discover_gpus raised RuntimeError: boom",)

    def test_a_plugin_returning_garbage_is_a_problem(self, node: tuple[Path, Path]) -> None:
        """A hook returning something other than a report is named as a problem."""
        plugins = get_plugin_manager(plugins=[Recorder(result=["GPU 0"])], entry_points=False)
        result = discover_node(plugins, self.settings(node), [])
        assert result.problems == (
            "plugin 'Recorder': llmgw_discover_gpus returned ['GPU 0'], not a GpuReport",
        )

    def test_reports_from_several_plugins_are_merged(self, node: tuple[Path, Path]) -> None:
        """GPUs from another plugin join the built-in ones; its not-found is a problem."""
        other = Recorder(result=GpuReport(source="other", status="not-found", problem="no rocm-smi"))
        plugins = get_plugin_manager(plugins=[other], entry_points=False)
        result = discover_node(plugins, self.settings(node), [])
        assert len(result.gpus) == 2
        assert result.problems == ("no rocm-smi",)

    def test_bad_fabric_is_refused_before_discovery_runs(self, node: tuple[Path, Path]) -> None:
        """A malformed --fabric is refused before any discovery hook is called."""
        recorder = Recorder()
        plugins = get_plugin_manager(plugins=[recorder], entry_points=False)
        with pytest.raises(FabricError, match="invalid fabric name"):
            discover_node(plugins, self.settings(node), ["IB A"])
        assert recorder.calls == []
