"""``llmgw dev``: a whole llmgw cluster on this machine, on simulated nodes, no GPU needed.

It starts a :class:`~llmgw.dev.cluster.LocalCluster` (a CA, ``llmgw server``
and N ``llmgw agent`` processes with fake GPUs and fabrics), applies a sample
catalog with a single-node and a two-node sim model, waits until every
replica is ready, leaves admin credentials where ``llmgw ctl`` looks by
default, and prints what to run next. Ctrl-C stops everything, agents first
(they stop their engines), and leaves no process behind.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import attrs
import click
import httpx

from llmgw import pki
from llmgw.ctl.client import config_dir, segment, write_client_config
from llmgw.dev.cluster import LocalCluster, program
from llmgw.dev.runs import port_in_use
from llmgw.dev.signals import Stopped, stop_on_signals
from llmgw.settings import setting, settings_options
from llmgw.wire import DrainStatus, NodeList

__all__ = ["DevSettings", "dev", "SAMPLE_CATALOG"]

_DEV_MARK = "# written by llmgw dev"
#: the server's metrics port in llmgw dev (on 127.0.0.1); each agent's is one above, on its own address
DEV_METRICS_PORT = 9464

SAMPLE_CATALOG = """\
# The sample catalog llmgw dev applies. Edit it and run: llmgw ctl apply {path}
profiles:
  sim-1gpu:
    engine: sim
    gpus_per_node: 1
    args: ["--time-to-first-token", "0.05", "--tokens-per-second", "200"]
  sim-tp4x2:
    engine: sim
    nodes: 2
    gpus_per_node: 4
    args: ["--time-to-first-token", "0.1", "--tokens-per-second", "100"]
models:
  llama-sim-8b:
    source: {models}/llama-sim-8b
    profile: sim-1gpu
    replicas: 2
  llama-sim-70b:
    source: {models}/llama-sim-70b
    profile: sim-tp4x2
    replicas: 1
"""


@attrs.frozen(kw_only=True)
class DevSettings:
    """What ``llmgw dev`` runs: each field a flag, a key of ``--config``, a line of ``--show-config``."""

    nodes: int = setting(4, min=1, max=200, help="How many simulated nodes (8 fake GPUs each).")
    state_dir: Path = setting(
        Path(".llmgw-dev"), directory=True, help="Where the CA, state, logs and node files go."
    )
    server_port: int = setting(7443, help="The server's HTTPS port.")
    gateway_port: int = setting(8080, help="The OpenAI-compatible gateway's port.")
    metrics_port: int = setting(
        DEV_METRICS_PORT,
        min=1,
        max=65534,
        help="The server's /metrics on 127.0.0.1:PORT; each agent's on its node address at PORT + 1.",
    )
    config_dir: Path | None = setting(
        None,
        directory=True,
        help="Where to leave admin credentials for llmgw ctl (default: where ctl looks).",
    )
    once: bool = setting(False, help="Stop everything and exit once every replica is ready.")
    store: str | None = setting(
        None,
        metavar="postgresql://USER@HOST[:PORT]/DB",
        help="Keep the state in this PostgreSQL database and run two servers on it (--server-port and the "
        "next port): one leads, the other stands by; agents, gateway and ctl know both.",
    )


@click.command()
@settings_options(DevSettings, logs=False)
def dev(settings: DevSettings) -> None:
    """Run a whole llmgw cluster locally on simulated nodes: no GPU needed."""
    with stop_on_signals():
        try:
            _dev(settings)
        except Stopped as stop:
            click.echo(f"llmgw dev: stopped by {stop}")
            raise SystemExit(128 + stop.signum) from None


def _dev(settings: DevSettings) -> None:
    store, server_port = settings.store, settings.server_port
    cluster = LocalCluster(settings.state_dir, server_port=server_port, store=store)
    cluster.metrics_port = settings.metrics_port
    for left in cluster.leftovers:
        click.echo(f"stopped {left}, left running by an earlier llmgw dev on {cluster.state_dir}")
    ports = [server_port, *([server_port + 1] if store else []), settings.gateway_port, settings.metrics_port]
    taken = [port for port in ports if port_in_use("127.0.0.1", port)]
    if taken:
        raise click.ClickException(
            f"127.0.0.1:{taken[0]} is in use by another program (not one an earlier llmgw dev on "
            f"{cluster.state_dir} left: those are stopped first); stop it (`ss -ltnp 'sport = :{taken[0]}'` "
            "names it) or pick other ports with --server-port, --gateway-port and --metrics-port"
        )
    if store is not None:  # every client of the control plane gets both servers
        cluster.server_url = f"https://127.0.0.1:{server_port},https://127.0.0.1:{server_port + 1}"
    ctl_dir = _leave_credentials(settings.config_dir, cluster.server_url, cluster.admin_tls)
    models = cluster.state_dir / "models"
    for name in ("llama-sim-8b", "llama-sim-70b"):
        (models / name).mkdir(parents=True, exist_ok=True)
    catalog = cluster.state_dir / "catalog.yaml"
    catalog.write_text(SAMPLE_CATALOG.format(models=models, path=catalog))
    try:
        click.echo(f"starting the server on {cluster.server_url} and {settings.nodes} simulated nodes")
        cluster.start(settings.nodes)
        _uncordon(cluster)
        if store is not None:
            cluster.start_server(port=server_port + 1, name="server-2")
            click.echo(f"started a standby server on https://127.0.0.1:{server_port + 1}")
        cluster.start_gateway(settings.gateway_port)
        # the sample is what dev runs, also over a state dir where another catalog was applied
        result = cluster.apply(catalog.read_text(), str(catalog), prune=True)
        click.echo(f"applied {catalog}: {result.summary}")
        cluster.wait(cluster.all_ready, "every replica of the sample catalog to be ready")
        cluster.wait(lambda: _gateway_serves(cluster), "the gateway to route to every model")
        _print_next_steps(cluster, ctl_dir, catalog)
        if settings.once:
            return
        click.echo("serving; press Ctrl-C to stop everything")
        _serve_until_interrupted(cluster)
    finally:
        click.echo("stopping agents (and their engines), then the server")
        cluster.stop_all()
        click.echo(f"stopped; this run's logs are in {cluster.logs}")


def _uncordon(cluster: LocalCluster) -> None:
    """Let every node take replicas again: a node an earlier run drained could keep the sample out."""
    for node in cluster.client.request("GET", "/v1/admin/nodes", NodeList).nodes:
        if node.node_id in cluster.nodes and node.state in ("cordoned", "draining"):
            cluster.client.request("POST", f"/v1/admin/nodes/{segment(node.node_id)}/uncordon", DrainStatus)
            click.echo(
                f"{node.node_id} was {node.state} (an earlier run's `llmgw ctl drain` or `cordon`); "
                "uncordoned it, since llmgw dev starts with every node taking replicas"
            )


def _leave_credentials(directory: Path | None, server_url: str, admin: pki.Issued) -> Path:
    directory = directory or config_dir()
    config = directory / "config.toml"
    if config.exists() and _DEV_MARK not in config.read_text():
        click.echo(
            f"note: {config} was not written by llmgw dev; leaving it alone. "
            f"Use: llmgw ctl --config-dir {admin.cert_path.parent} --server {server_url} ...",
            err=True,
        )
        return admin.cert_path.parent
    write_client_config(
        directory, server_url, admin.ca_path, admin.cert_path, admin.key_path, header=f"{_DEV_MARK}\n"
    )
    return directory


def _gateway_serves(cluster: LocalCluster) -> bool:
    try:
        response = httpx.get(f"{cluster.gateway_url}/v1/models", timeout=2)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and len(response.json().get("data", [])) == 2


#: seconds the first chat completion may take to be answered once every replica is ready
FIRST_ANSWER_WITHIN = 30.0


def _first_answer(gateway_url: str, body: str) -> str:
    """The first chat completion's text, asked again until the gateway routes to a ready replica.

    The gateway learns a replica is ready from the routes feed a moment after the server does, so a
    503 or 502 right after "ready" is asked again; past :data:`FIRST_ANSWER_WITHIN` seconds the
    gateway's last answer is the error.
    """
    deadline, last = time.monotonic() + FIRST_ANSWER_WITHIN, ""
    while time.monotonic() < deadline:
        try:
            response = httpx.post(
                f"{gateway_url}/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=30,
            )
            choices = response.json().get("choices") if response.status_code == 200 else None
            if choices:
                return choices[0]["message"]["content"]
            last = f"{response.status_code} {response.text[:300]}"
        except (httpx.HTTPError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise click.ClickException(
        f"every replica is ready, but the gateway at {gateway_url} did not answer a chat completion within "
        f"{FIRST_ANSWER_WITHIN:g} s (last answer: {last}); see its log, gateway.log in this run's log folder"
    )


def _print_next_steps(cluster: LocalCluster, ctl_dir: Path, catalog: Path) -> None:
    data = cluster.replicas()
    click.echo(f"llmgw dev: {len(data.replicas)} replicas ready")
    for r in data.replicas:
        shards = ", ".join(f"{s.node} {cluster.nodes[s.node].address}:{s.port}" for s in r.shards)
        click.echo(f"  {r.id:<16} {shards}")
    body = json.dumps({"model": "llama-sim-8b", "messages": [{"role": "user", "content": "Hello!"}]})
    content = _first_answer(cluster.gateway_url, body)
    click.echo(f"gateway: {cluster.gateway_url}/v1 (OpenAI-compatible; no API keys in llmgw dev)")
    click.echo(f"  llama-sim-8b answered: {content!r}")
    click.echo(
        f"  curl {cluster.gateway_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"
    )
    if cluster.metrics_port is not None:
        agents = " ".join(f"{n.address}:{cluster.metrics_port + 1}" for n in cluster.nodes.values())
        click.echo(
            f"metrics: server http://127.0.0.1:{cluster.metrics_port}/metrics, gateway "
            f"{cluster.gateway_url}/metrics, agents (/metrics) {agents}"
        )
    ctl = _ctl_command() + ("" if ctl_dir == config_dir() else f" --config-dir {ctl_dir}")
    click.echo("next, from another terminal:")
    click.echo(f"  {ctl} nodes          # the simulated nodes, their GPUs and fabrics")
    click.echo(f"  {ctl} replicas       # where each replica runs")
    click.echo(f"  {ctl} events         # what the server decided and why")
    multi = {s.node for r in data.replicas if len(r.shards) > 1 for s in r.shards}
    movable = sorted({r.shards[0].node for r in data.replicas if len(r.shards) == 1} - multi)
    if movable:  # a node holding a two-node replica may have nowhere to move it in a small dev cluster
        node = movable[0]
        click.echo(f"  {ctl} drain {node}   # move {node}'s replicas elsewhere, without an outage")
    click.echo(f"  {ctl} apply {catalog}")
    click.echo(
        f"logs: {cluster.logs}, and each node's shards under {cluster.state_dir / 'nodes'}/*/agent/logs"
    )


def _ctl_command() -> str:
    """``llmgw ctl`` when the ``llmgw`` on PATH is this one, else its path: ``.venv/bin/llmgw ctl``."""
    exe = Path(program("llmgw"))
    on_path = shutil.which("llmgw")
    if on_path and Path(on_path).resolve() == exe.resolve():
        return "llmgw ctl"
    try:
        return f"{exe.relative_to(Path.cwd())} ctl"
    except ValueError:
        return f"{exe} ctl"


def _serve_until_interrupted(cluster: LocalCluster) -> None:
    """Watch the cluster until a stop signal (:class:`Stopped`) or one of its processes exits on its own."""
    try:
        while True:
            cluster.check()
            time.sleep(0.5)
    except Stopped as stop:
        click.echo(f"llmgw dev: {stop}")
