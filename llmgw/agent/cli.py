"""``llmgw agent``: run the node agent until SIGTERM or Ctrl-C, then leave its shards to the next."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from llmgw.cli import Command, serve_until_signalled
from llmgw.logs import configure_logging, log_options

__all__ = ["agent"]

log = logging.getLogger("llmgw.agent")


def _engine_options(values: tuple[str, ...]) -> dict[str, dict[str, str]]:
    from llmgw.agent.config import parse_engine_option

    engines: dict[str, dict[str, str]] = {}
    for text in values:
        name, program, path = parse_engine_option(text)
        engines.setdefault(name, {})[program] = path
    return engines


_PATH = click.Path(dir_okay=False, path_type=Path)
#: setting -> the parameter that gives it, where the names differ
_PARAMS = {"engines": "engine_options"}


def _given(ctx: click.Context, flags: dict) -> dict[str, str]:
    """The settings a flag or an environment variable gave: ``"flag"`` or ``"environment NAME"``."""
    given = {}
    for key, value in flags.items():
        if value is None or value in ((), {}):
            continue
        name = "verbose" if key == "log_level" and ctx.params.get("verbose") else _PARAMS.get(key, key)
        source = ctx.get_parameter_source(name)
        param = next((p for p in ctx.command.params if p.name == name), None)
        if source == click.core.ParameterSource.ENVIRONMENT and param is not None:
            given[key] = f"environment {getattr(param, 'envvar', '')}"
        else:
            given[key] = "flag"
    return given


@click.command("agent", cls=Command)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="agent.toml with any of the settings below (flags override it).",
)
@click.option("--node", help="This node's id: the common name of its certificate.")
@click.option(
    "--server",
    envvar="LLMGW_SERVER",
    help="The server's URL, https://HOST:PORT; several servers comma-separated (env LLMGW_SERVER).",
)
@click.option("--address", help="The address this node is reached at; engines bind it.")
@click.option("--cert", type=_PATH, help="This node's certificate (llmgw ca issue-node).")
@click.option("--key", type=_PATH, help="The certificate's private key.")
@click.option("--ca", type=_PATH, help="The CA certificate the server's certificate chains to.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where shard logs (logs/) and process records (run/) go.",
)
@click.option(
    "--nvidia-smi",
    "nvidia_smi",
    metavar="PATH",
    help="The nvidia-smi program  [default: nvidia-smi on PATH].",
)
@click.option("--ib-root", metavar="DIR", help="The sysfs RDMA root  [default: /sys/class/infiniband].")
@click.option(
    "--fabric",
    "fabrics",
    multiple=True,
    metavar="NAME[:ADAPTER,...]",
    help="A fabric this node is on (repeatable); replaces the file's list.",
)
@click.option(
    "--port-range", metavar="LO-HI", help="Ports the server may give shards  [default: 20000-20999]."
)
@click.option(
    "--engine",
    "engine_options",
    multiple=True,
    metavar="NAME:PROGRAM=PATH",
    help="Where an engine's program is, e.g. vllm:vllm=/opt/vllm/bin/vllm (repeatable).",
)
@click.option(
    "--stop-grace",
    type=float,
    metavar="SECONDS",
    help="Seconds between SIGTERM and SIGKILL when a shard stops  [default: 10].",
)
@click.option(
    "--orphan-grace",
    type=float,
    metavar="SECONDS",
    help="Seconds each engine keeps running while no agent is attached, for the next agent to adopt "
    "(0: engines end with their agent)  [default: 300].",
)
@click.option(
    "--models-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where copies of distributable models go  [default: /var/lib/llmgw/models].",
)
@click.option(
    "--peer-port",
    type=int,
    metavar="PORT",
    help="Serve model files to other nodes on this port (0: any free port)  [default: 7444].",
)
@click.option("--max-uploads", type=int, metavar="N", help="Files served to peers at once  [default: 4].")
@click.option(
    "--bandwidth-limit",
    type=float,
    metavar="MB/S",
    help="MB/s served to peers in all (0: no limit)  [default: 0].",
)
@click.option(
    "--seed-root",
    type=click.Path(file_okay=False, path_type=Path),
    help="What stands for / when looking for a seed:///PATH here (simulated nodes)  [default: /].",
)
@click.option(
    "--hub-endpoint",
    metavar="URL",
    help="The Hugging Face Hub hf:// sources come from  [default: $HF_ENDPOINT, else https://huggingface.co].",
)
@click.option(
    "--hub-token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A file holding the Hub token (read at each use, never logged)  [default: no token].",
)
@click.option(
    "--metrics-listen",
    metavar="HOST:PORT",
    help="Serve GET /metrics and /health in plain HTTP on HOST:PORT  [default: not served].",
)
@log_options
@click.option(
    "--show-config",
    is_flag=True,
    help="Print the settings in force (from flags, environment, agent.toml, defaults) as TOML, and exit.",
)
@click.pass_context
def agent(
    ctx: click.Context,
    config_file: Path | None,
    node: str | None,
    server: str | None,
    address: str | None,
    cert: Path | None,
    key: Path | None,
    ca: Path | None,
    state_dir: Path | None,
    nvidia_smi: str | None,
    ib_root: str | None,
    fabrics: tuple[str, ...],
    port_range: str | None,
    engine_options: tuple[str, ...],
    stop_grace: float | None,
    orphan_grace: float | None,
    models_dir: Path | None,
    peer_port: int | None,
    max_uploads: int | None,
    bandwidth_limit: float | None,
    seed_root: Path | None,
    hub_endpoint: str | None,
    hub_token_file: Path | None,
    metrics_listen: str | None,
    log_format: str | None,
    log_level: str | None,
    verbose: bool,
    show_config: bool,
) -> None:
    """Run this node's agent: report its facts, run the shards the server gives it.

    On SIGTERM or Ctrl-C it exits 0 and leaves every shard running: the next agent adopts them
    (an upgrade restarts nothing); with no agent for --orphan-grace seconds their launchers stop them.
    With --orphan-grace 0 it tells the server it is leaving, then stops every shard first.
    """
    import trio

    from llmgw.agent import serve_agent
    from llmgw.agent.config import load_agent_config, parse_port_range

    flags = {
        "node": node,
        "server": server,
        "address": address,
        "cert": cert and str(cert),
        "key": key and str(key),
        "ca": ca and str(ca),
        "state_dir": state_dir and str(state_dir),
        "nvidia_smi": nvidia_smi,
        "ib_root": ib_root,
        "fabrics": fabrics,
        "port_range": parse_port_range(port_range) if port_range else None,
        "engines": _engine_options(engine_options),
        "stop_grace": stop_grace,
        "orphan_grace": orphan_grace,
        "models_dir": models_dir and str(models_dir),
        "peer_port": peer_port,
        "max_uploads": max_uploads,
        "bandwidth_limit": bandwidth_limit,
        "seed_root": seed_root and str(seed_root),
        "hub_endpoint": hub_endpoint,
        "hub_token_file": hub_token_file and str(hub_token_file),
        "metrics_listen": metrics_listen,
        "log_format": log_format,
        "log_level": "debug" if verbose else log_level and log_level.lower(),
    }
    config = load_agent_config(flags, config_file)
    if show_config:
        from llmgw.agent.show import config_lines

        for line in config_lines(config, _given(ctx, flags), config_file):
            click.echo(line)
        return
    configure_logging(config.log_format, config.log_level)
    leaving: list[trio.Event] = []

    async def serve() -> None:
        leaving.append(trio.Event())
        await serve_agent(config, leave=leaving[0])

    serve_until_signalled(
        serve,
        stop=lambda: leaving[0].set() if leaving else None,
        log=log,
        stopping=(
            f"leaving every shard running for the next agent (kept {config.orphan_grace:g} s)"
            if config.orphan_grace > 0
            else "stopping every shard (the server told first), then exiting"
        ),
        stopping_again=f"shards still running get SIGKILL {config.stop_grace:g} s after their SIGTERM",
    )
