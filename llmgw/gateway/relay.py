"""Relaying a streamed answer to its client: as it comes, and on from another replica when its own breaks.

:class:`Relaying` is the part of :class:`llmgw.gateway.proxy.Proxy` that
passes a response body through once it is handed over to the client (see
the proxy for what comes before). A server-sent-events stream whose replica
breaks goes on from another (mid-stream migration,
:mod:`llmgw.gateway.migration`: the request rewritten, the new replica chosen
by prefix-aware routing among those that continue, its events rewritten), or
ends with an error event; any other body that breaks drops the client's
connection.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import trio

from llmgw.gateway.adapters import request_body
from llmgw.gateway.balancer import Balancer, Upstream
from llmgw.gateway.call import Call
from llmgw.gateway.demand import Demand
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.migration import (
    MigrationCause,
    NotContinued,
    Rewriter,
    Transcript,
    event_boundary,
    plan,
)
from llmgw.gateway.prefix import prefix_keys, prompt_text
from llmgw.gateway.stalls import Attempt
from llmgw.gateway.usage import StreamUsage
from llmgw.net.client import (
    ClientResponse,
    ConnectError,
    ConnectionPool,
    HttpClientError,
    ReadTimeout,
    RemoteProtocolError,
)

if TYPE_CHECKING:
    from llmgw.net.server import Response

__all__ = [
    "CONTINUABLE",
    "TURN_BYTES",
    "Exchange",
    "Relay",
    "Relaying",
    "request_headers",
    "sse_error",
    "turn_end",
]

log = logging.getLogger("llmgw.gateway")

#: the endpoints whose streams can be continued on another replica
CONTINUABLE = frozenset({"chat/completions", "completions"})
#: bytes of a partial event held back before a stream gives up being continuable (no event boundary)
_HELD_LIMIT = 1024 * 1024
#: the most of an event stream relayed in one go: a larger read goes on a turn at a time, each after
#: the other streams in the process had theirs (some 30 token events; a read is up to 64 KiB)
TURN_BYTES = 4096


class Relaying:
    """Mixed into :class:`llmgw.gateway.proxy.Proxy`: relaying a response body handed over to its client."""

    pool: ConnectionPool
    balancer: Balancer
    metrics: GatewayMetrics
    #: continuations per broken stream (:attr:`llmgw.gateway.proxy.ProxySettings.migration_limit`)
    migration_limit: int
    demand: Demand
    #: an attempt on a replica failed: (the reason, named by replica id; the response given)
    _failed: Callable[[Upstream, str, str, Response | None], tuple[str, Response | None]]

    async def _relay(self, call: Call, relay: Relay, sse: bool) -> AsyncIterator[bytes]:
        """The replica's body, chunk by chunk as it arrives.

        A stream the replica breaks goes on from another replica (:meth:`_continue`) or ends with an
        error event; any other body that breaks drops the client's connection.
        """
        first = True
        tail = b"\n\n"
        usage = StreamUsage() if sse else None
        last = 0.0
        continuable = sse and self.migration_limit > 0 and call.endpoint in CONTINUABLE
        # a stream that may be continued: whole events go out, kept in its transcript
        transcript = Transcript() if continuable else None
        held = b""
        rewriter: Rewriter | None = None
        broke_at: float | None = None
        tried = [relay.replica]
        # a large read of an event stream, relayed a turn at a time: the read, where the next turn starts
        rest, at = b"", 0
        try:
            while True:
                replica, upstream = relay.replica, relay.upstream
                try:
                    if rest:
                        await trio.lowlevel.checkpoint()  # the other streams' turns come first
                        chunk, start = rest, at
                    else:
                        chunk, start = await upstream.receive_chunk(), 0
                    if sse and chunk is not None and len(chunk) - start > TURN_BYTES:
                        rest, at = chunk, turn_end(chunk, start)
                        chunk = chunk[start:at]
                    elif start:
                        rest, chunk = b"", chunk[start:]
                except HttpClientError as exc:
                    cause = _cause(relay.attempt, replica, exc)
                    reason = self._failed(replica, "mid_stream", relay.attempt.why or str(exc), None)[0]
                    log.warning(
                        "request %s: replica %s broke its response mid-way: %s",
                        call.request_id,
                        replica.name,
                        reason,
                    )
                    if not sse:
                        # The body cannot be ended honestly: have the server drop the client's connection.
                        raise trio.BrokenResourceError(f"replica {replica.name} broke the response") from None
                    if transcript is None:
                        why = NotContinued.DISABLED if call.endpoint in CONTINUABLE else NotContinued.REQUEST
                    else:
                        went_on = await self._continue(call, transcript, tried, cause, usage)
                        if isinstance(went_on, tuple):
                            relay.finish()
                            relay, rewriter = went_on
                            held, broke_at = b"", last
                            continue
                        if isinstance(went_on, bytes):  # nothing was left to generate
                            yield went_on
                            return
                        why = went_on
                    self.metrics.not_continued(call.model, why)
                    separator = b"" if tail.endswith(b"\n\n") else b"\n\n"
                    # as before migration existed: the reason it did not go on is in the metric and the log
                    log.info("request %s: stream not continued elsewhere: %s", call.request_id, why.value)
                    yield separator + sse_error(f"replica {replica.name} failed mid-stream: {reason}")
                    return
                if chunk is None:
                    if held:  # the stream ended inside an event: end it
                        yield rewriter.rewrite(held + b"\n\n") if rewriter is not None else held
                    return
                now = replica.last_byte = trio.current_time()
                if transcript is not None:
                    if held:
                        chunk, held = held + chunk, b""
                    if not chunk.endswith(b"\n\n"):  # the common case, whole events, costs one test
                        cut = event_boundary(chunk)
                        chunk, held = chunk[:cut], chunk[cut:]
                        if len(held) > _HELD_LIMIT:  # not events: pass it on, and give up continuing
                            chunk, held, transcript = chunk + held, b"", None
                    if rewriter is not None and chunk:
                        chunk = rewriter.rewrite(chunk)
                    if not chunk:
                        continue
                    if transcript is not None:
                        transcript.add(chunk)
                if usage is not None:
                    usage.feed(chunk)
                    call.usage = usage.usage
                    call.events = usage.events
                    if first:
                        call.ttft = now - call.start
                        self.metrics.first_token(call.model, call.ttft)
                        self.demand.first_token(call.model, call.ttft)
                    elif broke_at is not None:
                        gap = now - broke_at
                        self.metrics.migration_gap(call.model, gap)
                        call.migration_gap = max(gap, call.migration_gap or 0.0)
                        broke_at = None
                    else:
                        self.metrics.inter_token_latency(call.model, now - last)
                    last = now
                first = False
                tail = chunk[-2:] if len(chunk) >= 2 else tail[-1:] + chunk
                yield chunk
        finally:
            relay.finish()

    async def _continue(
        self,
        call: Call,
        transcript: Transcript,
        tried: list[Upstream],
        cause: MigrationCause,
        usage: StreamUsage | None,
    ) -> tuple[Relay, Rewriter] | bytes | NotContinued:
        """Go on with a broken stream: (the new replica's response, its rewriter), the events that end
        a stream with nothing left to generate, or why it cannot go on.

        Called by :meth:`_relay` when a stream's replica broke. The replica is chosen as for a new
        request (prefix-aware routing on the prompt with the text so far), among the replicas whose
        engine continues a final assistant message and that this request has not tried.
        """
        if call.migration_attempts >= self.migration_limit:
            return NotContinued.LIMIT
        carried = transcript.carried()
        planned = plan(call.body, call.endpoint, carried)
        if isinstance(planned, NotContinued):
            return planned
        if planned.body is None:
            call.migrations += 1
            self.metrics.migration(call.model, cause, 0)
            return planned.tail
        prefix = ()
        if self.balancer.routing == "prefix":
            prefix = prefix_keys(prompt_text(call.endpoint, planned.request))

        def counted(prompt: int, completion: int) -> None:
            if usage is not None:
                usage.usage = (prompt, completion)

        while call.migration_attempts < self.migration_limit:
            replica = self.balancer.choose(
                call.routed_as, trio.current_time(), prefix=prefix, exclude=tried, continuing=True
            )
            if replica is None:
                others = [r for r in self.balancer.replicas(call.routed_as) if r not in tried]
                if others and not any(r.continues for r in others):
                    return NotContinued.ENGINE
                return NotContinued.NO_REPLICA
            call.migration_attempts += 1
            tried.append(replica)
            relay = await self._open_stream(call, replica, planned.body)
            if relay is not None:
                call.migrations += 1
                self.metrics.migration(call.model, cause, carried.tokens)
                log.info(
                    "request %s: stream continued on replica %s after %d tokens (%s)",
                    call.request_id,
                    replica.name,
                    carried.tokens,
                    cause.value,
                )
                return relay, Rewriter(carried, bool(carried.text), planned.wants_usage, counted)
        return NotContinued.LIMIT

    async def _open_stream(self, call: Call, replica: Upstream, body: bytes) -> Relay | None:
        """Send a continuation to ``replica``: its stream, or None when it did not answer with one."""
        exchange = Exchange(replica)
        try:
            try:
                upstream = await exchange.send(self.pool, call, body)
            except HttpClientError as exc:
                kind = "connect" if isinstance(exc, ConnectError) else "closed"
                self._failed(replica, kind, str(exc), None)
                return None
            content_type = upstream.header("content-type") or ""
            if upstream.status != 200 or not content_type.startswith("text/event-stream"):
                why = f"answered {upstream.status} to a continuation"
                self._failed(replica, f"status_{upstream.status}", why, None)
                return None
            replica.succeeded()
            call.replica = replica
            return exchange.hand_over()
        except BaseException:
            replica.abandoned()
            raise
        finally:
            exchange.end()


class Exchange:
    """One attempt's request to a replica, from its start to its end: ended (the replica released, the
    connection closed) by :meth:`end` unless its response was handed over to the client."""

    __slots__ = ("replica", "attempt", "upstream")

    def __init__(self, replica: Upstream) -> None:
        self.replica = replica
        self.attempt = Attempt(trio.current_time())
        replica.begin(self.attempt, self.attempt.start)
        #: the replica's response, once its head came
        self.upstream: ClientResponse | None = None

    async def send(self, pool: ConnectionPool, call: Call, body: bytes) -> ClientResponse:
        """POST ``body`` to the replica at ``call``'s path; the response once its head came.

        :raises HttpClientError: it could not be sent or no head came (the gateway may end the attempt).
        """
        fields = call.fields_of(self.replica.name) if call.fields_of is not None else None
        body = request_body(body, fields, call.adapter, call.requested)
        self.upstream = await pool.send(
            "POST", self.replica.url + call.path, headers=request_headers(call), body=body, watch=self.attempt
        )
        self.replica.produced(trio.current_time())
        if self.attempt.why is not None:
            # the gateway ended the attempt (its replica left the routes, or stalled) as the head came,
            # before this task ran again: nothing went to the client, so it is retried elsewhere
            raise RemoteProtocolError(self.attempt.why, response_started=True)
        return self.upstream

    def hand_over(self) -> Relay:
        """The response goes to the client: it is the relay's to end now."""
        assert self.upstream is not None
        self.attempt.handed_over = True
        return Relay(self.replica, self.upstream, self.attempt)

    def end(self) -> None:
        """Called once the attempt is decided: release the replica, close the response, unless handed over."""
        if not self.attempt.handed_over:
            self.replica.end(self.attempt)
            if self.upstream is not None:
                self.upstream.close()


class Relay:
    """A response being passed through: ended once, by its body or by the exchange's end.

    The server closes the body iterator when it stops sending, but a body it
    never started (the client left first) runs no ``finally``: :meth:`after`
    catches that case.
    """

    __slots__ = ("replica", "upstream", "attempt", "finished")

    def __init__(self, replica: Upstream, upstream: ClientResponse, attempt: Attempt) -> None:
        self.replica = replica
        self.upstream = upstream
        self.attempt = attempt
        self.finished = False

    def finish(self) -> None:
        """Release the replica and the connection (back to the pool if the body was read whole)."""
        if not self.finished:
            self.finished = True
            self.replica.end(self.attempt)
            self.upstream.close()

    def after(self, then: Callable[[], object] | None) -> Callable[[], None]:
        """The response's ``after`` callback: :meth:`finish`, then ``then``."""

        def after() -> None:
            self.finish()
            if then is not None:
                then()

        return after


def turn_end(data: bytes, start: int) -> int:
    """Where the turn of an event stream's ``data`` that begins at ``start`` ends: after the last whole
    event within :data:`TURN_BYTES`, else (an event longer than that) :data:`TURN_BYTES` on.

    Called by the relay for each turn of a read longer than :data:`TURN_BYTES`.
    """
    end = start + TURN_BYTES
    boundary = data.rfind(b"\n\n", start, end)
    return boundary + 2 if boundary >= 0 else end


def request_headers(call: Call) -> list[tuple[str, str]]:
    """The headers of a request to a replica for ``call``."""
    return [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("x-request-id", call.request_id),
    ]


def _cause(attempt: Attempt, replica: Upstream, exc: HttpClientError) -> MigrationCause:
    """Why a stream's upstream broke, from who ended it and how."""
    if attempt.why is not None:  # the gateway ended it (StallWatch)
        return MigrationCause.STALLED if replica.suspect else MigrationCause.LEFT_ROUTES
    return MigrationCause.TIMEOUT if isinstance(exc, ReadTimeout) else MigrationCause.CLOSED


def sse_error(message: str) -> bytes:
    """The last event of a stream that ends on an error: OpenAI's error object."""
    error = {"message": message, "type": "server_error", "param": None, "code": "upstream_error"}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
