"""`ctl` listings: one -o table|wide|json|yaml everywhere, --watch, events --follow, against a real server."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess

import attrs
import httpx
import pytest
import trio
import yaml
from click.testing import CliRunner
from llmgw_engine_sim import SimEngine

from llmgw.ctl.cli import ctl
from llmgw.ctl.options import OUTPUTS
from llmgw.dev.cluster import program
from llmgw.models import Fabric, NodeFacts
from llmgw.server.state.cluster import Settings
from llmgw.testing import make_gpus
from llmgw.testing.processes import processes, sigint_default, wait_for  # noqa: F401
from llmgw.testing.server import start_server
from llmgw.wire import SyncRequest, to_json

LISTINGS = [
    ["nodes"],
    ["replicas"],
    ["events"],
    ["servers"],
    ["keys", "list"],
    ["keys", "usage"],
    ["catalog", "history"],
    ["rollout", "status"],
]


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    """A real `llmgw server` that node-1 (4 H100s and 2 A100s, on fabric ib-a) synced with; yields its URL."""
    config = test_pki.server_config(tmp_path / "state", settings=Settings(lost_after=300))
    url = await start_server(nursery, config, {"sim": SimEngine()})
    gpus = make_gpus(6, seed="node-1")
    gpus[4:] = [attrs.evolve(g, name="NVIDIA A100-SXM4-40GB") for g in gpus[4:]]
    facts = NodeFacts(
        node_id="node-1",
        agent_version="9.9.9",
        gpus=gpus,
        fabrics=(Fabric("ib-a", ("mlx5_0", "mlx5_1")),),
        engines={"sim": "0.2.0"},
    )
    request = SyncRequest(node_id="node-1", address="127.0.0.5", facts=facts, port_range=(21000, 21099))
    async with httpx.AsyncClient(verify=test_pki.context("node", "node-1"), timeout=10) as node:
        assert (await node.post(f"{url}/v1/agent/sync", json=to_json(request))).status_code == 200
    return url


def connection(test_pki, server: str) -> list[str]:
    """The ``ctl`` options that reach ``server`` as an admin."""
    issued = test_pki.client("admin", "ops")
    return [
        *("--server", server, "--ca", str(test_pki.ca.cert_path)),
        *("--cert", str(issued.cert_path), "--key", str(issued.key_path)),
    ]


async def run_ctl(test_pki, server: str, *args: str):
    """``llmgw ctl ... ARGS`` in a thread (the server runs in this one); the click Result."""
    argv = [*connection(test_pki, server), *args]
    return await trio.to_thread.run_sync(lambda: CliRunner().invoke(ctl, argv))


@pytest.mark.parametrize("listing", LISTINGS, ids=" ".join)
async def test_every_listing_takes_the_four_outputs(server, test_pki, listing):
    """table, wide, json and yaml all work; YAML holds exactly what JSON holds, read at the same moment."""

    async def read(output: str) -> str:
        result = await run_ctl(test_pki, server, *listing, "-o", output)
        assert result.exit_code == 0, result.output
        return result.output

    for output in ("table", "wide"):
        await read(output)
    # the cluster moves on between two reads (an event lands): a YAML read between two equal JSON reads
    # shows the moment both of them show
    with trio.fail_after(30):
        before = timeless(json.loads(await read("json")))
        while True:
            as_yaml = timeless(yaml.safe_load(await read("yaml")))
            after = timeless(json.loads(await read("json")))
            if before == after:
                break
            before = after
    assert as_yaml == after


#: fields that change between two looks a moment apart
MOVING = {"last_sync_ago", "seen_ago", "up_for", "lease_age", "expires_in"}


def timeless(doc):
    """``doc`` without the fields that change with the clock."""
    if isinstance(doc, dict):
        return {k: timeless(v) for k, v in doc.items() if k not in MOVING}
    if isinstance(doc, list):
        return [timeless(v) for v in doc]
    return doc


def test_engines_takes_the_four_outputs_and_the_old_json_flag():
    """`ctl engines` (offline) speaks -o too; the deprecated --json still prints the same JSON."""
    runner = CliRunner()
    as_json = json.loads(runner.invoke(ctl, ["engines", "-o", "json"]).output)
    assert "sim" in {e["name"] for e in as_json}
    assert yaml.safe_load(runner.invoke(ctl, ["engines", "-o", "yaml"]).output) == as_json
    assert json.loads(runner.invoke(ctl, ["engines", "--json"]).output) == as_json


async def test_nodes_wide_shows_gpu_models_adapters_and_agent(server, test_pki):
    """`nodes -o wide` counts GPUs per model and names the fabric's adapters and the agent's version."""
    wide = await run_ctl(test_pki, server, "nodes", "-o", "wide")
    header, _, row = wide.output.splitlines()[:3]
    assert "GPUs" in header and "fabric: adapters" in header and "agent" in header
    assert "2x NVIDIA A100-SXM4-40GB, 4x NVIDIA H100 80GB HBM3" in row
    assert "ib-a: mlx5_0,mlx5_1" in row and "9.9.9" in row
    table = await run_ctl(test_pki, server, "nodes")
    assert "mlx5_0" not in table.output and "ib-a" in table.output


async def test_replicas_wide_flag_is_an_alias(server, test_pki):
    """The old `replicas --wide` prints what `-o wide` prints."""
    old = await run_ctl(test_pki, server, "replicas", "--wide")
    new = await run_ctl(test_pki, server, "replicas", "-o", "wide")
    assert old.exit_code == 0 and old.output == new.output


def looks(text: str) -> list[str]:
    """The tables of a watch's output, each under its ``--- YYYY-MM-DD HH:MM:SS`` line."""
    return [part for part in re.split(r"^--- \d{4}-\d\d-\d\d \d\d:\d\d:\d\d$", text, flags=re.M) if part]


async def test_watch_appends_when_not_a_terminal_and_ends_on_ctrl_c(server, test_pki, processes):  # noqa: F811
    """`nodes --watch` into a pipe appends a table under a time line each look; JSON: one object a line;
    Ctrl-C ends it with 0 and no traceback."""
    base = [program("llmgw"), "ctl", *connection(test_pki, server), "nodes", "--watch", "--interval", "0.2"]
    tables = processes.start(base, name="watch-table")
    lines = processes.start([*base, "-o", "json"], name="watch-json")
    with trio.fail_after(30):
        await wait_for(lambda: len(looks(tables.stdout())) >= 3, "three tables", tables)
        await wait_for(lambda: lines.stdout().count("\n") >= 3, "three JSON lines", lines)
    for watcher in (tables, lines):
        watcher.signal(signal.SIGINT)
        with trio.fail_after(20):
            assert await watcher.wait_exit_trio() == 0, watcher.stderr_tail()
        assert "Traceback" not in watcher.stderr()
    assert all("node-1  127.0.0.5  ready" in look for look in looks(tables.stdout()))
    snapshots = [json.loads(line) for line in lines.stdout().splitlines()]
    assert len(snapshots) >= 3 and all(s[0]["node_id"] == "node-1" for s in snapshots)


async def test_events_follow_prints_new_events_as_they_come(server, test_pki, processes):  # noqa: F811
    """`events --follow` prints the events there are, then a cordon made after it started, once."""
    argv = [program("llmgw"), "ctl", *connection(test_pki, server), "events", "--follow", "--interval", "0.2"]
    follower = processes.start(argv, name="follow")
    with trio.fail_after(30):
        await wait_for(lambda: "node-1" in follower.stdout(), "the first events", follower)
        cordoned = await run_ctl(test_pki, server, "cordon", "node-1")
        assert cordoned.exit_code == 0, cordoned.output
        await wait_for(lambda: "cordon" in follower.stdout(), "the cordon event", follower)
    follower.signal(signal.SIGINT)
    with trio.fail_after(20):
        assert await follower.wait_exit_trio() == 0
    ids = [line.split()[0] for line in follower.stdout().splitlines()]
    assert len(ids) == len(set(ids)), "an event was printed twice"


@pytest.mark.parametrize("command", [["nodes", "--watch"], ["events", "--follow"]], ids=" ".join)
async def test_a_watch_started_in_the_background_of_a_script_ends_on_sigint(
    server, test_pki, processes, command  # noqa: F811
):
    """`ctl ... --watch &` in a script inherits SIGINT ignored; `kill -INT` still ends it with 0."""
    argv = [program("llmgw"), "ctl", *connection(test_pki, server), *command, "--interval", "0.2"]
    watcher = processes.start(["bash", "-c", 'trap "" INT; exec "$@"', "bash", *argv], name="watch")
    with trio.fail_after(30):
        await wait_for(lambda: "node-1" in watcher.stdout(), "the first look", watcher)
    watcher.signal(signal.SIGINT)
    with trio.fail_after(20):
        assert await watcher.wait_exit_trio() == 0, watcher.stderr_tail()


async def test_watch_on_a_terminal_redraws_the_screen(server, test_pki):
    """On a terminal, each look clears the screen and heads the table with the command and the time."""
    argv = [program("llmgw"), "ctl", *connection(test_pki, server), "nodes", "-w", "--interval", "0.2"]
    leader, follower = pty.openpty()
    os.set_blocking(leader, False)
    watcher = subprocess.Popen(  # noqa: ASYNC220 (returns at once)
        argv, stdout=follower, stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=sigint_default()
    )
    os.close(follower)
    seen = b""

    def read() -> bytes:
        nonlocal seen
        try:
            seen += os.read(leader, 65536)
        except (BlockingIOError, OSError):
            pass
        return seen

    try:
        with trio.fail_after(30):
            await wait_for(lambda: read().count(b"\x1b[2J") >= 3, "three redraws")
        watcher.send_signal(signal.SIGINT)
        with trio.fail_after(20):
            await wait_for(lambda: watcher.poll() is not None, "the watch to end")
        assert watcher.returncode == 0
    finally:
        if watcher.poll() is None:
            os.killpg(watcher.pid, signal.SIGKILL)
        watcher.wait()
        os.close(leader)
    screen = seen.split(b"\x1b[2J")[-2].decode()  # whole: another redraw followed it
    assert screen.startswith("\x1b[1;1Hevery 0.2s: llmgw ctl nodes    20")
    assert "node-1  127.0.0.5  ready" in screen


def test_every_ctl_command_with_an_output_offers_the_same_four():
    """Every `ctl` command that takes -o offers table, wide, json and yaml; old spellings are hidden."""

    def walk(command):
        yield command
        for sub in getattr(command, "commands", {}).values():
            yield from walk(sub)

    with_output = []
    for command in walk(ctl):
        if command.name == "engine-check":  # a verdict on one binary, not a listing: --json stays
            continue
        for param in command.params:
            if param.name == "output":
                assert tuple(param.type.choices) == OUTPUTS, command.name
                with_output.append(command.name)
            if param.name in ("as_json", "wide"):
                assert param.hidden, f"{command.name}: {param.opts} should be a hidden alias of -o"
    assert {"nodes", "replicas", "events", "servers", "engines", "history", "status", "diff"} <= set(
        with_output
    )
