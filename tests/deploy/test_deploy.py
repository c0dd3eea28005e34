"""deploy/: the alert rules and their unit tests, the scrape config, the dashboard, the systemd units."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.dev.cluster import program
from llmgw.testing.metrics import DEPLOY, deployed_names, promql_names, require_tool

PROMETHEUS = DEPLOY / "prometheus"
UNITS = DEPLOY / "systemd"
#: the highest `systemd-analyze security` exposure each unit may have
EXPOSURE = {"llmgw-server.service": 4.0, "llmgw-gateway.service": 4.0, "llmgw-agent.service": 5.0}


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


class TestPrometheus:
    """The rules, their unit tests and the example scrape config, through promtool."""

    def test_alert_rules_pass_promtool_and_their_unit_tests(self):
        """`promtool check rules` and `promtool test rules` pass (fix alerts.yml or alerts_test.yml)."""
        promtool = require_tool("promtool", "prometheus")
        checked = run([promtool, "check", "rules", "alerts.yml"], PROMETHEUS)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        tested = run([promtool, "test", "rules", "alerts_test.yml"], PROMETHEUS)
        assert tested.returncode == 0, tested.stdout + tested.stderr

    def test_every_alert_the_issue_asks_for_is_unit_tested(self):
        """Each alert named in alerts.yml that operators rely on has at least one case in alerts_test.yml."""
        tests = (PROMETHEUS / "alerts_test.yml").read_text()
        for alert in (
            "LlmgwReplicaNotReady", "LlmgwRolloutPaused", "LlmgwNodeLost", "LlmgwHungEngineEjected",
            "LlmgwRoutesFeedDown", "LlmgwCertificateExpiring", "LlmgwGatewayErrorRate",
            "LlmgwTimeToFirstTokenSlow", "LlmgwModelDown", "LlmgwNoLeader", "LlmgwKeyAtBudget",
        ):  # fmt: skip
            assert f"alertname: {alert}\n" in tests, f"{alert} has no case in alerts_test.yml"

    def test_scrape_config_passes_promtool(self):
        """`promtool check config prometheus.yml` passes, rule files included."""
        promtool = require_tool("promtool", "prometheus")
        checked = run([promtool, "check", "config", "prometheus.yml"], PROMETHEUS)
        assert checked.returncode == 0, checked.stdout + checked.stderr

    def test_scrape_config_has_the_jobs_the_rules_and_dashboard_name(self):
        """Jobs the rules and the dashboard select by name exist in prometheus.yml."""
        config = (PROMETHEUS / "prometheus.yml").read_text()
        named = set(re.findall(r'job="(llmgw-[a-z]+)"', (PROMETHEUS / "alerts.yml").read_text()))
        for job in named | {"llmgw-server", "llmgw-gateway", "llmgw-agent", "llmgw-engines"}:
            assert f"job_name: {job}\n" in config, job


class TestDashboard:
    """deploy/grafana/llmgw.json."""

    def test_dashboard_is_grafana_json_with_the_five_sections(self):
        """Valid JSON; rows Fleet, Models, Gateway, Tenants, Control plane; unique panel ids; queries name
        metrics."""
        dashboard = json.loads((DEPLOY / "grafana" / "llmgw.json").read_text())
        rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
        assert rows == ["Fleet", "Models (engines)", "Gateway", "Tenants", "Control plane"]
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids))
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                assert promql_names(target["expr"]), f"{panel['title']}: {target['expr']} reads no metric"

    def test_dashboard_is_what_its_script_writes(self):
        """deploy/grafana/llmgw.json is what scripts/grafana_dashboard.py writes (run it after an edit)."""
        done = subprocess.run(
            [sys.executable, "-c", "import grafana_dashboard as d; print(d.render(), end='')"],
            cwd=DEPLOY.parent / "scripts", capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert done.stdout == (DEPLOY / "grafana" / "llmgw.json").read_text(), (
            "deploy/grafana/llmgw.json is out of date: run .venv/bin/python scripts/grafana_dashboard.py"
        )

    def test_queries_read_only_llmgw_engine_and_process_metrics(self):
        """Every name the dashboard and the alerts read is llmgw's, vLLM's, process_* or Prometheus' up."""
        for name in deployed_names():
            assert re.match(r"^(llmgw_(server|agent|gateway)_|vllm:|process_|up$)", name), name


class TestUnits:
    """The systemd units: `systemd-analyze verify` passes and `security` rates them as promised."""

    @pytest.fixture
    def units(self, tmp_path: Path) -> Path:
        """The units, with ExecStart pointing at this checkout's llmgw (verify checks it exists)."""
        llmgw = program("llmgw")
        for unit in UNITS.glob("*.service"):
            text = unit.read_text().replace("/opt/llmgw/venv/bin/llmgw", llmgw)
            (tmp_path / unit.name).write_text(text)
        return tmp_path

    def test_every_unit_verifies(self, units):
        """`systemd-analyze verify` reports nothing on each unit."""
        analyze = require_tool("systemd-analyze", "systemd")
        for unit in sorted(units.glob("*.service")):
            done = run([analyze, "verify", str(unit)], units)
            problems = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            assert done.returncode == 0 and not problems, f"{unit.name}: {problems}"

    def test_the_unit_onboarding_writes_verifies_and_scores_as_deploys(self, tmp_path):
        """llmgw-onboard-node's llmgw-agent.service: verify passes, exposure <= 5.0 (it was 9.6)."""
        from types import SimpleNamespace

        from llmgw.onboard.files import systemd_unit

        analyze = require_tool("systemd-analyze", "systemd")
        settings = SimpleNamespace(node="node-1", remote_root="")
        unit = tmp_path / "llmgw-agent.service"
        unit.write_text(systemd_unit(settings).replace("/opt/llmgw/venv/bin/llmgw", program("llmgw")))
        done = run([analyze, "verify", str(unit)], tmp_path)
        assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr
        done = run([analyze, "security", "--offline=true", str(unit)], tmp_path)
        match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout + done.stderr)
        assert match and float(match.group(1)) <= EXPOSURE["llmgw-agent.service"], done.stdout[-3000:]

    @pytest.mark.parametrize("name", sorted(EXPOSURE))
    def test_exposure_is_within_its_limit(self, units, name):
        """`systemd-analyze security --offline=true` scores server and gateway <= 4.0, the agent <= 5.0."""
        analyze = require_tool("systemd-analyze", "systemd")
        done = run([analyze, "security", "--offline=true", str(units / name)], units)
        match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout + done.stderr)
        assert match, done.stdout + done.stderr
        assert float(match.group(1)) <= EXPOSURE[name], done.stdout[-3000:]


def test_every_deploy_file_is_listed_in_the_operations_page():
    """docs/operations.md names each file under deploy/ (a new file gets its paragraph)."""
    page = (DEPLOY.parent / "docs" / "operations.md").read_text()
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file():
            assert str(path.relative_to(DEPLOY.parent)) in page, path


def test_onboarding_writes_the_agent_sandbox_of_deploy():
    """The unit llmgw-onboard-node writes has every sandbox line of deploy/systemd/llmgw-agent.service."""
    from llmgw.onboard.files import AGENT_HARDENING

    service = (UNITS / "llmgw-agent.service").read_text().split("[Service]\n", 1)[1].split("[Install]")[0]
    own = {"Type", "ExecStart", "Restart", "RestartSec", "KillMode", "TimeoutStopSec"}
    wanted = {
        line
        for line in service.splitlines()
        if line and not line.startswith("#") and line.partition("=")[0] not in own
        and line != "Environment=PYTHONUNBUFFERED=1"
    }  # fmt: skip
    assert wanted == set(AGENT_HARDENING.splitlines())
