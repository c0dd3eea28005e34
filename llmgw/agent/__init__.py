"""``llmgw agent``: one per node. Discovery, the sync loop with the server, shard supervision.

The public surface:

- :class:`AgentConfig` and :func:`load_agent_config` (``agent.toml`` plus flags);
- :func:`serve_agent`, which runs the agent until cancelled;
- :class:`Agent`, what ``serve_agent`` hands to ``task_status.started``.

Modules: :mod:`~llmgw.agent.config`, :mod:`~llmgw.agent.facts` (what the node
has), :mod:`~llmgw.agent.sync` (the loop with the server),
:mod:`~llmgw.agent.supervisor` (one shard: sidecars, engine, health),
:mod:`~llmgw.agent.process` (commands under launchers),
:mod:`~llmgw.agent.records` and :mod:`~llmgw.agent.adoption` (what an agent
leaves running and the next adopts) and
:mod:`~llmgw.agent.launcher` (the small program every engine and sidecar
runs under). Names are imported lazily, so that the launcher, which imports
this package, starts without loading trio or httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["Agent", "AgentConfig", "AgentConfigError", "load_agent_config", "serve_agent"]

_WHERE = {
    "Agent": "llmgw.agent.sync",
    "AgentConfig": "llmgw.agent.config",
    "AgentConfigError": "llmgw.agent.config",
    "load_agent_config": "llmgw.agent.config",
    "serve_agent": "llmgw.agent.main",
}

if TYPE_CHECKING:
    from llmgw.agent.config import AgentConfig, AgentConfigError, load_agent_config
    from llmgw.agent.main import serve_agent
    from llmgw.agent.sync import Agent


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'llmgw.agent' has no attribute {name!r}")
