"""``llmgw-sim``'s run: the simulated engine's arguments and process lifecycle (entry: :mod:`.cli`).

Rank 0 serves the OpenAI-compatible API and, with ``--nnodes`` > 1, binds the
dist-init address its workers join; workers serve nothing. The process
ends with code 0 after a graceful shutdown (SIGTERM or SIGINT) and with code 1
when a peer is lost, the replica cannot form, or a fault was injected.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
from typing import Any, NoReturn

import trio

from llmgw.logs import JsonFormatter
from llmgw.net.server import HttpServer
from llmgw_engine_sim import __version__
from llmgw_engine_sim.flags import add_options, non_negative, options_from_args, positive_float, positive_int
from llmgw_engine_sim.lora import LoraOptions
from llmgw_engine_sim.prefix_cache import PrefillOptions
from llmgw_engine_sim.rendezvous import Coordinator, join_replica
from llmgw_engine_sim.server import ServeOptions, SimApp, reported_env

__all__ = ["build_parser", "main"]

log = logging.getLogger("llmgw_engine_sim")


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; its ``--help`` documents every flag."""
    parser = argparse.ArgumentParser(
        prog="llmgw-sim",
        description="A simulated LLM inference engine: an OpenAI-compatible server with deterministic "
        "output, real multi-node rendezvous and fault injection. No GPU needed.",
    )
    add = parser.add_argument
    add("--version", action="version", version=f"%(prog)s {__version__}")
    add("--model", required=True, help="model to load: a local path (must exist) or a hub-style name")
    add(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) the API accepts and reports for the model (default: the --model value)",
    )
    add(
        "--host",
        help="this node's address: rank 0 serves HTTP on it (default 127.0.0.1); "
        "a worker given one joins rank 0 from it",
    )
    add("--port", type=int, default=8000, help="port the HTTP API binds (rank 0 only; default 8000)")
    add("--nnodes", type=positive_int, default=1, metavar="N", help="number of nodes (ranks) in the replica")
    add(
        "--node-rank", type=non_negative(int), default=0, metavar="R", help="this node's rank; 0 serves HTTP"
    )
    add(
        "--dist-init-addr",
        type=_host_port,
        metavar="HOST:PORT",
        help="address rank 0 binds and workers join; required when --nnodes > 1",
    )
    add("--max-model-len", type=positive_int, metavar="N", help="reject prompt + max_tokens above N tokens")
    add(
        "--time-to-first-token",
        type=non_negative(float),
        default=0.0,
        metavar="SECONDS",
        help="delay before the first generated token (default 0)",
    )
    add(
        "--tokens-per-second",
        type=non_negative(float),
        default=0.0,
        metavar="N",
        help="generation speed after the first token; 0 means no delay (default 0)",
    )
    add_options(parser, PrefillOptions)
    add_options(parser, LoraOptions)
    add(
        "--max-num-seqs",
        type=positive_int,
        metavar="N",
        help="at most N generations run at once; the others wait for a seat (default: no limit)",
    )
    add(
        "--startup-delay",
        type=non_negative(float),
        default=0.0,
        metavar="SECONDS",
        help="time spent 'loading weights' before ready; /health answers 503 meanwhile",
    )
    add(
        "--peer-timeout",
        type=positive_float,
        default=1.0,
        metavar="SECONDS",
        help="a peer silent this long (no heartbeat) is lost and the process exits 1 (default 1.0)",
    )
    add(
        "--on-peer-loss",
        choices=("exit", "abort-on-request"),
        default="exit",
        help="what rank 0 does when a worker is lost: 'exit' at once with code 1 (a broken NCCL "
        "collective: vLLM, SGLang), or 'abort-on-request' as llama-server over RPC does: /health stays "
        "200, the next inference request gets no response and the process aborts (SIGABRT) if the "
        "worker's connection closed, or hangs if the worker fell silent (default exit)",
    )
    add(
        "--join-timeout",
        type=non_negative(float),
        default=600.0,
        metavar="SECONDS",
        help="how long rank 0 waits for every worker, and a worker retries reaching rank 0 (default 600)",
    )
    add(
        "--shutdown-grace",
        type=non_negative(float),
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long in-flight requests may take to finish (default 5)",
    )
    add(
        "--hang-after-requests",
        type=non_negative(int),
        metavar="N",
        help="fault injection: answer N inference requests, then never answer another "
        "(/health still answers 200)",
    )
    add(
        "--exit-after-requests",
        type=positive_int,
        metavar="N",
        help="fault injection: exit with code 1 once the N-th inference request is answered",
    )
    add(
        "--oom-after-requests",
        type=positive_int,
        metavar="N",
        help="fault injection: once the N-th inference request is answered, log that CUDA ran out of "
        "memory as vLLM does (torch.OutOfMemoryError) and exit with code 1",
    )
    add("--disable-log-requests", action="store_true", help="do not log one line per HTTP request")
    add(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get("LLMGW_LOG_FORMAT") or "text",
        help="log lines as text or as JSON objects (time, level, logger, message, rank); default: "
        "$LLMGW_LOG_FORMAT (an agent's, which its engines inherit), else text",
    )
    add(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        type=str.lower,
        default=os.environ.get("LLMGW_LOG_LEVEL") or "info",
        help="log from this level up; default: $LLMGW_LOG_LEVEL, else info",
    )
    return parser


class _Lifecycle:
    """Ends the process: the first call to :meth:`exit` sets the code and cancels everything."""

    def __init__(self) -> None:
        self.code: int | None = None
        self.scope = trio.CancelScope()

    def exit(self, code: int, reason: str) -> None:
        if self.code is not None:
            return
        (log.error if code else log.info)("exiting with code %d: %s", code, reason)
        self.code = code
        self.scope.cancel()


async def _run(args: argparse.Namespace) -> int:
    life = _Lifecycle()
    with life.scope:
        async with trio.open_nursery() as nursery:
            if args.node_rank == 0:
                await _rank_zero(args, life, nursery)
            else:
                await _worker(args, life, nursery)
    return life.code if life.code is not None else 0


async def _watch_signals(life: _Lifecycle, on_first: Any, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        first = True
        async for signum in signals:
            name = signal.Signals(signum).name
            if first:
                first = False
                on_first(name)
            else:
                life.exit(1, f"second signal ({name}) during shutdown")


async def _rank_zero(args: argparse.Namespace, life: _Lifecycle, nursery: trio.Nursery) -> None:
    app: SimApp | None = None

    def peer_lost(rank: int, address: str, reason: str) -> None:
        """``--on-peer-loss abort-on-request``: what llama-server does when an RPC worker goes."""
        assert app is not None
        if reason.startswith("no heartbeat"):
            log.error("peer hung: rank %d (%s): %s; inference requests now hang", rank, address, reason)

            async def hang() -> None:
                await trio.sleep_forever()

            app.peer_problem = hang
            return
        log.error("peer lost: rank %d (%s): %s; the next inference request aborts", rank, address, reason)

        async def abort() -> None:
            log.error("Remote RPC server crashed or returned malformed response (rank %d, %s)", rank, address)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.abort()

        app.peer_problem = abort

    coordinator = Coordinator(
        nnodes=args.nnodes,
        model=args.model,
        peer_timeout=args.peer_timeout,
        exit=life.exit,
        on_peer_loss=peer_lost if args.on_peer_loss == "abort-on-request" else None,
    )

    def info() -> dict[str, Any]:
        workers = [coordinator.workers[rank] for rank in sorted(coordinator.workers)]
        return {
            "argv": sys.argv,
            "pid": os.getpid(),
            "rank": 0,
            "nnodes": args.nnodes,
            "model": args.model,
            "served_model_names": list(args.served_model_name),
            "env": reported_env(),
            "workers": workers,
        }

    options = ServeOptions(
        model=args.model,
        served_model_names=args.served_model_name,
        max_model_len=args.max_model_len,
        time_to_first_token=args.time_to_first_token,
        tokens_per_second=args.tokens_per_second,
        max_num_seqs=args.max_num_seqs,
        hang_after_requests=args.hang_after_requests,
        exit_after_requests=args.exit_after_requests,
        oom_after_requests=args.oom_after_requests,
        log_requests=not args.disable_log_requests,
        prefill=options_from_args(PrefillOptions, args),
        lora=options_from_args(LoraOptions, args),
    )
    app = SimApp(options, exit=life.exit, info=info)
    server = HttpServer(app.handle)

    def shut_down(signal_name: str) -> None:
        log.info(
            "received %s: shutting down, %d requests in flight, grace %gs",
            signal_name,
            server.in_flight,
            args.shutdown_grace,
        )
        app.shutting_down = True
        server.shutdown(args.shutdown_grace)

    async def serve_http(task_status=trio.TASK_STATUS_IGNORED) -> None:
        await server.serve(args.host or "127.0.0.1", args.port, task_status=task_status)
        life.exit(0, "shutdown complete")

    await nursery.start(_watch_signals, life, shut_down)
    try:
        host, port = await nursery.start(serve_http)
    except OSError as exc:
        return life.exit(
            1, f"cannot serve HTTP on {args.host or '127.0.0.1'}:{args.port}: {exc.strerror or exc}"
        )
    log.info("HTTP API on http://%s:%d (/health answers 503 until ready)", host, port)
    if args.nnodes > 1:
        dist_host, dist_port = args.dist_init_addr
        try:
            await nursery.start(coordinator.serve, dist_host, dist_port, args.join_timeout)
        except OSError as exc:
            return life.exit(
                1, f"cannot bind dist-init address {dist_host}:{dist_port}: {exc.strerror or exc}"
            )
        await coordinator.all_joined.wait()
    if args.startup_delay:
        log.info("loading weights of %s (--startup-delay %gs)", args.model, args.startup_delay)
        await trio.sleep(args.startup_delay)
    if not app.shutting_down:
        app.ready = True
        names = ", ".join(args.served_model_name)
        log.info("ready: serving %s as %s on http://%s:%d", args.model, names, host, port)


async def _worker(args: argparse.Namespace, life: _Lifecycle, nursery: trio.Nursery) -> None:
    await nursery.start(_watch_signals, life, lambda name: life.exit(0, f"received {name}"))
    log.info("worker rank %d of %d: serves no HTTP; joining rank 0", args.node_rank, args.nnodes)
    dist_host, dist_port = args.dist_init_addr
    await join_replica(
        host=dist_host,
        port=dist_port,
        rank=args.node_rank,
        nnodes=args.nnodes,
        model=args.model,
        peer_timeout=args.peer_timeout,
        join_timeout=args.join_timeout,
        exit=life.exit,
        local_address=_ip_or_none(args.host) if args.host else None,
    )


def _ip_or_none(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int) -> None:
        super().__init__(f"%(asctime)s llmgw-sim rank={rank} %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> NoReturn:
    """Run ``llmgw-sim`` with ``argv`` (default: the command line) and exit with its code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.node_rank >= args.nnodes:
        parser.error(f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes}")
    if args.nnodes > 1 and args.dist_init_addr is None:
        parser.error("--dist-init-addr is required when --nnodes > 1")
    args.served_model_name = args.served_model_name or [args.model]

    handler = logging.StreamHandler(sys.stderr)
    if args.log_format == "json":
        handler.setFormatter(JsonFormatter({"rank": args.node_rank}))
    else:
        handler.setFormatter(_RankFormatter(args.node_rank))
    for name in ("llmgw_engine_sim", "llmgw.net.server"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(args.log_level.upper())

    if args.model.startswith(("/", ".")) and not os.path.exists(args.model):
        log.error(
            "model path %s does not exist (a local model must exist; anything else is a hub name)", args.model
        )
        sys.exit(1)
    log.info(
        "starting llmgw-sim %s: model %s, rank %d of %d, pid %d",
        __version__,
        args.model,
        args.node_rank,
        args.nnodes,
        os.getpid(),
    )
    sys.exit(trio.run(_run, args))
