"""Token budgets per key: set with `ctl keys`, counted by the leader from the gateways' reports, stored per
day and model (each store), answered as spent to every gateway, shown by `ctl keys usage`."""

from __future__ import annotations

import json
import time

import pytest
import trio
from llmgw_engine_sim import SimEngine

from llmgw.server.state.budgets import Budgets
from llmgw.tenancy.periods import period_bounds
from llmgw.testing.server import start_server
from llmgw.wire import BudgetPeriod, KeyLimits, UsageReport
from tests.server.test_key_limits import client, listed, run_ctl

DAY = 86400.0
#: 2026-12-04 12:00 UTC
NOON = 1796385600.0


def report(key: str, model: str, prompt: int, completion: int) -> dict:
    return {
        "key": key,
        "model": model,
        "requests": 1,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
    }


async def allowances(test_pki, server: str, *usage: dict) -> dict:
    """One gateway exchange reporting ``usage``: the server's answer."""
    async with client(test_pki, "gateway", "gw-1") as gateway:
        answered = await gateway.post(
            f"{server}/v1/gateway/allowances", json={"gateway": "gw-a:1", "usage": list(usage)}
        )
    assert answered.status_code == 200, answered.text
    return answered.json()


class TestBudgets:
    """The leader's count of each key's tokens by UTC day."""

    def test_a_day_budget_counts_today_a_month_budget_the_month(self):
        """Yesterday's tokens count for a month budget, not for a day budget; spent says when it resets."""
        budgets = Budgets()
        budgets.load("2026-12-01", [("k", "2026-12-03", 60), ("k", "2026-11-30", 500)])
        budgets.add([UsageReport("k", "m", 1, 30, 20)], NOON)
        day = {"k": KeyLimits(budget=100)}
        month = {"k": KeyLimits(budget=100, budget_period=BudgetPeriod.MONTH)}
        assert budgets.used("k", BudgetPeriod.DAY, NOON) == 50 and not budgets.spent(day, NOON)
        (spent,) = budgets.spent(month, NOON)
        assert (spent.key, spent.budget, spent.period) == ("k", 100, "month")
        assert spent.resets_at == period_bounds(BudgetPeriod.MONTH, NOON)[1] == 1798761600.0  # 2027-01-01
        assert not budgets.spent(month, NOON + 30 * DAY)  # a new month: nothing used yet

    def test_reports_not_stored_yet_survive_a_reload_and_a_failed_write(self):
        """A reload keeps what was reported since the last write; rows of a failed write are taken again."""
        budgets = Budgets()
        budgets.load("2026-12-01", [])
        budgets.add([UsageReport("k", "m", 2, 10, 5)], NOON)
        budgets.load("2026-12-01", [])
        assert budgets.used("k", BudgetPeriod.DAY, NOON) == 15
        rows = budgets.pending(NOON)
        assert rows == [("k", "2026-12-04", "m", 2, 10, 5)] and budgets.pending(NOON) == []
        budgets.restore(rows)
        assert budgets.pending(NOON) == rows


@pytest.fixture
async def server(nursery, test_pki, tmp_path, open_test_store):
    """A real `llmgw server` (each store); its URL."""
    config = test_pki.server_config(tmp_path / "state", store=open_test_store.url)
    return await start_server(nursery, config, {"sim": SimEngine()})


async def test_ctl_sets_a_budget_and_keys_usage_shows_use_per_model(server, test_pki):
    """`keys create --budget --budget-period month`; gateways' reports are counted per model; the key is
    spent once at its budget; `keys usage` shows it as a table and as JSON."""
    created = await run_ctl(
        test_pki, server, "keys", "create", "k", "--budget", "100", "--budget-period", "month"
    )
    assert created.exit_code == 0, created.output
    assert "budget 100/month" in created.stderr
    assert (await listed(test_pki, server))["k"]["budget"] == 100
    first = await allowances(test_pki, server, report("k", "a", 30, 20), report("k", "b", 10, 5))
    assert first["spent"] == []
    second = await allowances(test_pki, server, report("k", "a", 30, 20))
    (spent,) = second["spent"]
    assert (spent["key"], spent["budget"], spent["period"]) == ("k", 100, "month")
    table = await run_ctl(test_pki, server, "keys", "usage", "k")
    assert table.exit_code == 0, table.output
    header, _, *rows = table.stdout.splitlines()
    assert header.split() == [
        "name",
        "model",
        "period",
        "requests",
        "prompt",
        "completion",
        "tokens",
        "budget",
    ]
    assert [row.split()[:2] + row.split()[5:] for row in rows] == [
        ["k", "a", "2", "60", "40", "100"],
        ["k", "b", "1", "10", "5", "15"],
        ["k", "*", "3", "70", "45", "115", "115/100", "(115%)"],
    ]
    assert rows[0].split()[2:5] == ["month", "from", period_bounds(BudgetPeriod.MONTH, time.time())[0]]
    shown = await run_ctl(test_pki, server, "keys", "usage", "-o", "json")
    (usage,) = [k for k in json.loads(shown.stdout) if k["name"] == "k"]
    assert usage["tokens"] == 115 and usage["period"] == "month" and len(usage["models"]) == 2
    missing = await run_ctl(test_pki, server, "keys", "usage", "nope")
    assert missing.exit_code != 0 and "no API key named 'nope'" in missing.output


async def test_a_lifted_budget_frees_the_key_and_a_bad_budget_names_its_flag(server, test_pki):
    """`keys update --budget unlimited` ends the refusals; `--budget 0` and `--budget-period week` are
    refused naming the flag."""
    await run_ctl(test_pki, server, "keys", "create", "k", "--budget", "10")
    assert (await allowances(test_pki, server, report("k", "a", 10, 1)))["spent"]
    lifted = await run_ctl(test_pki, server, "keys", "update", "k", "--budget", "unlimited")
    assert lifted.exit_code == 0 and "budget -" in lifted.output
    assert (await allowances(test_pki, server))["spent"] == []
    for args, flag in [(["--budget", "0"], "--budget"), (["--budget-period", "week"], "--budget-period")]:
        refused = await run_ctl(test_pki, server, "keys", "update", "k", *args)
        assert refused.exit_code == 2 and f"Invalid value for '{flag}'" in refused.output


async def test_usage_and_spent_keys_survive_a_server_restart(test_pki, tmp_path, open_test_store):
    """What the gateways reported is in the store once written: a new server (a failover's new leader)
    reads it back and answers the key spent at once."""
    config = test_pki.server_config(tmp_path / "state", store=open_test_store.url)
    async with trio.open_nursery() as first:
        server = await start_server(first, config, {"sim": SimEngine()})
        await run_ctl(test_pki, server, "keys", "create", "k", "--budget", "50")
        # a leader's first report is written at once, later ones every FLUSH_INTERVAL seconds
        assert (await allowances(test_pki, server, report("k", "a", 40, 10)))["spent"]
        first.cancel_scope.cancel()
    async with trio.open_nursery() as second:
        server = await start_server(second, config, {"sim": SimEngine()})
        (spent,) = (await allowances(test_pki, server))["spent"]
        assert spent["key"] == "k"
        second.cancel_scope.cancel()
