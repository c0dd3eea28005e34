"""How fast the agent's liveness canary finds a hung engine, and whether it ever ejects a busy one.

Run with ``python bench/hang.py`` (about 2.5 minutes; ``--hangs`` and
``--seconds`` change that). Everything runs under the agent's real shard
supervisor, with real ``llmgw-sim`` processes; no server or gateway (the
server's part, failing the replica on ``unhealthy``, is immediate):

- **hangs**: ``--hangs`` times, a sim started with ``--hang-after-requests N``
  (N drawn from 20..60) under ``--clients`` concurrent clients, started at a
  random moment of the canary's interval; the hang starts when the last client
  request is answered. Detection time is from then to
  the supervisor's ``unhealthy`` report. Printed: p50 and max, and the
  canary's timeout and interval they follow from (at worst interval +
  timeout, plus the reading of /metrics).
- **busy, no hang**: one sim with ``--max-num-seqs`` seats at
  ``--tokens-per-second``, under three times ``--clients`` clients asking for
  long generations, for ``--seconds``: the canary waits behind full seats.
  Printed: requests answered and failed, how often the canary was kept
  waiting past its timeout (judged busy by the token counters), and false
  ejections (``unhealthy`` reports; the target is 0).

``--timeout`` and ``--interval`` replace the sim's canary timings (5 s and
2 s) with others, vLLM's and SGLang's (10 s and 5 s) for instance.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import httpx
import trio
from llmgw_engine_sim import SimEngine

from llmgw.agent.supervisor import ShardSupervisor
from llmgw.testing.agent import agent_config, desired, kill_group
from llmgw.testing.processes import free_port, wait_for


class BusyVerdicts(logging.Handler):
    """Counts the supervisor's "busy, not hung" judgements."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "busy, not hung" in record.getMessage():
            self.count += 1


async def supervise(engine: SimEngine, root: Path, args: list[str], groups: list[int]):
    """Start a sim shard under a supervisor; returns it, its reported states and its URL once ready."""
    port = free_port("127.0.0.1")
    states: list = []
    supervisor = ShardSupervisor(
        desired("sim", port, extra_args=args),
        engine,
        agent_config(root),
        states.append,
        on_spawn=lambda child: groups.append(child.pgid),
    )
    return supervisor, states, f"http://127.0.0.1:{port}"


async def wait_for_state(states: list, wanted: set[str]) -> float:
    """When (``time.monotonic``) the shard's last reported state is in ``wanted``, to 20 ms."""
    await wait_for(lambda: states and states[-1].state in wanted, f"a state in {sorted(wanted)}")
    return time.monotonic()


async def load(url: str, clients: int, max_tokens: int, tally: dict, last_answer: list[float]) -> None:
    """``clients`` loops of completions until cancelled; counts answers and failures."""

    async def client(http: httpx.AsyncClient, worker: int) -> None:
        for number in range(10**9):
            body = {"model": "m", "prompt": f"bench {worker} {number}", "max_tokens": max_tokens}
            try:
                response = await http.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError:
                tally["failed"] += 1
                await trio.sleep(0.1)
                continue
            tally["answered" if response.status_code == 200 else "failed"] += 1
            last_answer[0] = time.monotonic()

    async with httpx.AsyncClient(timeout=120) as http, trio.open_nursery() as nursery:
        for worker in range(clients):
            nursery.start_soon(client, http, worker)


async def one_hang(engine: SimEngine, root: Path, clients: int, groups: list[int]) -> float:
    """Seconds from the hang's start to the unhealthy report, for one sim."""
    after = random.randint(20, 60)
    supervisor, states, url = await supervise(engine, root, ["--hang-after-requests", str(after)], groups)
    tally = {"answered": 0, "failed": 0}
    last_answer = [time.monotonic()]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor.run)
        with trio.fail_after(30):
            await wait_for_state(states, {"ready"})
        # the load (and the hang it leads to at once) starts anywhere in the canary's interval
        await trio.sleep(random.uniform(0, engine.liveness_probe.interval))
        nursery.start_soon(load, url, clients, 4, tally, last_answer)
        with trio.fail_after(120):
            reported = await wait_for_state(states, {"unhealthy", "exited"})
        assert states[-1].state == "unhealthy", states[-1]
        nursery.cancel_scope.cancel()
    return reported - last_answer[0]


async def busy(engine: SimEngine, root: Path, options: argparse.Namespace, groups: list[int]) -> dict:
    """The no-hang soak: answered and failed requests, and unhealthy reports (false ejections)."""
    seats = ["--max-num-seqs", str(options.seats), "--tokens-per-second", str(options.tokens_per_second)]
    supervisor, states, url = await supervise(engine, root, seats, groups)
    tally = {"answered": 0, "failed": 0}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor.run)
        with trio.fail_after(30):
            await wait_for_state(states, {"ready"})
        nursery.start_soon(load, url, 3 * options.clients, 200, tally, [0.0])
        await trio.sleep(options.seconds)
        nursery.cancel_scope.cancel()
    tally["false ejections"] = sum(1 for s in states if s.state in ("unhealthy", "exited"))
    return tally


async def main(options: argparse.Namespace) -> None:
    probe = attrs.evolve(
        SimEngine.liveness_probe,
        **{k: v for k, v in (("timeout", options.timeout), ("interval", options.interval)) if v},
    )
    engine = type("BenchSim", (SimEngine,), {"liveness_probe": probe})()
    verdicts = BusyVerdicts()
    logging.getLogger("llmgw.agent").addHandler(verdicts)
    logging.getLogger("llmgw.agent").setLevel(logging.INFO)
    groups: list[int] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            times = []
            for number in range(options.hangs):
                times.append(await one_hang(engine, Path(tmp) / f"hang-{number}", options.clients, groups))
                print(f"hang {number + 1}: found after {times[-1]:.1f} s", file=sys.stderr)
            soak = await busy(engine, Path(tmp) / "busy", options, groups)
    finally:
        for pgid in groups:
            kill_group(pgid)
    print(f"canary: timeout {probe.timeout:g} s, every {probe.interval:g} s")
    if times:
        print(
            f"hangs: {len(times)}, detection p50 {statistics.median(times):.1f} s, max {max(times):.1f} s "
            f"(bound: interval + timeout = {probe.interval + probe.timeout:g} s, plus reading /metrics)"
        )
    print(
        f"busy for {options.seconds:g} s at {3 * options.clients} clients, {options.seats} seats: "
        f"{soak['answered']} answered, {soak['failed']} failed, canary kept waiting and judged busy "
        f"{verdicts.count} times, false ejections {soak['false ejections']} (target 0)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hangs", type=int, default=10, help="injected hangs (default 10)")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the busy soak (default 60)")
    parser.add_argument("--clients", type=int, default=8, help="the usual concurrency (default 8)")
    parser.add_argument("--seats", type=int, default=4, help="the busy sim's --max-num-seqs (default 4)")
    parser.add_argument("--tokens-per-second", type=float, default=20.0, help="its speed (default 20)")
    parser.add_argument("--timeout", type=float, help="the canary's timeout (default: the sim's, 5 s)")
    parser.add_argument("--interval", type=float, help="the canary's interval (default: the sim's, 2 s)")
    trio.run(main, parser.parse_args())
