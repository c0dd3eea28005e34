"""A catalog small in bytes but huge once its YAML aliases are expanded is refused at once, everywhere.

The alias bomb below is about 600 bytes: ten aliases of ten aliases... used as a
profile's ``args``. It once held the server's event loop 9 s (eight levels) or for good (nine).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import trio
from click.testing import CliRunner
from llmgw_engine_sim import SimEngine

from llmgw.catalog import MAX_CATALOG_VALUES, parse_catalog
from llmgw.cli import cli
from llmgw.errors import CatalogError
from llmgw.server.http import catalog as api_catalog
from llmgw.testing.server import start_server

ENGINES = {"sim": SimEngine()}
#: how long a refusal of the bomb may take on a loaded machine (it took 9 s, or never ended, before); CPU
#: seconds where the test parses, wall-clock seconds where it asks a server
REFUSED_WITHIN = 5.0
LIMIT = f"more than {MAX_CATALOG_VALUES} values, counting each use of an alias"


def bomb(levels: int) -> str:
    """A catalog whose profile's args expand to ``10 ** levels`` strings through YAML aliases."""
    lines = ["profiles:", "  p:", "    engine: sim", '    x0: &a0 ["--flag-with-a-long-name"]']
    for level in range(1, levels + 1):
        lines.append(f"    x{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 10) + "]")
    lines += [f"    args: *a{levels}", "models:", "  m: {source: tiny/model, profile: p}", ""]
    return "\n".join(lines)


@pytest.mark.parametrize("levels", [8, 9])
def test_alias_bomb_is_refused_naming_the_limit(levels):
    """Eight and nine levels of aliases are refused within a moment, with one short line naming the limit."""
    started = time.process_time()
    with pytest.raises(CatalogError) as refused:
        parse_catalog(bomb(levels), ENGINES, source="bomb.yaml")
    assert time.process_time() - started < REFUSED_WITHIN
    (problem,) = refused.value.problems
    assert LIMIT in problem and "line " in problem
    assert len(str(refused.value)) < 300


def test_recursive_alias_is_refused():
    """An alias inside its own anchor is named, not a RecursionError."""
    text = "profiles:\n  p:\n    engine: sim\n    args: &a [--x, *a]\nmodels: {}\n"
    with pytest.raises(CatalogError, match=r"alias \*a is used inside its own anchor &a"):
        parse_catalog(text, ENGINES)


def test_aliases_within_the_limit_are_read():
    """Aliases are YAML: a catalog that uses a few is valid as before."""
    text = (
        "profiles:\n  p:\n    engine: sim\n    args: &common [--max-tokens, '64']\n"
        "  q:\n    engine: sim\n    args: *common\nmodels: {}\n"
    )
    catalog = parse_catalog(text, ENGINES)
    assert catalog.profiles["q"].args == ("--max-tokens", "64")


def test_errors_of_a_long_list_stay_short():
    """10,000 bad args: ten are named, the line quoting a value is short, the whole error is short."""
    bad = ", ".join(["[1, 2, 3, 4, 5, 6]"] * 10_000)
    text = f"profiles:\n  p:\n    engine: sim\n    args: [{bad}]\n"
    with pytest.raises(CatalogError) as refused:
        parse_catalog(text, ENGINES)
    problems = refused.value.problems
    assert problems[0] == "profiles.p.args[0]: expected a string, got [1, 2, 3, 4, ...]"
    assert len(problems) == 10
    assert len(str(refused.value)) < 2000


def test_apply_sends_nothing_invalid(tmp_path: Path):
    """`ctl apply` and `ctl diff` check the catalog first: the bomb is refused before any server is asked."""
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb(9))
    for command in ("apply", "diff"):
        result = CliRunner().invoke(cli, ["ctl", "--server", "https://127.0.0.1:1", command, str(path)])
        assert result.exit_code == 1
        assert f"{path}: 1 error" in result.output and LIMIT in result.output
        assert "--ca" not in result.output  # refused before the connection's settings were even read


def test_apply_leaves_unknown_engines_to_the_server(tmp_path: Path):
    """An engine not installed where ctl runs may be on the server's: ctl goes on to send the catalog."""
    path = tmp_path / "catalog.yaml"
    path.write_text("profiles:\n  p:\n    engine: elsewhere\nmodels: {}\n")
    result = CliRunner().invoke(cli, ["ctl", "--server", "https://127.0.0.1:1", "apply", str(path)])
    assert result.exit_code == 1
    assert "1 error" not in result.output and "elsewhere" not in result.output
    assert "--ca" in result.output  # it went on to connect (with no admin certificate here)


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    """A real `llmgw server` on 127.0.0.1, port 0; yields its base URL."""
    return await start_server(nursery, test_pki.server_config(tmp_path / "state"), ENGINES)


async def test_server_refuses_the_bomb_and_answers_meanwhile(server, test_pki):
    """The server refuses both bombs at once (400 naming the limit) and answers an admin GET meanwhile."""
    async with httpx.AsyncClient(verify=test_pki.context("admin", "alice"), timeout=30) as client:
        answers = {}

        async def send(name, method, path, body=None):
            started = trio.current_time()
            response = await client.request(method, f"{server}{path}", json=body)
            answers[name] = (response, trio.current_time() - started)

        async with trio.open_nursery() as nursery:
            for levels in (8, 9):
                body = {"text": bomb(levels), "name": f"bomb{levels}.yaml"}
                nursery.start_soon(send, levels, "POST", "/v1/admin/catalog", body)
            nursery.start_soon(send, "nodes", "GET", "/v1/admin/nodes")
    for levels in (8, 9):
        response, took = answers[levels]
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_catalog"
        assert any(LIMIT in problem for problem in error["problems"])
        assert len(response.content) < 1000
        assert took < REFUSED_WITHIN
    response, took = answers["nodes"]
    assert response.status_code == 200 and took < REFUSED_WITHIN


async def test_server_parses_catalogs_off_its_event_loop(server, test_pki, monkeypatch):
    """While a catalog is being parsed, the server answers other requests (the parse runs in a thread)."""
    parsing, release = threading.Event(), threading.Event()
    real = api_catalog.parse_catalog

    def held_parse(*args, **kwargs):
        parsing.set()
        if not release.wait(10):  # on the event loop this wait blocks everything, the GET below too
            raise AssertionError("the catalog was parsed on the server's event loop")
        return real(*args, **kwargs)

    monkeypatch.setattr(api_catalog, "parse_catalog", held_parse)
    async with httpx.AsyncClient(verify=test_pki.context("admin", "alice"), timeout=30) as client:
        async with trio.open_nursery() as nursery:
            applied = []

            async def apply():
                body = {"text": "profiles: {}\nmodels: {}\n", "name": "empty.yaml"}
                applied.append(await client.post(f"{server}/v1/admin/catalog", json=body))

            nursery.start_soon(apply)
            assert await trio.to_thread.run_sync(parsing.wait, 10), "the server never parsed the catalog"
            nodes = await client.get(f"{server}/v1/admin/nodes")
            answered_while_parsing = not release.is_set()
            release.set()
    assert nodes.status_code == 200 and answered_while_parsing
    assert applied[0].status_code == 200, applied[0].text
