"""Forwarding one inference request to a replica, retrying on another while nothing has gone out.

An attempt fails when the connection cannot be made or breaks before the
response is whole in hand, when no answer comes within the read timeout, or
when the replica answers 502 or 503. A failed attempt counts against the
replica's breaker and, up to ``max_attempts`` in all, the request goes to a
replica it has not tried yet, after a jittered backoff (uniform between 0 and
``retry_backoff * 2**(attempt - 2)`` seconds).

What "nothing has gone out" means depends on the response:

- a JSON answer with a ``Content-Length`` up to ``buffer_limit`` is read whole
  before the client gets its first byte, so even a replica dying mid-body
  leaves the request free to go elsewhere;
- a server-sent-events stream is passed through event by event as the
  engine writes it (the first chunk marks time to first token). Once bytes
  went out there is no retry of the whole request: if the replica breaks the
  stream, it goes on from another replica, in the same response, from the
  text the client received (mid-stream migration, :mod:`llmgw.gateway.migration`,
  up to ``migration_limit`` times); a stream that cannot go on gets a last
  ``data: {"error": {...}}`` event and a properly ended response. While a
  stream may be continued, only whole events go out (a partial one waits for
  its end), so that what the client has is exactly what the transcript says;
- any other body is passed through as well; if it breaks, the client's
  connection is closed without ending the body, the only honest signal left.

An attempt the gateway ends (its replica stalled or left the routes, see
:mod:`llmgw.gateway.stalls`) before anything went to the client is a failed
attempt too, retried elsewhere. A client that gives up on an attempt that has
waited ``stall_timeout`` with nothing back counts as a failure of the replica.
Error messages name replicas by id, never by address.
"""

from __future__ import annotations

import logging
import random
from functools import partial

import attrs
import trio

from llmgw.gateway.balancer import Balancer, Upstream
from llmgw.gateway.call import Call
from llmgw.gateway.demand import Demand
from llmgw.gateway.errors import openai_error
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.relay import Exchange, Relaying
from llmgw.gateway.stalls import Attempt
from llmgw.gateway.usage import read_usage
from llmgw.net.client import ClientResponse, ConnectError, ConnectionPool, HttpClientError, ReadTimeout
from llmgw.net.server import Response

__all__ = ["ProxySettings", "Call", "Proxy"]

log = logging.getLogger("llmgw.gateway")

#: replica statuses that mean "try another replica"
RETRY_STATUSES = frozenset({502, 503})
#: response headers passed from the replica to the client
_PASSED_HEADERS = frozenset({"content-type", "retry-after"})
_ERROR_BODY_LIMIT = 64 * 1024


@attrs.frozen
class ProxySettings:
    """How the gateway treats its upstreams. Times are in seconds."""

    #: attempts per request, each on a different replica
    max_attempts: int = 3
    #: the backoff before attempt n is uniform in [0, retry_backoff * 2**(n-2)]
    retry_backoff: float = 0.025
    #: longest wait for any data from a replica: the response head, or the next chunk of its body
    #: (applied by the gateway's connection pool)
    read_timeout: float = 600.0
    #: non-streamed bodies up to this size are read whole before the client gets a byte
    buffer_limit: int = 8 * 1024 * 1024
    #: a replica with requests in flight that sends nothing for this long is stalled
    #: (:mod:`llmgw.gateway.stalls`); a client that gives up on a replica silent this long fails it
    stall_timeout: float = 10.0
    #: seconds a request for a model at zero replicas waits for one (:mod:`llmgw.gateway.demand`)
    hold_timeout: float = 300.0
    #: requests held at once per model at zero replicas; more are answered 503
    hold_queue: int = 256
    #: continuations on another replica per streamed request broken mid-way (0: none, the stream ends
    #: with an error event)
    migration_limit: int = 3


class Proxy(Relaying):
    """Sends calls to replicas chosen by the balancer, through one connection pool."""

    def __init__(
        self, pool: ConnectionPool, balancer: Balancer, metrics: GatewayMetrics, settings: ProxySettings
    ) -> None:
        self.pool = pool
        self.balancer = balancer
        self.metrics = metrics
        self.settings = settings
        self.migration_limit = settings.migration_limit
        #: the models that wake on demand: their requests counted, held while they have no replica
        self.demand = Demand(settings.hold_timeout, settings.hold_queue)

    async def forward(self, call: Call) -> Response:
        """Answer ``call`` with a replica's response, or an OpenAI-shaped error when every attempt failed.

        A request for a model that wakes on demand and has no replica is held first (see
        :meth:`~llmgw.gateway.demand.Demand.hold`): 503 with ``Retry-After`` when it cannot wait. A request
        for a LoRA adapter then waits for a replica with it loaded (:meth:`_forward_adapter`).
        """
        model = call.model
        demand = self.demand
        if call.adapter is None:  # the base model: some replicas' engines want fields of their own
            call.fields_of = self.balancer.base_fields
        forward = self._forward if call.adapter is None else self._forward_adapter
        if model not in demand.wake_on_demand:
            return await forward(call)
        demand.began(model)
        try:
            if not self.balancer.replicas(model):
                why = await demand.hold(model, lambda: bool(self.balancer.replicas(model)))
                if why is not None:
                    wait = max(1, round(min(30.0, self.settings.hold_timeout / 4)))
                    error = openai_error(503, why, code="model_waking", headers=(("retry-after", str(wait)),))
                    response = Response(
                        error.status,
                        (*error.headers, ("x-request-id", call.request_id)),
                        error.body,
                        call.after,
                    )
                else:
                    response = await forward(call)
            else:
                response = await forward(call)
        except BaseException:
            demand.ended(model)
            raise
        after = response.after

        def ended() -> None:
            demand.ended(model)
            if after is not None:
                after()

        return attrs.evolve(response, after=ended)

    async def _forward_adapter(self, call: Call) -> Response:
        """Answer a request for a LoRA adapter: among the replicas that have it loaded, or once one has
        (held meanwhile, :meth:`~llmgw.gateway.adapters.AdapterDemand.hold`); an OpenAI-shaped error naming
        the adapter and why when its load failed or the hold ended."""
        adapter = call.adapter
        assert adapter is not None
        call.fields_of = partial(self.balancer.adapter_fields, adapter)
        adapters = self.demand.adapters
        if self.balancer.replicas(adapter):
            adapters.hit(call.model, adapter)
            self.metrics.adapter_request(call.model, "hit")
            response = await self._forward(call)
            if not call.adapter_gone or response.status < 500:
                return _adapter_said(response, "hit")
        self.metrics.adapter_request(call.model, "miss")

        def routed() -> bool:  # a replica with the adapter, other than one that said it had none
            return any(r.name not in call.adapter_gone for r in self.balancer.replicas(adapter))

        why, failure = await adapters.hold(call.model, adapter, routed)
        if not why:
            return _adapter_said(await self._forward(call), "miss")
        if failure is not None:
            error = openai_error(503, why, param="model", code=f"adapter_{failure.cause.value}")
        else:
            wait = max(1, round(min(30.0, self.settings.hold_timeout / 4)))
            error = openai_error(503, why, code="adapter_loading", headers=(("retry-after", str(wait)),))
        headers = (*error.headers, ("x-request-id", call.request_id))
        return Response(error.status, headers, error.body, call.after)

    async def _forward(self, call: Call) -> Response:
        tried: list[Upstream] = []
        failure: Response | None = None
        reasons: list[str] = []
        for attempt in range(1, self.settings.max_attempts + 1):
            if attempt > 1:
                await trio.sleep(random.uniform(0, self.settings.retry_backoff * 2 ** (attempt - 2)))
            replica = self.balancer.choose(
                call.routed_as, trio.current_time(), session=call.session, prefix=call.prefix, exclude=tried
            )
            if replica is None:
                break
            if attempt > 1:
                self.metrics.retry(call.model)
            tried.append(replica)
            outcome = await self._attempt(call, replica)
            if isinstance(outcome, Response):
                return outcome
            reason, failure = outcome
            reasons.append(f"{replica.name}: {reason}")
        if failure is not None:
            return failure
        if reasons:
            message = f"no replica of model `{call.model}` could answer: " + "; ".join(reasons)
            error = openai_error(502, message, code="upstream_error")
        else:
            wait = self.balancer.retry_after(call.routed_as, trio.current_time())
            error = openai_error(
                503,
                f"every replica of model `{call.model}` is failing and taken out for a while; retry later",
                code="model_unavailable",
                headers=(("retry-after", str(max(1, round(wait + 0.5)))),),
            )
        headers = (*error.headers, ("x-request-id", call.request_id))
        return Response(error.status, headers, error.body, call.after)

    async def _attempt(self, call: Call, replica: Upstream) -> Response | tuple[str, Response | None]:
        """One attempt: the client's response, or (why it failed, the replica's error response if any)."""
        exchange = Exchange(replica)
        attempt = exchange.attempt
        try:
            try:
                upstream = await exchange.send(self.pool, call, call.body)
                status = upstream.status
                if status in RETRY_STATUSES:
                    body = await upstream.read(_ERROR_BODY_LIMIT)
                    answer = Response(status, _headers(upstream, None, call), body, call.after)
                    return self._failed(replica, f"status_{status}", f"answered {status}", answer)
                if status == 404 and call.adapter is not None:
                    # unloaded there before this gateway's routes said so: not the replica's failure
                    await upstream.read(_ERROR_BODY_LIMIT)
                    call.adapter_gone.append(replica.name)
                    return f"{replica.name}: adapter `{call.adapter}` is not loaded there (any more)", None
                replica.succeeded()
                call.replica = replica
                content_type = upstream.header("content-type") or ""
                if content_type.startswith("text/event-stream"):
                    sse = True
                else:
                    sse = False
                    length = upstream.header("content-length")
                    if length is not None and length.isdigit() and int(length) <= self.settings.buffer_limit:
                        body = await upstream.read()
                        replica.last_byte = trio.current_time()
                        call.usage = read_usage(body)
                        return Response(status, _headers(upstream, replica, call), body, call.after)
                headers_out = _headers(upstream, replica, call)
                if sse:
                    headers_out += (("cache-control", "no-cache"),)
                relay = exchange.hand_over()
                body_out = self._relay(call, relay, sse)
                return Response(status, headers_out, body_out, relay.after(call.after))
            except HttpClientError as exc:
                if attempt.why is not None:  # the gateway ended it (StallWatch): it sent nothing yet
                    call.replica = None
                    kind = "stalled" if replica.suspect else "left_routes"
                    return self._failed(replica, kind, attempt.why, None)
                if isinstance(exc, ConnectError):
                    return self._failed(replica, "connect", str(exc), None)
                if isinstance(exc, ReadTimeout):
                    return self._failed(replica, "timeout", str(exc), None)
                return self._failed(replica, "closed", str(exc), None)
        except BaseException:
            self._client_left(replica, attempt)
            raise
        finally:
            exchange.end()

    def _client_left(self, replica: Upstream, attempt: Attempt) -> None:
        """The client gave up before its answer: a failure if the replica sent nothing for the stall time."""
        waited = trio.current_time() - attempt.start
        if waited >= self.settings.stall_timeout and replica.last_byte < attempt.start:
            why = f"the client gave up after {waited:.1f} s with no answer"
            self._failed(replica, "client_gave_up", why, None)
        else:
            replica.abandoned()

    def _failed(
        self, replica: Upstream, kind: str, reason: str, response: Response | None
    ) -> tuple[str, Response | None]:
        replica.failed(trio.current_time(), reason)
        self.metrics.upstream_error(replica.name, kind)
        log.info("attempt on replica %s (%s) failed: %s", replica.name, replica.url, reason)
        return _named(reason, replica), response


def _adapter_said(response: Response, outcome: str) -> Response:
    """``response`` saying in ``X-Llmgw-Adapter`` whether its adapter was loaded (hit) or waited (miss)."""
    return attrs.evolve(response, headers=(*response.headers, ("x-llmgw-adapter", outcome)))


def _headers(upstream: ClientResponse, replica: Upstream | None, call: Call) -> tuple[tuple[str, str], ...]:
    passed = tuple((name, value) for name, value in upstream.headers if name in _PASSED_HEADERS)
    if replica is not None:
        return (*passed, ("x-request-id", call.request_id), ("x-llmgw-replica", replica.name))
    if upstream.status == 503 and upstream.header("retry-after") is None:
        passed += (("retry-after", "1"),)
    return (*passed, ("x-request-id", call.request_id))


def _named(reason: str, replica: Upstream) -> str:
    """``reason`` with the replica's address replaced by its id: clients see ids, never addresses."""
    url = replica.url
    if url in reason:
        reason = reason.replace(url, f"replica {replica.name}")
    origin = url.split("/", 3)
    origin = "/".join(origin[:3])
    if origin in reason:
        reason = reason.replace(origin, f"replica {replica.name}")
    host = origin.split("//", 1)[-1]
    return reason.replace(host, replica.name) if host in reason else reason
