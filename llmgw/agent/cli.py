"""``llmgw agent``: run the node agent until SIGTERM or Ctrl-C, then leave its shards to the next."""

from __future__ import annotations

import logging

import click

from llmgw.agent.config import AgentConfig
from llmgw.cli import Command, serve_until_signalled
from llmgw.settings import settings_options

__all__ = ["agent"]

log = logging.getLogger("llmgw.agent")


@click.command("agent", cls=Command)
@settings_options(AgentConfig)
def agent(config: AgentConfig) -> None:
    """Run this node's agent: report its facts, run the shards the server gives it.

    On SIGTERM or Ctrl-C it exits 0 and leaves every shard running: the next agent adopts them
    (an upgrade restarts nothing); with no agent for --orphan-grace seconds their launchers stop them.
    With --orphan-grace 0 it tells the server it is leaving, then stops every shard first.
    Settings come from the flags, their environment variables, agent.toml (--config; its tables
    [engines.NAME], [health] and [sync] have no flags), then the defaults.
    """
    import trio

    from llmgw.agent import serve_agent

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
