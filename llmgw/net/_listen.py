"""For :class:`llmgw.net.server.HttpServer`: listening sockets that processes share, ``--listen``, reasons."""

from __future__ import annotations

import http
import socket

import trio

from llmgw.errors import LlmgwError

__all__ = ["open_shared_listeners", "parse_listen", "reason_phrase"]


async def open_shared_listeners(host: str, port: int, backlog: int = 1024) -> list[trio.SocketListener]:
    """Listen on ``host:port`` with ``SO_REUSEPORT``: every process doing the same gets a share of the
    connections the kernel accepts there. One listener per address ``host`` resolves to.

    :raises OSError: when the address cannot be bound (in use without ``SO_REUSEPORT``, not local).
    """
    infos = await trio.socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    listeners = []
    try:
        for family, kind, proto, _, address in infos[:1]:
            sock = trio.socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                await sock.bind(address)
                sock.listen(backlog)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    return listeners


def parse_listen(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); raises a :class:`LlmgwError` naming ``flag``."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise LlmgwError(f"{flag} {text!r}: expected HOST:PORT, e.g. 0.0.0.0:7443")
    return host.strip("[]") or "0.0.0.0", int(port)


def reason_phrase(status: int) -> str:
    """The standard reason phrase of ``status`` (empty for an unknown one)."""
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""
