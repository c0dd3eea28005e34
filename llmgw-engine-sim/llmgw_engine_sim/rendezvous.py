"""Multi-node rendezvous over TCP, as a distributed engine's init would do.

Rank 0 binds the dist-init address; each worker connects (retrying until
rank 0 is up), says hello with its rank, nnodes and model, and is welcomed
or refused. Afterwards both sides send heartbeats; a peer that closes its
connection or falls silent for ``peer_timeout`` seconds is lost, and a lost
peer ends the process, as a broken collective would. Rank 0 exiting drops
every worker's connection, so a lost worker takes the whole replica down.

The wire format is one JSON object per line: ``hello``, ``welcome``,
``refused`` (with ``reason``), ``ready`` (every rank joined) and ``heartbeat``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import trio

from llmgw_engine_sim.server import reported_env

__all__ = ["Coordinator", "join_replica"]

log = logging.getLogger("llmgw_engine_sim")

_MAX_LINE = 64 * 1024

Exit = Callable[[int, str], None]


class _Lines:
    """JSON objects, one per line, over a trio stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._buffer = b""
        self._send_lock = trio.Lock()

    async def send(self, message: dict[str, Any]) -> None:
        async with self._send_lock:
            await self.stream.send_all(json.dumps(message).encode() + b"\n")

    async def receive(self) -> dict[str, Any] | None:
        """The next message, or None at end of stream."""
        while b"\n" not in self._buffer:
            if len(self._buffer) > _MAX_LINE:
                raise ValueError("message too long")
            data = await self.stream.receive_some()
            if not data:
                return None
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("message is not a JSON object")
        return message


async def _keep_alive(lines: _Lines, peer_timeout: float, on_message: Callable[[dict], None]) -> str:
    """Exchange heartbeats until the peer is lost; return why it was lost."""
    reasons: list[str] = []
    async with trio.open_nursery() as nursery:

        async def lost(reason: str) -> None:
            reasons.append(reason)
            nursery.cancel_scope.cancel()

        async def send_heartbeats() -> None:
            try:
                while True:
                    await lines.send({"type": "heartbeat"})
                    await trio.sleep(peer_timeout / 4)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                await lost(f"connection broken ({exc.__cause__ or exc})")

        async def receive_heartbeats() -> None:
            try:
                while True:
                    with trio.move_on_after(peer_timeout) as silence:
                        message = await lines.receive()
                    if silence.cancelled_caught:
                        return await lost(f"no heartbeat for {peer_timeout:g}s")
                    if message is None:
                        return await lost("connection closed")
                    on_message(message)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError) as exc:
                await lost(f"connection broken ({exc.__cause__ or exc})")

        nursery.start_soon(send_heartbeats)
        nursery.start_soon(receive_heartbeats)
    return reasons[0]


class Coordinator:
    """Rank 0's side: accepts the workers, then watches them."""

    def __init__(
        self,
        *,
        nnodes: int,
        model: str,
        peer_timeout: float,
        exit: Exit,
        on_peer_loss: Callable[[int, str, str], None] | None = None,
    ) -> None:
        """:param on_peer_loss: called as ``(rank, address, reason)`` when a worker is lost;
        None ends the process with code 1 at once, as a broken collective would."""
        self.nnodes = nnodes
        self.model = model
        self.peer_timeout = peer_timeout
        self._exit = exit
        self._on_peer_loss = on_peer_loss
        #: rank -> what the worker reported (address, pid, argv, env)
        self.workers: dict[int, dict[str, Any]] = {}
        #: set once every worker has joined
        self.all_joined = trio.Event()

    async def serve(
        self, host: str, port: int, join_timeout: float, *, task_status=trio.TASK_STATUS_IGNORED
    ) -> None:
        """Bind ``host:port``, then accept workers until the process ends.

        Calls ``task_status.started()`` once bound. If not every worker joined
        within ``join_timeout`` seconds, ends the process with code 1.
        """
        listeners = await trio.open_tcp_listeners(port, host=host)
        task_status.started()
        log.info("rendezvous listening on %s:%d, waiting for %d workers", host, port, self.nnodes - 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._worker, listeners)
            with trio.move_on_after(join_timeout):
                await self.all_joined.wait()
            if not self.all_joined.is_set():
                joined = len(self.workers) + 1
                self._exit(1, f"only {joined} of {self.nnodes} ranks joined within {join_timeout:g}s")

    def _refusal(self, hello: dict[str, Any], address: str) -> str | None:
        if hello.get("type") != "hello" or not isinstance(hello.get("rank"), int):
            return f"expected a hello with a rank, got {hello!r}"
        rank = hello["rank"]
        if hello.get("nnodes") != self.nnodes:
            return f"rank {rank} says nnodes={hello.get('nnodes')}, this replica has nnodes={self.nnodes}"
        if not 1 <= rank < self.nnodes:
            return f"rank {rank} is out of range 1..{self.nnodes - 1}"
        if rank in self.workers:
            return f"rank {rank} already joined from {self.workers[rank]['address']}"
        if hello.get("model") != self.model:
            return f"rank {rank} loads model {hello.get('model')!r}, this replica {self.model!r}"
        return None

    async def _worker(self, stream: trio.SocketStream) -> None:
        host, port = stream.socket.getpeername()[:2]
        address = f"{host}:{port}"
        lines = _Lines(stream)
        try:
            with trio.fail_after(max(self.peer_timeout, 5.0)):
                hello = await lines.receive()
        except (trio.TooSlowError, trio.BrokenResourceError, ValueError) as exc:
            log.warning(
                "rendezvous: dropped %s: no valid hello (%s)", address, str(exc) or type(exc).__name__
            )
            return
        if hello is None:
            return
        refusal = self._refusal(hello, address)
        if refusal:
            log.warning("rendezvous: refused %s: %s", address, refusal)
            try:
                await lines.send({"type": "refused", "reason": refusal})
            except trio.BrokenResourceError:
                pass
            return
        rank = hello["rank"]
        self.workers[rank] = {
            "rank": rank,
            "address": address,
            "pid": hello.get("pid"),
            "argv": hello.get("argv"),
            "env": hello.get("env"),
        }
        log.info(
            "rendezvous: rank %d joined from %s (%d/%d)", rank, address, len(self.workers) + 1, self.nnodes
        )
        with trio.move_on_after(self.peer_timeout):
            try:
                await lines.send({"type": "welcome"})
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # _keep_alive notices and reports it
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._announce_ready, lines)
            reason = await _keep_alive(lines, self.peer_timeout, lambda message: None)
            nursery.cancel_scope.cancel()
        if self._on_peer_loss is not None:
            self._on_peer_loss(rank, address, reason)
            return
        self._exit(1, f"peer lost: rank {rank} ({address}): {reason}")

    async def _announce_ready(self, lines: _Lines) -> None:
        if len(self.workers) == self.nnodes - 1 and not self.all_joined.is_set():
            log.info("rendezvous: all %d ranks joined", self.nnodes)
            self.all_joined.set()
        await self.all_joined.wait()
        try:
            await lines.send({"type": "ready"})
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # _keep_alive notices and reports it


async def join_replica(
    *,
    host: str,
    port: int,
    rank: int,
    nnodes: int,
    model: str,
    peer_timeout: float,
    join_timeout: float,
    exit: Exit,
    local_address: str | None = None,
) -> None:
    """A worker's side: reach rank 0, join, and exchange heartbeats until a peer is lost.

    Retries connecting until ``join_timeout`` has passed. Ends the process
    through ``exit``: code 1 when refused, unreachable or when rank 0 is lost.

    :param local_address: the IP address to connect from (this node's address).
    """
    address = f"{host}:{port}"
    stream = await _connect(host, port, join_timeout, exit, local_address)
    if stream is None:
        return
    lines = _Lines(stream)
    hello = {"type": "hello", "rank": rank, "nnodes": nnodes, "model": model}
    hello |= {"pid": os.getpid(), "argv": sys.argv, "env": reported_env()}
    try:
        with trio.fail_after(max(peer_timeout, 5.0)):
            await lines.send(hello)
            reply = await lines.receive()
    except (trio.TooSlowError, trio.BrokenResourceError, ValueError) as exc:
        return exit(1, f"rendezvous with rank 0 at {address} failed: {str(exc) or type(exc).__name__}")
    if reply is None:
        return exit(1, f"rank 0 at {address} closed the connection during the handshake")
    if reply.get("type") == "refused":
        return exit(1, f"rank 0 at {address} refused this worker: {reply.get('reason')}")
    log.info("rendezvous: joined rank 0 at %s as rank %d of %d", address, rank, nnodes)

    def on_message(message: dict[str, Any]) -> None:
        if message.get("type") == "ready":
            log.info("rendezvous: all %d ranks joined; worker ready", nnodes)

    async with stream:
        reason = await _keep_alive(lines, peer_timeout, on_message)
    exit(1, f"peer lost: rank 0 ({address}): {reason}")


async def _connect(
    host: str, port: int, join_timeout: float, exit: Exit, local_address: str | None
) -> trio.SocketStream | None:
    deadline = trio.current_time() + join_timeout
    logged = False
    while True:
        try:
            return await trio.open_tcp_stream(host, port, local_address=local_address)
        except OSError as exc:
            if trio.current_time() >= deadline:
                exit(1, f"could not reach rank 0 at {host}:{port} within {join_timeout:g}s: {exc}")
                return None
            if not logged:
                log.info("rendezvous: waiting for rank 0 at %s:%d (%s)", host, port, exc.strerror or exc)
                logged = True
            await trio.sleep(0.1)
