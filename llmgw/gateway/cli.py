"""``llmgw gateway``: the OpenAI-compatible front door, as a command."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import attrs
import click

from llmgw.cli import Command, serve_until_signalled
from llmgw.configfile import config_options
from llmgw.errors import LlmgwError
from llmgw.gateway.balancer import ROUTING_POLICIES
from llmgw.gateway.main import Gateway, GatewayConfig
from llmgw.gateway.proxy import ProxySettings
from llmgw.gateway.workers import run_workers
from llmgw.net.server import Limits, parse_listen

__all__ = ["gateway_command"]

log = logging.getLogger("llmgw.gateway")

_FILE = click.Path(dir_okay=False, path_type=Path)


@click.command("gateway", cls=Command)
@config_options
@click.option(
    "--server",
    envvar="LLMGW_SERVER",
    required=True,
    help="The control plane's URL, https://HOST:7443, or several comma-separated (env LLMGW_SERVER); "
    "routes are read from it (from the leader, moving on when one fails).",
)
@click.option("--ca", type=_FILE, help="The CA certificate the server's certificate must chain to.")
@click.option(
    "--cert", type=_FILE, help="A gateway (or admin) certificate, to read routes (llmgw ca issue-gateway)."
)
@click.option("--key", type=_FILE, help="That certificate's key.")
@click.option("--listen", default="0.0.0.0:8080", show_default=True, help="HOST:PORT to serve clients on.")
@click.option(
    "--no-keys",
    is_flag=True,
    help="Serve without API keys: anyone who can reach the gateway may use every model (logged).",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(1, 10),
    default=3,
    show_default=True,
    help="Attempts per request, each on another replica, while nothing has gone to the client.",
)
@click.option(
    "--retry-backoff",
    type=click.FloatRange(0),
    default=0.025,
    show_default=True,
    help="Seconds; the wait before attempt n is random in [0, this * 2^(n-2)].",
)
@click.option(
    "--breaker-failures",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Consecutive failures that take a replica out.",
)
@click.option(
    "--breaker-open-seconds",
    type=click.FloatRange(0),
    default=5.0,
    show_default=True,
    help="How long a replica stays out before one probe request may bring it back.",
)
@click.option(
    "--connect-timeout",
    type=click.FloatRange(0, min_open=True),
    default=2.0,
    show_default=True,
    help="Seconds to connect to a replica (a failure is retried elsewhere).",
)
@click.option(
    "--upstream-timeout",
    type=click.FloatRange(0, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds to wait for any data from a replica: its answer, or the next piece of a stream.",
)
@click.option(
    "--stall-timeout",
    type=click.FloatRange(0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds: a replica with requests in flight that had been answering and then sends nothing "
    "this long (and does not answer GET /health within 1 s) is taken out like an open breaker, "
    "reported to the server, and its requests that sent nothing to their clients go elsewhere.",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(1),
    default=32 * 1024 * 1024,
    show_default=True,
    help="Largest request body accepted (larger: 413).",
)
@click.option(
    "--max-buffered-bytes",
    type=click.IntRange(1),
    default=128 * 1024 * 1024,
    show_default=True,
    help="Request body bytes held at once across every client connection (per --workers process); a "
    "request that would go past it gets 503 (retry), or 413 when it alone is larger. Bodies are read "
    "only after the API key passed.",
)
@click.option(
    "--routing",
    type=click.Choice(ROUTING_POLICIES),
    default="prefix",
    show_default=True,
    help="How a replica is chosen for a request without X-Session-Id: the fewest requests in flight, "
    "the one sent the same prompt beginning before (prefix caches), or at random.",
)
@click.option(
    "--prefix-load-factor",
    type=click.FloatRange(1),
    default=1.5,
    show_default=True,
    help="With --routing prefix: a replica over this times the mean requests in flight is passed over.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Gateway processes sharing the --listen port (SO_REUSEPORT); /metrics sums their counters.",
)
@click.option(
    "--shutdown-grace",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="On SIGTERM/SIGINT, seconds requests in flight may take to finish.",
)
def gateway_command(
    server: str,
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
    listen: str,
    no_keys: bool,
    max_attempts: int,
    retry_backoff: float,
    breaker_failures: int,
    breaker_open_seconds: float,
    connect_timeout: float,
    upstream_timeout: float,
    stall_timeout: float,
    max_body_bytes: int,
    max_buffered_bytes: int,
    routing: str,
    prefix_load_factor: float,
    workers: int,
    shutdown_grace: float,
) -> None:
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
    another replica, as do those on a replica that leaves the routes. The
    API key is checked before a body is read.

    --workers N runs N gateway processes on the one port; /metrics on any of
    them sums the counters of all. Prometheus metrics on GET /metrics;
    GET /health for load balancers. Several gateways may run against one server.
    """

    host, port = parse_listen(listen, "--listen")
    config = GatewayConfig(
        server=server,
        ca=ca,
        cert=cert,
        key=key,
        host=host,
        port=port,
        require_keys=not no_keys,
        proxy=ProxySettings(
            max_attempts=max_attempts,
            retry_backoff=retry_backoff,
            read_timeout=upstream_timeout,
            stall_timeout=stall_timeout,
        ),
        breaker_failures=breaker_failures,
        breaker_open_for=breaker_open_seconds,
        connect_timeout=connect_timeout,
        limits=Limits(
            max_body_bytes=max_body_bytes, max_buffered_bytes=max_buffered_bytes, idle_timeout=60.0
        ),
        routing=routing,
        prefix_load_factor=prefix_load_factor,
    )
    if workers == 1:
        _serve(config, shutdown_grace)
        return
    if port == 0:
        raise LlmgwError(f"--workers {workers} needs a fixed port in --listen (got {listen!r})")
    shared = attrs.evolve(config, reuse_port=True)
    sys.exit(run_workers(workers, lambda _index: _serve(shared, shutdown_grace)))


def _serve(config: GatewayConfig, shutdown_grace: float) -> None:
    gateway = Gateway(config)
    serve_until_signalled(
        gateway.serve,
        log=log,
        stop=lambda: gateway.shutdown(shutdown_grace),
        stopping="shutting down",
        stopping_again="stopping now",
    )
