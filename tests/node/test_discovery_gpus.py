"""GPU discovery through nvidia-smi, run for real against the fake script."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from llmgw_nvidia import QUERY_FIELDS, discover_gpus, parse_gpu_csv, query_argv

from llmgw.models import GPU, DiscoverySettings
from llmgw.plugins import get_plugin_manager
from llmgw.testing.fakes import DRIVER_FAILURE, make_gpus, write_fake_nvidia_smi

H100_LINE = "0, GPU-9f2c1e0a-1111-2222-3333-444455556666, NVIDIA H100 80GB HBM3, 81559, 81000, 00000000:18:00.0, 550.54.15"  # noqa: E501


def settings_for(path: Path | str, timeout: float = 30.0) -> DiscoverySettings:
    return DiscoverySettings(nvidia_smi=str(path), timeout=timeout)


class TestOutcomes:
    """The three outcomes an operator must tell apart: found, not there, failing."""

    def test_lists_every_gpu_the_tool_prints(self, tmp_path: Path) -> None:
        """Eight GPUs printed are eight GPUs reported, every field intact."""
        gpus = make_gpus(8)
        report = discover_gpus(settings_for(write_fake_nvidia_smi(tmp_path / "smi", gpus)))
        assert report.status == "ok"
        assert report.gpus == tuple(gpus)
        assert report.problem is None
        assert report.describe() == "llmgw_nvidia: 8 GPUs"

    def test_zero_gpus_is_ok_and_no_problem(self, tmp_path: Path) -> None:
        """A driver that lists no GPU ("No devices were found") is 0 GPUs, not a failure."""
        report = discover_gpus(settings_for(write_fake_nvidia_smi(tmp_path / "smi", [])))
        assert (report.status, report.gpus, report.problem) == ("ok", (), None)

    def test_missing_path_is_not_found(self, tmp_path: Path) -> None:
        """A --nvidia-smi path that does not exist is reported as not found at that path."""
        missing = tmp_path / "bin" / "nvidia-smi"
        report = discover_gpus(settings_for(missing))
        assert report.status == "not-found"
        assert report.problem.startswith(f"nvidia-smi not found at {missing}")

    def test_bare_name_not_on_path_is_not_found_on_path(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A bare name missing from PATH says PATH and shows where it looked."""
        monkeypatch.setenv("PATH", str(tmp_path))
        report = discover_gpus(settings_for("nvidia-smi"))
        assert report.status == "not-found"
        assert report.problem.startswith("nvidia-smi not found at PATH")
        assert str(tmp_path) in report.problem

    def test_bare_name_is_looked_up_on_path(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The default --nvidia-smi (a bare name) runs the first one on PATH."""
        write_fake_nvidia_smi(tmp_path / "nvidia-smi", make_gpus(2))
        monkeypatch.setenv("PATH", str(tmp_path))
        report = discover_gpus(settings_for("nvidia-smi"))
        assert (report.status, len(report.gpus)) == ("ok", 2)

    def test_file_that_is_not_executable_is_not_found(self, tmp_path: Path) -> None:
        """A file without execute permission is not-found, and the message says why."""
        script = write_fake_nvidia_smi(tmp_path / "smi", make_gpus(1))
        script.chmod(0o644)
        report = discover_gpus(settings_for(script))
        assert report.status == "not-found"
        assert report.problem.startswith(f"nvidia-smi not found at {script}")
        assert "not executable" in report.problem

    def test_driver_failure_is_failed_with_its_message(self, tmp_path: Path) -> None:
        """nvidia-smi failing (driver gone, exit 9) is 'failed' with its own words and exit code."""
        script = write_fake_nvidia_smi(tmp_path / "smi", fail=DRIVER_FAILURE)
        report = discover_gpus(settings_for(script))
        assert report.status == "failed"
        assert report.problem.startswith("nvidia-smi failed: " + DRIVER_FAILURE)
        assert "exit code 9" in report.problem
        assert report.gpus == ()

    def test_silent_failure_still_says_it_failed(self, tmp_path: Path) -> None:
        """A non-zero exit with no output is failed, with the exit code."""
        script = write_fake_nvidia_smi(tmp_path / "smi", fail="", exit_code=255)
        report = discover_gpus(settings_for(script))
        assert report.status == "failed"
        assert "printed nothing" in report.problem and "exit code 255" in report.problem

    def test_missing_failing_and_empty_never_look_alike(self, tmp_path: Path) -> None:
        """Not there, failing and zero GPUs give three different statuses and lines."""
        reports = [
            discover_gpus(settings_for(tmp_path / "absent")),
            discover_gpus(settings_for(write_fake_nvidia_smi(tmp_path / "f", fail=DRIVER_FAILURE))),
            discover_gpus(settings_for(write_fake_nvidia_smi(tmp_path / "z", []))),
        ]
        assert [r.status for r in reports] == ["not-found", "failed", "ok"]
        assert len({r.describe() for r in reports}) == 3

    def test_hung_tool_times_out_as_failed(self, tmp_path: Path) -> None:
        """nvidia-smi that never answers is failed after settings.timeout, naming the wait."""
        script = write_fake_nvidia_smi(tmp_path / "smi", hang=True)
        report = discover_gpus(settings_for(script, timeout=0.3))
        assert report.status == "failed"
        assert report.problem.startswith("nvidia-smi failed: no answer within 0.3 s")

    def test_unparseable_line_is_failed_naming_the_line(self, tmp_path: Path) -> None:
        """Output that is not the CSV asked for fails, quoting the line and its number."""
        script = write_fake_nvidia_smi(tmp_path / "smi", output=H100_LINE + "\nWARNING: odd\n")
        report = discover_gpus(settings_for(script))
        assert report.status == "failed"
        assert report.problem.startswith("nvidia-smi failed: cannot parse line 2")
        assert "'WARNING: odd'" in report.problem

    def test_unavailable_memory_counts_as_zero_with_a_note(self, tmp_path: Path) -> None:
        """A GPU reporting memory as [N/A] is listed with 0 MiB, and the report says so."""
        line = "0, GPU-abc, NVIDIA GB10, [N/A], [N/A], 0000000F:01:00.0, 580.95.05\n"
        report = discover_gpus(settings_for(write_fake_nvidia_smi(tmp_path / "smi", output=line)))
        assert report.status == "ok"
        assert (report.gpus[0].memory_total_mib, report.gpus[0].memory_free_mib) == (0, 0)
        assert "memory.total of GPU 0 (GPU-abc) as [N/A]" in report.problem


class TestParse:
    """Parsing the CSV lines nvidia-smi prints."""

    def test_real_line(self) -> None:
        """A line as a real H100 node prints it becomes one GPU with every field."""
        gpus, notes = parse_gpu_csv(H100_LINE + "\n")
        assert gpus == (
            GPU(
                index=0,
                uuid="GPU-9f2c1e0a-1111-2222-3333-444455556666",
                name="NVIDIA H100 80GB HBM3",
                memory_total_mib=81559,
                memory_free_mib=81000,
                pci_bus_id="00000000:18:00.0",
                driver_version="550.54.15",
            ),
        )
        assert notes == ()

    def test_tolerates_no_spaces_units_and_commas_in_names(self) -> None:
        """Missing spaces, a MiB suffix and a comma inside the name still parse."""
        gpus, _ = parse_gpu_csv("3,GPU-x,Tesla V100, SXM2,16384 MiB,16000,00000000:06:00.0,535.1\n")
        assert (gpus[0].index, gpus[0].name, gpus[0].memory_total_mib) == (3, "Tesla V100, SXM2", 16384)

    @pytest.mark.parametrize(
        ("text", "says"),
        [
            ("0, GPU-x, H100, 80\n", "expected 7 comma-separated fields"),
            ("x, GPU-x, H100, 1, 1, 00:18.0, 550\n", "index 'x' is not a number"),
            ("0, GPU-x, H100, lots, 1, 00:18.0, 550\n", "memory.total 'lots' is not a number"),
            ("0, , H100, 1, 1, 00:18.0, 550\n", "uuid is empty"),
        ],
    )
    def test_bad_line_names_line_and_reason(self, text: str, says: str) -> None:
        """Each malformed line is refused with its number, its text and what was wrong."""
        with pytest.raises(ValueError, match="line 1") as info:
            parse_gpu_csv(text)
        assert says in str(info.value)
        assert repr(text.rstrip("\n")) in str(info.value)


class TestFakeNvidiaSmi:
    """The fake behaves like the real tool for the queries callers make."""

    def test_runs_the_query_discovery_documents(self, tmp_path: Path) -> None:
        """Discovery asks for the seven documented fields without header or units."""
        assert query_argv("nvidia-smi") == [
            "nvidia-smi",
            "--query-gpu=index,uuid,name,memory.total,memory.free,pci.bus_id,driver_version",
            "--format=csv,noheader,nounits",
        ]
        assert len(QUERY_FIELDS) == 7

    def test_honours_field_order_header_and_units(self, tmp_path: Path) -> None:
        """Fields come back in the order asked, with a header and units unless told not to."""
        script = write_fake_nvidia_smi(tmp_path / "smi", make_gpus(2, memory_mib=1000))
        out = subprocess.run(
            [script, "--query-gpu=memory.total,index", "--format=csv"],
            capture_output=True, text=True, check=True,
        ).stdout
        assert out.splitlines() == ["memory.total [MiB], index", "1000 MiB, 0", "1000 MiB, 1"]

    def test_rejects_unknown_field_like_the_real_one(self, tmp_path: Path) -> None:
        """An unknown field exits 2 naming the field."""
        script = write_fake_nvidia_smi(tmp_path / "smi", make_gpus(1))
        proc = subprocess.run(
            [script, "--query-gpu=index,temperature.bogus", "--format=csv"],
            capture_output=True, text=True,
        )
        assert proc.returncode == 2
        assert 'Field "temperature.bogus" is not a valid field to query.' in proc.stdout

    def test_seeds_give_distinct_uuids(self) -> None:
        """Two fake nodes with different seeds share no GPU UUID."""
        first = {g.uuid for g in make_gpus(8, seed="node-1")}
        second = {g.uuid for g in make_gpus(8, seed="node-2")}
        assert len(first) == 8 and not first & second


def test_hook_llmgw_discover_gpus(tmp_path: Path) -> None:
    """The built-in nvidia plugin answers the hook through the plugin manager."""
    plugins = get_plugin_manager(entry_points=False)
    gpus = make_gpus(4)
    settings = settings_for(write_fake_nvidia_smi(tmp_path / "smi", gpus))
    reports = plugins.hook.llmgw_discover_gpus(settings=settings)
    assert [(r.source, r.status, r.gpus) for r in reports] == [("llmgw_nvidia", "ok", tuple(gpus))]
