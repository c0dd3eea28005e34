"""TCP connections as the kernel lists them: for tests that must know a server got, or read, a request.

A stopped process (SIGSTOP) or one that has not read yet leaves what a client
sent in its socket's receive queue; :func:`connections_to` lists the
connections whose server end is on a port with the bytes nobody read, from
``/proc/net/tcp`` (Linux, this network namespace). Tests wait on it instead of
sleeping: "the request waits in the stopped server's socket", "the gateway
read every head".
"""

from __future__ import annotations

from pathlib import Path

import attrs

__all__ = ["Connection", "connections_to"]

_ESTABLISHED = "01"


@attrs.frozen
class Connection:
    """One established TCP connection, seen from its server end."""

    #: the client's ``address:port``
    client: str
    #: bytes received and not yet read by the server
    unread: int


def _address(text: str) -> tuple[str, int]:
    host, port = text.split(":")
    return ".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0)), int(port, 16)


def connections_to(
    port: int, host: str = "127.0.0.1", table: Path = Path("/proc/net/tcp")
) -> list[Connection]:
    """The established connections whose server end is ``host:port`` (accepted or still in the backlog).

    Called by tests while they wait; returns them in the kernel's order.
    """
    found = []
    for line in table.read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state, queues = fields[1], fields[2], fields[3], fields[4]
        if state != _ESTABLISHED or _address(local) != (host, port):
            continue
        client_host, client_port = _address(remote)
        found.append(Connection(f"{client_host}:{client_port}", int(queues.split(":")[1], 16)))
    return found
