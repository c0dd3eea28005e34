"""What the gateway's per-request observability costs, in microseconds, next to what it already paid.

Run with ``.venv/bin/python bench/observability.py``. In one process, it times
(best of 5 runs of 20,000 calls each) the bookkeeping every answered request
goes through: the request counter and duration histogram the gateway always
had (the baseline), the per-key request and token counters, reading ``usage``
from a JSON answer and from a stream's chunks, and the access line through
the standard logging module into a file (``llmgw.gateway.access`` at INFO).
It prints each cost and its ratio to the baseline.
"""

from __future__ import annotations

import logging
import tempfile
import timeit
from pathlib import Path

from llmgw.gateway import app as gateway_app
from llmgw.gateway.balancer import Balancer
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.usage import StreamUsage, read_usage

CALLS = 20_000


def best(fn) -> float:
    """Microseconds per call of ``fn``, the best of 5 runs."""
    return min(timeit.repeat(fn, number=CALLS, repeat=5)) / CALLS * 1e6


def main() -> None:
    metrics = GatewayMetrics(Balancer(), lambda: None)
    body = (
        b'{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
        b'"content":"' + b"word " * 200 + b'"},"finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":12,"completion_tokens":200,"total_tokens":212}}'
    )
    chunk = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"delta":{"content":"w"}}]}\n\n'
    stream = StreamUsage()

    class Replica:
        name = "chat-0"

    class Call:
        replica, ttft, usage = Replica(), 0.012, (12, 200)

    log_dir = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    handler = logging.FileHandler(log_dir / "access.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    access = logging.getLogger("llmgw.gateway.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False

    baseline = best(lambda: metrics.request_done("chat", "chat/completions", 200, 0.05))
    cases = {
        "per-key requests and tokens": best(lambda: metrics.by_key("alice", "chat", 200, (12, 200))),
        "usage of a 1 KB JSON answer": best(lambda: read_usage(body)),
        "usage scan of one stream chunk": best(lambda: stream.feed(chunk)),
        "inter-token latency (one chunk)": best(lambda: metrics.inter_token_latency("chat", 0.01)),
        "access line (logging to a file)": best(
            lambda: gateway_app._access(
                ("10.0.0.1", 5), "req-1", "chat/completions", "chat", Call, 200, 0.05, "alice"
            )
        ),
    }
    print(f"{'per answered request':<36} {'us':>7} {'x baseline':>11}")
    print(f"{'baseline: requests + duration':<36} {baseline:>7.2f} {1:>11.2f}")
    for what, cost in cases.items():
        print(f"{what:<36} {cost:>7.2f} {cost / baseline:>11.2f}")
    print(f"\nbest of 5 runs of {CALLS} calls each; a stream pays the chunk costs once per chunk")


if __name__ == "__main__":
    main()
