"""``llmgw gateway``: the OpenAI-compatible front door, as a command."""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path

import attrs
import click

from llmgw.cli import Command, serve_until_signalled
from llmgw.errors import LlmgwError
from llmgw.gateway.balancer import ROUTING_POLICIES
from llmgw.gateway.main import Gateway, GatewayConfig
from llmgw.gateway.proxy import ProxySettings
from llmgw.gateway.queue import QueueSettings
from llmgw.gateway.workers import run_workers
from llmgw.net.server import Limits, parse_listen
from llmgw.settings import LogSettings, setting, settings_options

__all__ = ["GatewaySettings", "gateway_command"]

log = logging.getLogger("llmgw.gateway")


@attrs.frozen(kw_only=True)
class GatewaySettings(LogSettings):
    """Everything ``llmgw gateway`` is started with: each field a flag, a key of ``--config``, a line of
    ``--show-config``."""

    server: str = setting(
        env="LLMGW_SERVER",
        help="The control plane's URL, https://HOST:7443, or several comma-separated; routes are read from "
        "it (from the leader, moving on when one fails).",
    )
    ca: Path | None = setting(None, help="The CA certificate the server's certificate must chain to.")
    cert: Path | None = setting(
        None, help="A gateway (or admin) certificate, to read routes (llmgw ca issue-gateway)."
    )
    key: Path | None = setting(None, help="That certificate's key.")
    listen: str = setting("0.0.0.0:8080", help="HOST:PORT to serve clients on.")
    no_keys: bool = setting(
        False, help="Serve without API keys: anyone who can reach the gateway may use every model (logged)."
    )
    max_attempts: int = setting(
        3,
        min=1,
        max=10,
        help="Attempts per request, each on another replica, while nothing has gone to the client.",
    )
    retry_backoff: float = setting(
        0.025, min=0, help="Seconds; the wait before attempt n is random in [0, this * 2^(n-2)]."
    )
    breaker_failures: int = setting(3, min=1, help="Consecutive failures that take a replica out.")
    breaker_open_seconds: float = setting(
        5.0, min=0, help="How long a replica stays out before one probe request may bring it back."
    )
    connect_timeout: float = setting(
        2.0, min=0, min_open=True, help="Seconds to connect to a replica (a failure is retried elsewhere)."
    )
    upstream_timeout: float = setting(
        600.0,
        min=0,
        min_open=True,
        help="Seconds to wait for any data from a replica: its answer, or the next piece of a stream.",
    )
    stall_timeout: float = setting(
        10.0,
        min=0,
        min_open=True,
        help="Seconds: a replica with requests in flight that had been answering and then sends nothing "
        "this long (and does not answer GET /health within 1 s) is taken out like an open breaker, "
        "reported to the server, and its requests that sent nothing to their clients go elsewhere.",
    )
    migration_limit: int = setting(
        3,
        min=0,
        max=10,
        help="Times a stream broken mid-way (its replica died, stalled or left) goes on from another "
        "replica, in the same response, from the text the client already has; 0: it ends with an error "
        "event.",
    )
    hold_timeout: float = setting(
        300.0,
        min=0,
        min_open=True,
        help="Seconds a request for a model at zero replicas (catalog replicas.min: 0) waits for a replica "
        "to wake; past it, 503 with Retry-After.",
    )
    hold_queue: int = setting(
        256, min=1, help="Requests held at once per model at zero replicas; more are answered 503 at once."
    )
    replica_concurrency: int = setting(
        0,
        min=0,
        help="Requests this gateway process sends one replica at once (its seats; with --workers or several "
        "gateways, the engine's seats divided by the processes); more wait in the model's queue, critical "
        "before standard before batch keys, and within a class by fair share of tokens among keys. "
        "0: no queue, every request goes at once.",
    )
    queue_size: int = setting(
        1024, min=1, help="Requests waiting per model for a seat (--replica-concurrency); more get 503."
    )
    queue_timeout: float = setting(
        30.0,
        min=0,
        min_open=True,
        help="Seconds a request may wait in its model's queue for a seat; past it, 503 with Retry-After.",
    )
    max_body_bytes: int = setting(
        32 * 1024 * 1024, min=1, help="Largest request body accepted (larger: 413)."
    )
    max_buffered_bytes: int = setting(
        128 * 1024 * 1024,
        min=1,
        help="Request body bytes held at once across every client connection (per --workers process); a "
        "request that would go past it gets 503 (retry), or 413 when it alone is larger. Bodies are read "
        "only after the API key passed.",
    )
    routing: str = setting(
        "prefix",
        choices=ROUTING_POLICIES,
        help="How a replica is chosen for a request without X-Session-Id: the fewest requests in flight, "
        "the one sent the same prompt beginning before (prefix caches), or at random.",
    )
    prefix_load_factor: float = setting(
        1.5,
        min=1,
        help="With --routing prefix: a replica over this times the mean requests in flight is passed over.",
    )
    workers: int = setting(
        1,
        min=1,
        max=64,
        help="Gateway processes sharing the --listen port (SO_REUSEPORT); /metrics sums their counters.",
    )
    shutdown_grace: float = setting(
        30.0, min=0, help="On SIGTERM/SIGINT, seconds requests in flight may take to finish."
    )

    def gateway_config(self) -> GatewayConfig:
        """The :class:`GatewayConfig` a gateway process runs with (its names are the proxy's own)."""
        host, port = parse_listen(self.listen, "--listen")
        return GatewayConfig(
            server=self.server,
            ca=self.ca,
            cert=self.cert,
            key=self.key,
            host=host,
            port=port,
            require_keys=not self.no_keys,
            proxy=ProxySettings(
                max_attempts=self.max_attempts,
                retry_backoff=self.retry_backoff,
                read_timeout=self.upstream_timeout,
                stall_timeout=self.stall_timeout,
                hold_timeout=self.hold_timeout,
                hold_queue=self.hold_queue,
                migration_limit=self.migration_limit,
            ),
            breaker_failures=self.breaker_failures,
            breaker_open_for=self.breaker_open_seconds,
            connect_timeout=self.connect_timeout,
            limits=Limits(
                max_body_bytes=self.max_body_bytes,
                max_buffered_bytes=self.max_buffered_bytes,
                idle_timeout=60.0,
            ),
            routing=self.routing,
            prefix_load_factor=self.prefix_load_factor,
            queue=QueueSettings(self.replica_concurrency, self.queue_size, self.queue_timeout),
        )


@click.command("gateway", cls=Command)
@settings_options(GatewaySettings)
def gateway_command(settings: GatewaySettings) -> None:
    """Serve the OpenAI-compatible API in front of every ready replica.

    Routes POST /v1/chat/completions, /v1/completions and /v1/embeddings by
    the body's "model" to one of its ready replicas (GET /v1/models lists the
    models with a ready replica). Clients send "Authorization: Bearer KEY"
    (keys: llmgw ctl keys create NAME).

    Which replica (--routing): "prefix", the default, sends a prompt to the
    replica that was sent the longest known beginning of it (a conversation's
    earlier turns, a shared system prompt), where the engine's prefix cache
    skips most of the prefill, unless that replica has more than
    --prefix-load-factor times the mean requests in flight; new prompts go to
    a replica at or under the mean load. "least-outstanding" picks the
    replica with fewer requests in flight of two drawn at random.

    Session affinity: send the header "X-Session-Id: ANY-STRING" and every
    request of that session goes to the same replica while it is ready,
    whatever --routing says.

    Faults: a replica that stops sending while requests wait on it
    (--stall-timeout) is taken out as an open breaker would be and reported
    to the server; its requests that sent nothing to their clients go to
    another replica, as do those on a replica that leaves the routes. A
    stream that breaks mid-way (its replica died, stalled or left) goes on
    from another replica in the same response, from the text the client has
    (--migration-limit times at most). The API key is checked before a body
    is read.

    --workers N runs N gateway processes on the one port; /metrics on any of
    them sums the counters of all. Prometheus metrics on GET /metrics;
    GET /health for load balancers. Several gateways may run against one server.
    """

    config = settings.gateway_config()
    if settings.workers == 1:
        _serve(config, settings.shutdown_grace)
        return
    if config.port == 0:
        raise LlmgwError(
            f"--workers {settings.workers} needs a fixed port in --listen (got {settings.listen!r})"
        )
    shared = attrs.evolve(config, reuse_port=True)
    sys.exit(run_workers(settings.workers, lambda _index: _serve(shared, settings.shutdown_grace)))


def _serve(config: GatewayConfig, shutdown_grace: float) -> None:
    gateway = Gateway(config)
    # What the process holds from here on (modules, classes, settings) is never garbage: out of every
    # collection. A full collection then reads only what requests made, a few ms instead of the 20-400 ms
    # (loaded machine) that held every stream in flight.
    gc.freeze()
    serve_until_signalled(
        gateway.serve,
        log=log,
        stop=lambda: gateway.shutdown(shutdown_grace),
        stopping="shutting down",
        stopping_again="stopping now",
    )
