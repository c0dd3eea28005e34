"""`ctl diff` shows whole values: a flag appended to long args is seen (wrapped in tables, whole in JSON)."""

from __future__ import annotations

import json

import pytest
import trio
from click.testing import CliRunner
from llmgw_engine_sim import SimEngine

from llmgw.cli import cli
from llmgw.ctl.catalog import diff_lines
from llmgw.testing.server import start_server
from llmgw.wire import CatalogChange, CatalogDiff

LONG_ARGS = ["--max-tokens", "64", "--name-that-is-rather-long", "value-that-is-rather-long"] * 4
CATALOG = """
profiles:
  one:
    engine: sim
    args: {args}
models:
  small:
    source: tiny/model
    profile: one
"""


def test_long_lines_wrap_and_keep_every_value():
    """A field longer than the width is wrapped, indented, and joined again it is the whole field."""
    field = "args: [" + ", ".join(LONG_ARGS) + "] -> [" + ", ".join([*LONG_ARGS, "--enforce-eager"]) + "]"
    lines = diff_lines(CatalogDiff(1, (CatalogChange("profile", "one", "changed", (field,)),)), width=70)
    wrapped = lines[2:]
    assert len(wrapped) > 3 and all(len(line) <= 70 for line in wrapped)
    assert wrapped[0].startswith("      args: [")
    assert all(line.startswith("          ") for line in wrapped[1:])
    assert " ".join(line.strip() for line in wrapped) == field


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    """A real `llmgw server` on 127.0.0.1, port 0; yields its base URL."""
    return await start_server(nursery, test_pki.server_config(tmp_path / "state"), {"sim": SimEngine()})


async def test_ctl_diff_shows_a_flag_appended_to_long_args(server, test_pki, tmp_path):
    """Against a real server: the table (80 columns) and `-o json` both show the flag added at the end."""
    issued = test_pki.client("admin", "carol")
    base = ["ctl", "--server", server, "--ca", str(test_pki.ca.cert_path)]
    base += ["--cert", str(issued.cert_path), "--key", str(issued.key_path)]
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(CATALOG.format(args=json.dumps(LONG_ARGS)))
    second.write_text(CATALOG.format(args=json.dumps([*LONG_ARGS, "--enforce-eager"])))

    async def run(*args: str):
        invoke = CliRunner().invoke
        return await trio.to_thread.run_sync(lambda: invoke(cli, [*base, *args], env={"COLUMNS": "80"}))

    assert (await run("apply", str(first))).exit_code == 0
    table = await run("diff", str(second))
    assert table.exit_code == 0, table.output
    assert all(len(line) <= 80 for line in table.stdout.splitlines())
    assert "--enforce-eager]" in table.stdout
    shown = await run("diff", "-o", "json", str(second))
    [profile] = [c for c in json.loads(shown.stdout)["changes"] if c["section"] == "profile"]
    after = "[" + ", ".join([*LONG_ARGS, "--enforce-eager"]) + "]"
    assert profile["fields"] == ["args: [" + ", ".join(LONG_ARGS) + "] -> " + after]
