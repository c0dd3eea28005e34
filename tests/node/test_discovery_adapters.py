"""Fabric adapter discovery from a sysfs-shaped directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from llmgw_infiniband import discover_adapters

from llmgw.models import Adapter, AdapterPort, DiscoverySettings
from llmgw.plugins import get_plugin_manager
from llmgw.testing.fakes import make_adapters, write_ib_sysfs


def settings_for(root: Path) -> DiscoverySettings:
    return DiscoverySettings(ib_root=str(root))


def write_port(root: Path, adapter: str, port: int, state: str, rate: str, link: str) -> None:
    base = root / adapter / "ports" / str(port)
    base.mkdir(parents=True, exist_ok=True)
    (base / "state").write_text(state + "\n")
    (base / "rate").write_text(rate + "\n")
    (base / "link_layer").write_text(link + "\n")


@pytest.fixture
def real_looking(tmp_path: Path) -> Path:
    """A tree written by hand with the contents a ConnectX-7 node shows."""
    root = tmp_path / "infiniband"
    for name, guid in (("mlx5_1", "b859:9f03:00d4:3f2b"), ("mlx5_0", "b859:9f03:00d4:3f2a")):
        (root / name).mkdir(parents=True)
        (root / name / "node_guid").write_text(guid + "\n")
    write_port(root, "mlx5_0", 1, "4: ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand")
    write_port(root, "mlx5_1", 1, "1: DOWN", "10 Gb/sec (4X SDR)", "Ethernet")
    return root


class TestRead:
    """What the plugin reads from a root that is there."""

    def test_reads_real_contents(self, real_looking: Path) -> None:
        """State words, rates and link layers come out as the kernel wrote them, sorted by name."""
        report = discover_adapters(settings_for(real_looking))
        assert report.status == "ok"
        assert report.adapters == (
            Adapter(
                name="mlx5_0",
                node_guid="b859:9f03:00d4:3f2a",
                ports=[AdapterPort(1, "ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand")],
            ),
            Adapter(
                name="mlx5_1",
                node_guid="b859:9f03:00d4:3f2b",
                ports=[AdapterPort(1, "DOWN", "10 Gb/sec (4X SDR)", "Ethernet")],
            ),
        )
        assert [a.active for a in report.adapters] == [True, False]

    def test_reads_what_the_test_helper_writes(self, tmp_path: Path) -> None:
        """A tree from write_ib_sysfs reads back as the adapters it was given."""
        adapters = make_adapters({"mlx5_0": "ACTIVE", "mlx5_1": ["DOWN", "INIT"], "mlx5_2": "ARMED"})
        report = discover_adapters(settings_for(write_ib_sysfs(tmp_path / "ib", adapters)))
        assert report.adapters == tuple(adapters)

    def test_ports_are_in_number_order(self, tmp_path: Path) -> None:
        """Port 10 comes after port 2, not before it."""
        root = write_ib_sysfs(tmp_path / "ib", {"mlx5_0": ["DOWN"] * 10 + ["ACTIVE"]})
        ports = discover_adapters(settings_for(root)).adapters[0].ports
        assert [p.number for p in ports] == list(range(1, 12))
        assert ports[-1].state == "ACTIVE"

    def test_empty_root_is_ok_with_no_adapters(self, tmp_path: Path) -> None:
        """A root with no adapter in it is ok: zero adapters, no problem."""
        (tmp_path / "ib").mkdir()
        report = discover_adapters(settings_for(tmp_path / "ib"))
        assert (report.status, report.adapters, report.problem) == ("ok", (), None)


class TestAbsentOrBroken:
    """A missing root is an island; a broken one is failed, naming the file."""

    def test_missing_root_is_an_island_not_an_error(self, tmp_path: Path) -> None:
        """No root means not-found, and the message names the root and says island."""
        report = discover_adapters(settings_for(tmp_path / "absent"))
        assert report.status == "not-found"
        assert str(tmp_path / "absent") in report.problem and "island" in report.problem

    def test_root_that_is_a_file_is_failed(self, tmp_path: Path) -> None:
        """An --ib-root pointing at a file is failed, naming it."""
        (tmp_path / "ib").write_text("")
        report = discover_adapters(settings_for(tmp_path / "ib"))
        assert report.status == "failed"
        assert f"{tmp_path / 'ib'}: expected a directory" in report.problem

    @pytest.mark.parametrize(
        ("relative", "content", "says"),
        [
            ("mlx5_0/ports/1/state", "ACTIVE", "'ACTIVE' is not a port state like '4: ACTIVE'"),
            ("mlx5_0/ports/1/state", "", "empty"),
            ("mlx5_0/node_guid", "not-a-guid", "'not-a-guid' is not a GUID"),
            ("mlx5_0/ports/1/rate", None, "missing"),
            ("mlx5_0/node_guid", None, "missing"),
        ],
    )
    def test_malformed_or_missing_file_is_failed_naming_it(
        self, tmp_path: Path, relative: str, content: str | None, says: str
    ) -> None:
        """A bad or missing file fails discovery with its full path and what was expected."""
        root = write_ib_sysfs(tmp_path / "ib", {"mlx5_0": "ACTIVE", "mlx5_1": "ACTIVE"})
        target = root / relative
        if content is None:
            target.unlink()
        else:
            target.write_text(content + "\n")
        report = discover_adapters(settings_for(root))
        assert report.status == "failed"
        assert f"{target}: " in report.problem
        assert says in report.problem

    def test_unreadable_file_is_failed_naming_it(self, tmp_path: Path) -> None:
        """A state file that cannot be read (here a directory) fails, naming it."""
        root = write_ib_sysfs(tmp_path / "ib", {"mlx5_0": "ACTIVE"})
        state = root / "mlx5_0" / "ports" / "1" / "state"
        state.unlink()
        state.mkdir()
        report = discover_adapters(settings_for(root))
        assert report.status == "failed"
        assert f"{state}: cannot read it" in report.problem

    def test_port_folder_not_a_number_is_failed(self, tmp_path: Path) -> None:
        """A ports/ entry that is not a port number fails, naming it."""
        root = write_ib_sysfs(tmp_path / "ib", {"mlx5_0": "ACTIVE"})
        (root / "mlx5_0" / "ports" / "one").mkdir()
        report = discover_adapters(settings_for(root))
        assert report.status == "failed"
        assert str(root / "mlx5_0" / "ports" / "one") in report.problem


def test_make_adapters_refuses_unknown_state() -> None:
    """The helper refuses a state sysfs never shows, listing the real ones."""
    with pytest.raises(ValueError, match="adapter mlx5_0 port 1: state 'UP'.*ACTIVE"):
        make_adapters({"mlx5_0": "UP"})


def test_hook_llmgw_discover_adapters(tmp_path: Path) -> None:
    """The built-in infiniband plugin answers the hook through the plugin manager."""
    plugins = get_plugin_manager(entry_points=False)
    root = write_ib_sysfs(tmp_path / "ib", {"mlx5_0": "ACTIVE", "mlx5_1": "DOWN"})
    reports = plugins.hook.llmgw_discover_adapters(settings=settings_for(root))
    assert [(r.source, r.status) for r in reports] == [("llmgw_infiniband", "ok")]
    assert [(a.name, a.active) for a in reports[0].adapters] == [("mlx5_0", True), ("mlx5_1", False)]
