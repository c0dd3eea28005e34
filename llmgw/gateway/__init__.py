"""The OpenAI-compatible gateway: one front door to every ready replica of every model.

``llmgw gateway`` learns the ready replicas of each model from the server's
routes feed (long-poll, :mod:`llmgw.gateway.routes`), and forwards
``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` by
the body's ``model`` (:mod:`llmgw.gateway.app`, :mod:`llmgw.gateway.proxy`).
It keeps no state the server or another gateway needs: run as many as you like.

Routing (:mod:`llmgw.gateway.balancer`): by default a prompt goes to the
replica that was sent the longest known beginning of it, so the engine's
prefix cache skips most of its prefill, within a bound on that replica's load
(:mod:`llmgw.gateway.prefix`); or least outstanding requests among a model's
ready replicas (power of two choices). ``--workers N`` runs N gateway
processes on one port (:mod:`llmgw.gateway.workers`). **Session affinity:** a client
that sends ``X-Session-Id: <any string>`` has every request of that session
sent to the same replica while that replica is ready and not failing
(rendezvous hashing), so multi-turn conversations reuse the engine's prefix
cache; when it leaves, only its sessions move.

Failures: a connection that fails, or a 502/503 answer, before any byte went
to the client, is retried on another replica (``max_attempts`` in all,
jittered backoff); a replica failing repeatedly is taken out for a while by a
circuit breaker and probed back with one request. A stream already under way
when its replica dies ends with an OpenAI-shaped ``data: {"error": ...}`` event.

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``):
401 without a valid ``Authorization: Bearer`` key (unless ``--no-keys``), 404
for a model the catalog does not have, 503 with ``Retry-After`` for a model
with no ready replica; for a key with limits (``ctl keys create --rpm ...``),
403 for a model it may not use and 429 with ``Retry-After`` over a rate or its
concurrency (:mod:`llmgw.gateway.admission`), rates held for the whole fleet
by leases from the server (:mod:`llmgw.gateway.leases`). ``GET /metrics`` is Prometheus text, ``GET /health``
says whether routes have arrived.
"""

from llmgw.gateway.main import Gateway, GatewayConfig, GatewayError, serve_gateway
from llmgw.gateway.proxy import ProxySettings

__all__ = ["Gateway", "GatewayConfig", "GatewayError", "ProxySettings", "serve_gateway"]
