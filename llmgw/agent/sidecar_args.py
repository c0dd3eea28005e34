"""Placeholders in a sidecar's ``argv`` and ``ready`` check, filled in by the agent for each shard.

A profile's sidecars are the same for every replica; two replicas of it on one
node must not share a port. So a sidecar says ``{port}`` where it listens: the
agent picks a free port on the node's address for that sidecar of that shard
(as the server picks the engine's port), and puts it in the sidecar's argv and
in its ready check (``ready: "http:{port}/health"``)::

    sidecars:
      - name: metrics-proxy
        argv: ["/opt/proxy", "--listen", "{host}:{port}", "--upstream", "{host}:{engine_port}"]
        ready: "tcp:{port}"

Every placeholder: :data:`PLACEHOLDERS`. Other text in braces is left as it is.
"""

from __future__ import annotations

import re
import socket

import attrs

from llmgw.models import LaunchSpec, Sidecar

__all__ = ["PLACEHOLDERS", "fill_sidecar", "free_port"]

#: placeholder -> what it becomes
PLACEHOLDERS = {
    "port": "a free port on the node's address, this sidecar's own (one per sidecar of each shard)",
    "host": "the node's address (the engine's --host)",
    "engine_port": "the port the shard's engine serves on",
    "gpus": "the shard's GPU indices, comma-separated (empty: none)",
    "model": "the model's source",
    "served_name": "the name clients ask for",
    "rank": "the shard's rank in its replica",
    "replica": "the replica's id",
}

_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the kernel's pick), for a sidecar's ``{port}``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def fill_sidecar(sidecar: Sidecar, spec: LaunchSpec, replica_id: str) -> Sidecar:
    """``sidecar`` with every placeholder of its argv and ready check filled in for one shard.

    Called by the agent just before it starts the sidecar; ``{port}`` gets a new free port each call.
    """
    text = " ".join((*sidecar.argv, sidecar.ready or ""))
    values = {
        "port": str(free_port(spec.host)) if "{port}" in text else "",
        "host": spec.host,
        "engine_port": str(spec.port),
        "gpus": ",".join(str(gpu) for gpu in spec.gpus),
        "model": spec.model_source,
        "served_name": spec.served_name,
        "rank": str(spec.rank),
        "replica": replica_id,
    }

    def fill(value: str) -> str:
        return _PLACEHOLDER.sub(lambda found: values[found[1]], value)

    ready = fill(sidecar.ready) if sidecar.ready is not None else None
    return attrs.evolve(sidecar, argv=tuple(fill(arg) for arg in sidecar.argv), ready=ready)
