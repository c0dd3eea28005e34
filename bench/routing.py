"""Routing policies against engines with prefix caches: time to first token and throughput.

Run with ``python bench/routing.py`` (about three minutes). For each policy
it starts four fresh ``llmgw-sim`` replicas whose prefix cache makes prefill
cost time (``--prefill-seconds-per-token``, one prefill at a time per replica,
``--prefix-cache-tokens`` each), a fake routes feed, and ``llmgw gateway``
with that ``--routing``; then it runs two workloads through the gateway with
streamed chat completions and measures, at the client, the time to the first
token (the first body bytes: the sim answers after its prefill):

- **prefix-heavy**: many tenants, each with a long system prompt of its own,
  and concurrent multi-turn conversations (each turn sends the whole
  conversation so far, the engine's answers included). The working set (every
  system prompt and live conversation) is larger than one replica's cache and
  fits in four;
- **control**: single-turn requests with unique prompts: no prefix is ever
  shared, so no policy can hit a cache.

Policies: ``random``; ``least-outstanding`` (power of two choices);
``session``: least-outstanding, with each conversation sent as one
``X-Session-Id`` (a client doing affinity by hand); ``prefix``
(``--routing prefix``). Requests started during the first ``--warm-up``
seconds are not counted. It prints TTFT p50/p99, throughput, and the ratio of
each policy's TTFT p50 to least-outstanding's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio

from llmgw.net.client import ConnectionPool
from llmgw.testing.gateway import FakeRoutesFeed, sim_argv, wait_healthy
from llmgw.testing.processes import ManagedProcess, free_port, start

POLICIES = ("random", "least-outstanding", "session", "prefix")
WORKLOADS = ("prefix-heavy", "control")


@attrs.frozen
class Settings:
    replicas: int = 4
    clients: int = 24
    tenants: int = 16
    system_words: int = 1200
    turns: int = 5
    user_words: int = 60
    control_words: int = 400
    max_tokens: int = 16
    cache_tokens: int = 10000
    prefill_per_token: float = 0.0002
    warm_up: float = 3.0
    seconds: float = 15.0


@attrs.frozen
class Outcome:
    policy: str
    workload: str
    ttft: tuple[float, ...]
    seconds: float
    errors: int

    def percentile(self, q: float) -> float:
        ordered = sorted(self.ttft) or [float("nan")]
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def rate(self) -> float:
        return len(self.ttft) / self.seconds


def words(rng: random.Random, count: int, tag: str) -> str:
    return " ".join(f"{tag}{rng.randrange(100_000)}" for _ in range(count))


async def run_workload(url: str, policy: str, workload: str, settings: Settings) -> Outcome:
    """Run ``settings.clients`` clients against the gateway at ``url``; TTFT of the requests counted."""
    rng = random.Random(f"{workload}")  # the same prompts for every policy
    systems = [words(rng, settings.system_words, f"t{t}s") for t in range(settings.tenants)]
    ttft: list[float] = []
    errors = 0
    began = trio.current_time()
    counted_from = began + settings.warm_up
    deadline = counted_from + settings.seconds
    async with ConnectionPool(max_idle_per_host=settings.clients, read_timeout=120) as pool:

        async def request(messages: list[dict], session: str) -> str:
            nonlocal errors
            body = {"model": "m", "messages": messages, "max_tokens": settings.max_tokens, "stream": True}
            headers = [("content-type", "application/json")]
            if policy == "session":
                headers.append(("x-session-id", session))
            sent = trio.current_time()
            first = None
            parts = []
            async with pool.stream("POST", url, headers=headers, body=json.dumps(body).encode()) as response:
                while (chunk := await response.receive_chunk()) is not None:
                    if first is None:
                        first = trio.current_time()
                    parts.append(chunk)
            if response.status != 200 or first is None:
                errors += 1
                return ""
            if counted_from <= sent and trio.current_time() <= deadline:
                ttft.append(first - sent)
            return _reply_text(b"".join(parts))

        async def client(index: int) -> None:
            crng = random.Random(f"{workload}-{index}")
            conversation = 0
            while trio.current_time() < deadline:
                conversation += 1
                session = f"c{index}-{conversation}"
                if workload == "control":
                    prompt = words(crng, settings.control_words, f"u{index}x{conversation}w")
                    await request([{"role": "user", "content": prompt}], session)
                    continue
                tenant = crng.randrange(settings.tenants)
                messages = [{"role": "system", "content": systems[tenant]}]
                for _ in range(settings.turns):
                    if trio.current_time() >= deadline:
                        break
                    messages.append({"role": "user", "content": words(crng, settings.user_words, "q")})
                    reply = await request(messages, session)
                    messages.append({"role": "assistant", "content": reply})

        async with trio.open_nursery() as nursery:
            for index in range(settings.clients):
                nursery.start_soon(client, index)
    return Outcome(policy, workload, tuple(ttft), settings.seconds, errors)


def _reply_text(stream: bytes) -> str:
    text = []
    for line in stream.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


async def run_policy(policy: str, settings: Settings, logs: Path) -> list[Outcome]:
    """Fresh replicas (cold caches) and a gateway routing by ``policy``; every workload through them."""
    outcomes = []
    for workload in WORKLOADS:
        started: list[ManagedProcess] = []
        try:
            ports = [free_port() for _ in range(settings.replicas)]
            flags = [
                "--prefill-seconds-per-token",
                str(settings.prefill_per_token),
                "--prefix-cache-tokens",
                str(settings.cache_tokens),
            ]
            for index, port in enumerate(ports):
                started.append(
                    start(sim_argv(port, *flags), name=f"sim-{policy}-{workload}-{index}", log_dir=logs)
                )
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            async with trio.open_nursery() as nursery:
                feed = FakeRoutesFeed()
                feed_url = await nursery.start(feed.serve)
                feed.set(routes={"m": [(f"m-{i}", url) for i, url in enumerate(urls)]})
                routing = "least-outstanding" if policy == "session" else policy
                gateway_port = free_port()
                argv = [sys.executable, "-m", "llmgw.gateway", "--server", feed_url, "--no-keys"]
                argv += ["--listen", f"127.0.0.1:{gateway_port}", "--routing", routing]
                started.append(start(argv, name=f"gateway-{policy}-{workload}", log_dir=logs))
                gateway_url = f"http://127.0.0.1:{gateway_port}"
                with trio.fail_after(30):
                    await wait_healthy([*urls, gateway_url])
                outcome = await run_workload(f"{gateway_url}/v1/chat/completions", policy, workload, settings)
                outcomes.append(outcome)
                print(
                    f"  {policy:17} {workload:12} TTFT p50 {outcome.percentile(0.5):8.1f} ms, "
                    f"{outcome.rate:6.1f} req/s",
                    file=sys.stderr,
                )
                nursery.cancel_scope.cancel()
        finally:
            for process in started:
                process.kill_group()
    return outcomes


def report(outcomes: list[Outcome], settings: Settings) -> None:
    print(
        f"\n{settings.replicas} sim replicas, prefix cache {settings.cache_tokens} tokens each, prefill "
        f"{settings.prefill_per_token * 1e6:.0f} us/uncached token (one at a time per replica);"
    )
    print(
        f"{settings.clients} concurrent clients; prefix-heavy: {settings.tenants} tenants x "
        f"{settings.system_words}-word system prompt, {settings.turns}-turn conversations of "
        f"{settings.user_words}-word questions; control: unique {settings.control_words}-word prompts.\n"
    )
    print(
        f"{'workload':12} {'policy':17} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'req/s':>7} "
        f"{'errors':>6} {'p50 vs LO':>9}"
    )
    baseline = {o.workload: o for o in outcomes if o.policy == "least-outstanding"}
    for workload in WORKLOADS:
        for outcome in (o for o in outcomes if o.workload == workload):
            reference = baseline.get(workload)
            ratio = outcome.percentile(0.5) / reference.percentile(0.5) if reference else float("nan")
            print(
                f"{workload:12} {outcome.policy:17} {outcome.percentile(0.5):>11.1f} "
                f"{outcome.percentile(0.99):>11.1f} {outcome.rate:>7.1f} {outcome.errors:>6} {ratio:>8.2f}x"
            )


async def main(settings: Settings, policies: list[str]) -> list[Outcome]:
    logs = Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-"))
    outcomes = []
    for policy in policies:
        outcomes += await run_policy(policy, settings, logs)
    return outcomes


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Settings()
    parser.add_argument("--seconds", type=float, default=defaults.seconds, help="measured seconds per run")
    parser.add_argument("--warm-up", type=float, default=defaults.warm_up, help="seconds not counted first")
    parser.add_argument("--clients", type=int, default=defaults.clients, help="concurrent clients")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies to run")
    args = parser.parse_args()
    chosen = Settings(seconds=args.seconds, warm_up=args.warm_up, clients=args.clients)
    began = time.monotonic()
    results = trio.run(main, chosen, args.policies.split(","))
    report(results, chosen)
    print(f"\n{time.monotonic() - began:.0f}s in all; medians over requests, one run per policy")
