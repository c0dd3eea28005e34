"""The gateway's HTTP endpoints: the OpenAI-compatible API, ``/metrics`` and ``/health``.

- ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``: routed
  by the body's ``model`` (see :mod:`llmgw.gateway.proxy`); an ``X-Session-Id``
  header pins a session to one replica while it is available.
- ``GET /v1/models`` (models with at least one ready replica) and
  ``GET /v1/models/{id}``, in OpenAI's shapes.
- ``GET /metrics`` (Prometheus) and ``GET /health``, without a key. ``/health``
  is 200 ``ok`` only while the routes feed answers; 503 ``waiting for routes``
  before its first answer and ``degraded`` during a feed outage (the gateway
  still serves from its last routes meanwhile, and says since when).

Every request answered is one INFO line on the ``llmgw.gateway.access`` logger:
request id, endpoint, model, replica, status, time to first token, duration,
tokens, the API key's name (never the key) and the stream's migrations (times
it went on from another replica, :mod:`llmgw.gateway.migration`; the replica
named is the last), also as ``extra`` fields.

Every ``/v1`` request needs ``Authorization: Bearer <key>`` unless the
gateway runs without keys; a key is valid when its sha256 is in the routes
feed's ``keys``. A key with limits is admitted by :mod:`llmgw.gateway.admission`:
403 for a model it may not use, 429 with ``Retry-After`` over a rate or its
concurrency, the error naming the key and the limit. An admitted request then
waits for a seat in its model's queue (:mod:`llmgw.gateway.queue`, with
``--replica-concurrency``): 503 with ``Retry-After`` when the queue is full or
the wait too long, the error naming the flag.

Every error has OpenAI's shape, and every answer carries an ``X-Request-Id``
(the client's, or a new one; it is passed to the replica too); an answer from
a replica names it in ``X-Llmgw-Replica``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time

import trio

from llmgw.gateway.adapters import resolve
from llmgw.gateway.admission import Admission, Refused, Ticket
from llmgw.gateway.balancer import Balancer
from llmgw.gateway.errors import openai_error
from llmgw.gateway.metrics import NO_KEY, UNKNOWN_MODEL, GatewayMetrics
from llmgw.gateway.prefix import prefix_keys, prompt_text
from llmgw.gateway.proxy import Call, Proxy
from llmgw.gateway.queue import Queues, QueueSettings
from llmgw.gateway.routes import RoutesWatcher
from llmgw.net.server import InvalidJSON, ParsedRequest, Request, Response

__all__ = ["GatewayApp", "SESSION_HEADER", "INFERENCE_ENDPOINTS"]

log = logging.getLogger("llmgw.gateway")
access_log = logging.getLogger("llmgw.gateway.access")

#: the request header whose value pins a session to one replica
SESSION_HEADER = "x-session-id"
#: path -> the endpoint label of the requests the gateway forwards
INFERENCE_ENDPOINTS = {
    "/v1/chat/completions": "chat/completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
#: the longest a request of a rate-limited key waits for the server to lend its gateway a request
LEASE_WAIT = 1.0
_REQUEST_ID = re.compile(r"^[\w.:-]{1,128}$")
_NO_RESPONSE = Response(500)
_CREATE = "an operator creates one with `llmgw ctl keys create NAME`; `llmgw ctl keys list` lists them"
#: the 401 when no API key is in force, and the gateway saw one before (so every key was revoked)
_NO_KEYS_REVOKED = f"This gateway requires an API key and every one has been revoked ({_CREATE})."
#: the same from a gateway that never saw a key: none was created, or all were revoked before it started
_NO_KEYS = (
    f"This gateway requires an API key and none is in force: none has been created yet, or every one has "
    f"been revoked ({_CREATE})."
)


class GatewayApp:
    """The request handler of one gateway (an :class:`llmgw.net.server.HttpServer` handler)."""

    def __init__(
        self,
        proxy: Proxy,
        balancer: Balancer,
        metrics: GatewayMetrics,
        watcher: RoutesWatcher,
        *,
        require_keys: bool = True,
        admission: Admission | None = None,
        queues: Queues | None = None,
    ) -> None:
        self.proxy = proxy
        #: every model's seats and waiting requests (disabled unless --replica-concurrency)
        self.queues = queues if queues is not None else Queues(QueueSettings(), lambda _model: 0)
        #: limited keys' buckets; the gateway updates them from each routes table
        self.admission = admission if admission is not None else Admission(trio.current_time)
        self.balancer = balancer
        self.metrics = metrics
        self.watcher = watcher
        self.require_keys = require_keys
        self.created = int(time.time())
        self._request_prefix = secrets.token_hex(6)
        self._request_counter = 0
        #: the last key found valid, the routes table it was valid in (a new table checks again), its name
        self._accepted: tuple[str | None, object, str] = (None, None, NO_KEY)

    def precheck(self, head: ParsedRequest) -> Response | None:
        """Before the body of a ``/v1`` request is read: its refusal (no routes yet, no valid key), or None.

        Called by the HTTP server for requests with a body once their head is in; a refused
        body is never held, so anonymous clients cannot fill the gateway's memory.
        """
        if not head.target.startswith(b"/v1/"):
            return None
        authorization = next((value for name, value in head.headers if name == "authorization"), None)
        refusal = self._refusal_for(authorization)
        if refusal is None:
            return None
        start = trio.current_time()
        path = head.target.decode("latin-1").split("?", 1)[0]
        endpoint = INFERENCE_ENDPOINTS.get(path, path)
        request_id = self._next_request_id()

        def refused() -> None:
            seconds = trio.current_time() - start
            if path in INFERENCE_ENDPOINTS:
                self.metrics.request_done(UNKNOWN_MODEL, endpoint, refusal.status, seconds)
            _access(None, request_id, endpoint, UNKNOWN_MODEL, None, refusal.status, seconds, None)

        headers = (*refusal.headers, ("x-request-id", request_id))
        return Response(refusal.status, headers, refusal.body, after=refused)

    async def handle(self, request: Request) -> Response:
        """Answer one request."""
        path = request.path
        endpoint = INFERENCE_ENDPOINTS.get(path)
        if endpoint is not None:
            if request.method != "POST":
                return _not_allowed(request, "POST")
            return await self._inference(request, endpoint)
        if path == "/metrics" or path == "/health":
            if request.method not in ("GET", "HEAD"):
                return _not_allowed(request, "GET")
            return self._metrics(request) if path == "/metrics" else self._health()
        if path == "/v1/models" or path.startswith("/v1/models/"):
            if request.method not in ("GET", "HEAD"):
                return _not_allowed(request, "GET")
            refused = self._refusal(request)
            if refused is not None:
                return refused
            if path == "/v1/models":
                return self._models()
            return self._model(path.removeprefix("/v1/models/"))
        return openai_error(404, f"Invalid URL ({request.method} {path})")

    # -- inference -----------------------------------------------------------------------------

    async def _inference(self, request: Request, endpoint: str) -> Response:
        start = trio.current_time()
        request_id = request.header("x-request-id")
        if request_id is None or not _REQUEST_ID.match(request_id):
            request_id = self._next_request_id()
        response, label, call = self._admit(request, endpoint, request_id, start)
        key = self._key_of_refused(response.status) if call is None else call.key
        if call is not None and self.require_keys:
            admitted = await self._rate_admission(call.key, call.model)
            if isinstance(admitted, Refused):
                self.metrics.refused_by_limit(key, admitted.cause)
                response, call = _over_limit(admitted, call.model), None
            else:
                call.ticket = admitted
        if call is not None and self.queues.enabled:
            overflow = await self._seat(call)
            if overflow is not None:
                response, call = overflow, None
        if call is None:

            def refused() -> None:
                seconds = trio.current_time() - start
                self.metrics.request_done(label, endpoint, response.status, seconds)
                if key is not None:
                    self.metrics.by_key(key, label, response.status, None)
                _access(request.client, request_id, endpoint, label, None, response.status, seconds, key)

            headers = (*response.headers, ("x-request-id", request_id))
            return Response(response.status, headers, response.body, after=refused)
        answered: Response | None = None
        ticket = call.ticket
        leases = self.admission.leases if self.require_keys else None

        def done() -> None:
            nonlocal answered
            status = answered.status if answered is not None else 499
            answered = None  # the response holds this callback: no reference cycle left for the GC
            usage = call.charged_usage()
            if ticket is not None:
                ticket.done(usage)
            if usage is not None and leases is not None:
                leases.used(call.key, call.model, usage)
            if call.seated:
                self.queues.leave(call.model, call.key, sum(usage) if usage is not None else None)
            seconds = trio.current_time() - start
            self.metrics.request_done(label, endpoint, status, seconds)
            self.metrics.by_key(call.key, label, status, call.usage)
            _access(request.client, request_id, endpoint, label, call, status, seconds, call.key)

        call.after = done
        try:
            answered = await self.proxy.forward(call)
        except trio.Cancelled:  # the client left before the answer
            done()
            raise
        return answered

    async def _seat(self, call: Call) -> Response | None:
        """Wait in the model's queue (:mod:`llmgw.gateway.queue`) for a seat: None once seated, else the 503
        to answer (the key's admission is released then, and when the client leaves while waiting)."""
        start = trio.current_time()
        try:
            overflow = await self.queues.enter(call.model, call.key, self.admission.priority(call.key))
        except BaseException:
            if call.ticket is not None:
                call.ticket.done(None)
            raise
        waited = trio.current_time() - start
        if overflow is None:
            call.seated = True
            if waited > 0:
                self.metrics.queued(call.key, waited)
            return None
        if call.ticket is not None:
            call.ticket.done(None)
        self.metrics.queue_overflow(call.model, overflow.cause)
        retry = (("retry-after", str(overflow.retry_seconds())),)
        return openai_error(503, overflow.message(), param="model", code=overflow.cause, headers=retry)

    async def _rate_admission(self, key: str, model: str) -> Ticket | Refused | None:
        """The key's admission (:mod:`llmgw.gateway.admission`); a refusal the fleet may lift waits (up to
        :data:`LEASE_WAIT` seconds) for one exchange with the server, then asks once more."""
        admitted = self.admission.admit(key, model)
        leases = self.admission.leases
        if isinstance(admitted, Refused) and admitted.renewable and leases is not None:
            with trio.move_on_after(LEASE_WAIT):
                await leases.refresh(key)
            admitted = self.admission.admit(key, model, again=True)
        return admitted

    def _key_of_refused(self, status: int) -> str | None:
        """The key name of a request answered without a replica: None when its key did not pass."""
        if status == 401 or self.watcher.table is None:
            return None
        return self._accepted[2] if self.require_keys else NO_KEY

    def _next_request_id(self) -> str:
        self._request_counter += 1
        return f"req-{self._request_prefix}{self._request_counter:08x}"

    def _admit(
        self, request: Request, endpoint: str, request_id: str, start: float
    ) -> tuple[Response, str, Call | None]:
        """Check the key and the body: (an error, its model label, None) or (-, model, the call to make)."""
        refused = self._refusal(request)
        if refused is not None:
            return refused, UNKNOWN_MODEL, None
        table = self.watcher.table
        assert table is not None  # _refusal answers 503 until the first routes
        try:
            body = request.json()
        except InvalidJSON as exc:
            return openai_error(400, str(exc), code="invalid_json"), UNKNOWN_MODEL, None
        if not isinstance(body, dict):
            return openai_error(400, "the request body must be a JSON object"), UNKNOWN_MODEL, None
        model = body.get("model")
        if not isinstance(model, str) or not model:
            message = "you must provide a model parameter" if model is None else "'model' must be a string"
            return openai_error(400, message, param="model"), UNKNOWN_MODEL, None
        requested, adapter = model, None
        if model not in table.models and (named := resolve(table, model)) is not None:
            model, adapter = named
        if model not in table.models:
            message = f"The model `{model}` does not exist or you do not have access to it."
            return openai_error(404, message, param="model", code="model_not_found"), UNKNOWN_MODEL, None
        key = self._accepted[2] if self.require_keys else NO_KEY
        forbidden = self.admission.forbidden(key, model) if self.require_keys else None
        if forbidden is not None:
            self.metrics.refused_by_limit(key, forbidden.cause)
            return _over_limit(forbidden, model), model, None
        if not self._servable(model):
            return _not_ready(model), model, None
        call = Call(
            model=model,
            endpoint=endpoint,
            path=request.target,
            body=request.body,
            request_id=request_id,
            session=request.header(SESSION_HEADER) or None,
            start=start,
            key=key,
            adapter=adapter,
            requested=requested,
        )
        if self.balancer.routing == "prefix":
            call.prefix = prefix_keys(prompt_text(endpoint, body))
        if self.queues.enabled or (self.require_keys and self.admission.charges_tokens(key)):
            call.prompt_chars = len(prompt_text(endpoint, body))
        return _NO_RESPONSE, model, call

    # -- keys ----------------------------------------------------------------------------------

    def _refusal(self, request: Request) -> Response | None:
        """The error to answer instead of serving a /v1 request, or None to serve it."""
        return self._refusal_for(request.header("authorization"))

    def _refusal_for(self, authorization: str | None) -> Response | None:
        table = self.watcher.table
        if table is None:
            return openai_error(
                503,
                "the gateway has not received its routes from the server yet; retry shortly",
                code="gateway_starting",
                headers=(("retry-after", "1"),),
            )
        if not self.require_keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return openai_error(
                401,
                "You didn't provide an API key. You need to provide your API key in an Authorization "
                "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            )
        if not table.keys:
            return openai_error(
                401, _NO_KEYS_REVOKED if self.watcher.had_keys else _NO_KEYS, code="invalid_api_key"
            )
        if token == self._accepted[0] and table is self._accepted[1]:
            return None  # checked before the body was read (precheck), or by the request before
        name = table.keys.get(hashlib.sha256(token.encode()).hexdigest())
        if name is None:
            return openai_error(401, f"Incorrect API key provided: {_masked(token)}.", code="invalid_api_key")
        self._accepted = (token, table, name)
        return None

    # -- listing -------------------------------------------------------------------------------

    def _model_object(self, model: str, parent: str | None = None) -> dict:
        entry = {"id": model, "object": "model", "created": self.created, "owned_by": "llmgw"}
        if parent is not None:  # a LoRA adapter, as vLLM lists one
            entry.update(parent=parent, root=parent)
        return entry

    def _models(self) -> Response:
        """``GET /v1/models``: the servable models, and the LoRA adapters of each (with their ``parent``)."""
        table = self.watcher.table
        ready = sorted(m for m in table.models if self._servable(m)) if table is not None else []
        data = [self._model_object(m) for m in ready]
        if table is not None:
            servable = set(ready)
            adapters = sorted((e.model, name) for name, e in table.adapters.items() if e.model in servable)
            data += [self._model_object(name, parent) for parent, name in adapters]
        return Response.json(200, {"object": "list", "data": data})

    def _model(self, model: str) -> Response:
        table = self.watcher.table
        named = resolve(table, model) if table is not None and model not in table.models else None
        if named is not None and self._servable(named[0]):
            return Response.json(200, self._model_object(named[1], named[0]))
        if table is None or model not in table.models:
            message = f"The model `{model}` does not exist or you do not have access to it."
            return openai_error(404, message, param="model", code="model_not_found")
        if not self._servable(model):
            return _not_ready(model)
        return Response.json(200, self._model_object(model))

    def _servable(self, model: str) -> bool:
        """Whether a request for ``model`` can be served: a ready replica, or the model wakes on demand."""
        return bool(self.balancer.replicas(model)) or model in self.proxy.demand.wake_on_demand

    def _metrics(self, request: Request) -> Response:
        body, content_type = self.metrics.render(request.header("accept"))
        return Response(200, (("content-type", content_type),), body)

    def _health(self) -> Response:
        watcher = self.watcher
        table = watcher.table
        if table is None:
            status = "waiting for routes"
        else:
            status = "ok" if watcher.up else "degraded"
        payload: dict[str, object] = {
            "status": status,
            "routes_revision": table.revision if table is not None else None,
            "routes_feed_up": watcher.up,
            "routes_age_seconds": round(watcher.age(), 3),
            "server": watcher.server,
        }
        if status == "degraded":
            payload["problems"] = [
                f"the routes feed ({watcher.server}) has not answered for {watcher.age():.0f} s: "
                f"serving from routes revision {table.revision}"
            ]
        return Response.json(200 if status == "ok" else 503, payload)


def _access(
    peer: tuple[str, int] | None,
    request_id: str,
    endpoint: str,
    model: str,
    call: Call | None,
    status: int,
    seconds: float,
    key: str | None,
) -> None:
    """Log one request's access line (``llmgw.gateway.access``), with its fields as ``extra``."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    replica = call.replica.name if call is not None and call.replica is not None else None
    ttft = call.ttft if call is not None else None
    usage = call.usage if call is not None else None
    client = peer[0] if peer else None
    fields = {
        "request_id": request_id,
        "client": client,
        "endpoint": endpoint,
        "model": model,
        "replica": replica,
        "status": status,
        "ttft": round(ttft, 4) if ttft is not None else None,
        "duration": round(seconds, 4),
        "prompt_tokens": usage[0] if usage is not None else None,
        "completion_tokens": usage[1] if usage is not None else None,
        "key_name": key,
        "migrations": call.migrations if call is not None else 0,
        "migration_gap": round(call.migration_gap, 4) if call is not None and call.migration_gap else None,
    }
    access_log.info(
        "%s %s %s model=%s replica=%s status=%d ttft=%s duration=%.3fs tokens=%s key=%s migrations=%d",
        request_id,
        client or "-",
        endpoint,
        model,
        replica or "-",
        status,
        f"{ttft:.3f}s" if ttft is not None else "-",
        seconds,
        f"{usage[0]}+{usage[1]}" if usage is not None else "-",
        key or "-",
        fields["migrations"],
        extra=fields,
    )


def _not_ready(model: str) -> Response:
    return openai_error(
        503,
        f"The model `{model}` has no ready replica right now; retry later.",
        param="model",
        code="model_not_ready",
        headers=(("retry-after", "5"),),
    )


def _over_limit(refused: Refused, model: str) -> Response:
    """403 for a model the key may not use; 429 with ``Retry-After`` over a rate or its concurrency."""
    code = f"{refused.cause}_limit"
    if refused.status == 403:
        return openai_error(403, refused.message(model), type="permission_error", param="model", code=code)
    retry = (("retry-after", str(refused.retry_seconds())),)
    return openai_error(429, refused.message(model), type="rate_limit_exceeded", code=code, headers=retry)


def _not_allowed(request: Request, allowed: str) -> Response:
    response = openai_error(405, f"Method {request.method} not allowed for {request.path}; use {allowed}")
    return Response(response.status, (*response.headers, ("allow", allowed)), response.body)


def _masked(token: str) -> str:
    if len(token) < 12:
        return "*" * len(token)
    return f"{token[:3]}{'*' * 8}{token[-4:]}"
