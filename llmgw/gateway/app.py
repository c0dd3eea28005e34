"""The gateway's HTTP endpoints: the OpenAI-compatible API, ``/metrics`` and ``/health``.

- ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``: routed
  by the body's ``model`` (see :mod:`llmgw.gateway.proxy`); an ``X-Session-Id``
  header pins a session to one replica while it is available.
- ``GET /v1/models`` (models with at least one ready replica) and
  ``GET /v1/models/{id}``, in OpenAI's shapes.
- ``GET /metrics`` (Prometheus) and ``GET /health``, without a key.

Every ``/v1`` request needs ``Authorization: Bearer <key>`` unless the
gateway runs without keys; a key is valid when its sha256 is in the routes
feed's ``keys``. Every error has OpenAI's shape, and every answer carries an
``X-Request-Id`` (the client's, or a new one; it is passed to the replica
too); an answer from a replica names it in ``X-Llmgw-Replica``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time

import trio

from llmgw.gateway.balancer import Balancer
from llmgw.gateway.errors import openai_error
from llmgw.gateway.metrics import UNKNOWN_MODEL, GatewayMetrics
from llmgw.gateway.prefix import prefix_keys, prompt_text
from llmgw.gateway.proxy import Call, Proxy
from llmgw.gateway.routes import RoutesWatcher
from llmgw.net.server import InvalidJSON, ParsedRequest, Request, Response

__all__ = ["GatewayApp", "SESSION_HEADER", "INFERENCE_ENDPOINTS"]

log = logging.getLogger("llmgw.gateway")

#: the request header whose value pins a session to one replica
SESSION_HEADER = "x-session-id"
#: path -> the endpoint label of the requests the gateway forwards
INFERENCE_ENDPOINTS = {
    "/v1/chat/completions": "chat/completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
_REQUEST_ID = re.compile(r"^[\w.:-]{1,128}$")
_NO_RESPONSE = Response(500)


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
    ) -> None:
        self.proxy = proxy
        self.balancer = balancer
        self.metrics = metrics
        self.watcher = watcher
        self.require_keys = require_keys
        self.created = int(time.time())
        self._request_prefix = secrets.token_hex(6)
        self._request_counter = 0
        #: the last key found valid, and the routes table it was valid in (a new table checks again)
        self._accepted: tuple[str | None, object] = (None, None)

    def precheck(self, head: ParsedRequest) -> Response | None:
        """Before the body of a ``/v1`` request is read: its refusal (no routes yet, no valid key), or None.

        Called by the HTTP server for requests with a body once their head is in; a refused
        body is never held, so anonymous clients cannot fill the gateway's memory.
        """
        if not head.target.startswith(b"/v1/"):
            return None
        authorization = next((value for name, value in head.headers if name == "authorization"), None)
        return self._refusal_for(authorization)

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
        if call is None:

            def refused() -> None:
                self.metrics.request_done(label, endpoint, response.status, trio.current_time() - start)

            headers = (*response.headers, ("x-request-id", request_id))
            return Response(response.status, headers, response.body, after=refused)
        answered: Response | None = None

        def done() -> None:
            nonlocal answered
            status = answered.status if answered is not None else 499
            answered = None  # the response holds this callback: no reference cycle left for the GC
            self.metrics.request_done(label, endpoint, status, trio.current_time() - start)

        call.after = done
        try:
            answered = await self.proxy.forward(call)
        except trio.Cancelled:  # the client left before the answer
            done()
            raise
        return answered

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
        if model not in table.models:
            message = f"The model `{model}` does not exist or you do not have access to it."
            return openai_error(404, message, param="model", code="model_not_found"), UNKNOWN_MODEL, None
        if not self.balancer.replicas(model):
            return _not_ready(model), model, None
        call = Call(
            model=model,
            endpoint=endpoint,
            path=request.target,
            body=request.body,
            request_id=request_id,
            session=request.header(SESSION_HEADER) or None,
            start=start,
        )
        if self.balancer.routing == "prefix":
            call.prefix = prefix_keys(prompt_text(endpoint, body))
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
                401,
                "This gateway requires an API key and none has been created yet "
                "(an operator creates one with `llmgw ctl keys create NAME`).",
                code="invalid_api_key",
            )
        if token == self._accepted[0] and table is self._accepted[1]:
            return None  # checked before the body was read (precheck), or by the request before
        if hashlib.sha256(token.encode()).hexdigest() not in table.keys:
            return openai_error(401, f"Incorrect API key provided: {_masked(token)}.", code="invalid_api_key")
        self._accepted = (token, table)
        return None

    # -- listing -------------------------------------------------------------------------------

    def _model_object(self, model: str) -> dict:
        return {"id": model, "object": "model", "created": self.created, "owned_by": "llmgw"}

    def _models(self) -> Response:
        table = self.watcher.table
        ready = sorted(m for m in table.models if self.balancer.replicas(m)) if table is not None else []
        return Response.json(200, {"object": "list", "data": [self._model_object(m) for m in ready]})

    def _model(self, model: str) -> Response:
        table = self.watcher.table
        if table is None or model not in table.models:
            message = f"The model `{model}` does not exist or you do not have access to it."
            return openai_error(404, message, param="model", code="model_not_found")
        if not self.balancer.replicas(model):
            return _not_ready(model)
        return Response.json(200, self._model_object(model))

    def _metrics(self, request: Request) -> Response:
        body, content_type = self.metrics.render(request.header("accept"))
        return Response(200, (("content-type", content_type),), body)

    def _health(self) -> Response:
        watcher = self.watcher
        table = watcher.table
        payload = {
            "status": "ok" if table is not None else "waiting for routes",
            "routes_revision": table.revision if table is not None else None,
            "routes_feed_up": watcher.up,
            "routes_age_seconds": round(watcher.age(), 3),
        }
        return Response.json(200 if table is not None else 503, payload)


def _not_ready(model: str) -> Response:
    return openai_error(
        503,
        f"The model `{model}` has no ready replica right now; retry later.",
        param="model",
        code="model_not_ready",
        headers=(("retry-after", "5"),),
    )


def _not_allowed(request: Request, allowed: str) -> Response:
    response = openai_error(405, f"Method {request.method} not allowed for {request.path}; use {allowed}")
    return Response(response.status, (*response.headers, ("allow", allowed)), response.body)


def _masked(token: str) -> str:
    if len(token) < 12:
        return "*" * len(token)
    return f"{token[:3]}{'*' * 8}{token[-4:]}"
