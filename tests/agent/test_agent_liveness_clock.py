"""Rank 0's liveness probe judged by the engine's token counters, driven by trio's autojump clock.

The engine is an in-memory stand-in (``httpx.MockTransport``): its canary answers, or
waits forever, and its ``/metrics`` counters grow only while ``producing``. The real sim
under the real supervisor is tested in ``test_agent_liveness.py``.
"""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from llmgw.agent.liveness import Progress, parse_samples, read_progress, watch_liveness
from llmgw.engine import ProgressMetrics, openai_canary
from llmgw.testing.processes import wait_for

METRICS = ProgressMetrics(
    tokens=("e:generation_tokens_total", "e:prompt_tokens_total"), running=("e:running",)
)
PROBE = openai_canary(METRICS, timeout=10.0, interval=5.0)
BASE = "http://127.0.0.1:8000"


class Engine:
    """A canary that answers unless ``busy`` or ``hung``; counters that grow unless ``hung``."""

    def __init__(self) -> None:
        self.busy = False
        self.hung = False
        self.metrics_status = 200
        self.canaries: list[dict] = []
        self.started = trio.current_time()

    def tokens(self) -> float:
        """A busy engine produces 20 tokens a second; a hung one stopped at the hang."""
        return 20 * (trio.current_time() - self.started)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            if self.hung:
                frozen = 'e:generation_tokens_total{model_name="m"} 1234.0\ne:running 7.0\n'
                return httpx.Response(self.metrics_status, text=frozen)
            text = (
                "# TYPE e:generation_tokens counter\n"
                f'e:generation_tokens_total{{model_name="m",rank="0"}} {self.tokens():.1f}\n'
                'e:prompt_tokens_total{model_name="m"} 5.0\n'
                "e:running 7.0\n"
            )
            return httpx.Response(self.metrics_status, text=text)
        self.canaries.append(json.loads(request.content))
        if self.busy or self.hung:
            await trio.sleep_forever()
        return httpx.Response(200, json={"choices": [{"text": "a"}]})


@pytest.fixture
async def engine() -> Engine:
    """The stand-in engine, its counters starting now (trio's clock)."""
    return Engine()


def watching(nursery: trio.Nursery, engine: Engine, probe=PROBE) -> list[str]:
    """Start the liveness watch; returns the list its report fills (one entry: the engine is hung)."""
    reports: list[str] = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(engine.handle))
    nursery.start_soon(
        lambda: watch_liveness(client, BASE, probe, "served-m", reports.append, shard="m/1/r0")
    )
    return reports


async def test_canary_is_a_one_token_completion_of_the_served_model(nursery, engine, autojump_clock):
    """The probe sent is `POST /v1/completions` of the shard's served name, one token, greedy."""
    reports = watching(nursery, engine)
    await trio.sleep(60)
    assert reports == [] and len(engine.canaries) >= 10
    assert engine.canaries[0] == {"prompt": "a", "max_tokens": 1, "temperature": 0, "model": "served-m"}


async def test_busy_engine_producing_tokens_is_not_hung(nursery, engine, autojump_clock):
    """A canary that waits for an hour behind a busy batch never makes the engine hung (a non-event)."""
    reports = watching(nursery, engine)
    engine.busy = True
    await trio.sleep(3600)
    assert reports == []
    assert len(engine.canaries) > 200, "the canary was not retried at every interval"


async def test_hung_engine_is_reported_within_one_interval_and_timeout(nursery, engine, autojump_clock):
    """Counters that stop with the canary unanswered: hung, reported after interval + timeout at most."""
    reports = watching(nursery, engine)
    await trio.sleep(12)
    engine.hung = True
    hung_at = trio.current_time()
    with trio.fail_after(PROBE.interval + PROBE.timeout + 1):
        await wait_for(lambda: reports, "the engine to be reported hung")
    assert trio.current_time() - hung_at >= PROBE.timeout
    assert reports == [
        "liveness probe POST http://127.0.0.1:8000/v1/completions got no answer within 10 s and "
        "no token was produced meanwhile with 7 requests running (health still passes): hung"
    ]


async def test_unreadable_metrics_count_as_no_progress(nursery, engine, autojump_clock):
    """When /metrics fails too, an unanswered canary is a hang, and the report says why it could not tell."""
    reports = watching(nursery, engine)
    engine.busy, engine.metrics_status = True, 503
    with trio.fail_after(PROBE.interval + PROBE.timeout + 1):
        await wait_for(lambda: reports, "the engine to be reported hung")
    assert "its progress cannot be read (GET http://127.0.0.1:8000/metrics: HTTP 503): hung" in reports[0]


async def test_without_progress_metrics_no_answer_in_time_is_a_hang(nursery, engine, autojump_clock):
    """An engine that names no counters (the default canary): the first unanswered canary is a hang."""
    reports = watching(nursery, engine, openai_canary(timeout=10.0, interval=5.0))
    engine.busy = True
    with trio.fail_after(PROBE.interval + PROBE.timeout + 1):
        await wait_for(lambda: reports, "the engine to be reported hung")
    assert reports[0].endswith(
        "got no answer within 10 s (health still passes: a hung engine or a hung peer)"
    )


async def test_refused_connection_is_reported_at_once(nursery, autojump_clock):
    """A canary whose connection breaks is reported at the first interval, naming the error."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    reports: list[str] = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    nursery.start_soon(lambda: watch_liveness(client, BASE, PROBE, "m", reports.append))
    with trio.fail_after(PROBE.interval + 1):
        await wait_for(lambda: reports, "the refusal to be reported")
    assert reports == ["liveness probe POST http://127.0.0.1:8000/v1/completions failed: connection refused"]


class TestMetricsText:
    """Reading the counters out of Prometheus' text format."""

    def test_samples_are_summed_over_label_sets_and_comments_skipped(self):
        """Two label sets of one counter add up; HELP/TYPE lines, other names and bad values are skipped."""
        text = (
            "# HELP vllm:generation_tokens Number of generation tokens processed.\n"
            "# TYPE vllm:generation_tokens counter\n"
            'vllm:generation_tokens_total{engine="0",model_name="a b}c"} 1.5e+03\n'
            'vllm:generation_tokens_total{engine="1",model_name="x"} 500 1700000000000\n'
            "vllm:generation_tokens_created 1.7e9\n"
            "vllm:num_requests_running NaN-ish\n"
            "other 4\n"
        )
        found = parse_samples(text, ["vllm:generation_tokens_total", "vllm:num_requests_running"])
        assert found == {"vllm:generation_tokens_total": 2000.0}

    async def test_a_page_without_the_counters_says_which_it_lacks(self):
        """SGLang without --enable-metrics (or a page of other names) gives a reason, not a zero."""

        def page(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, text="python_gc_objects_collected_total 5\n")

        async with httpx.AsyncClient(transport=httpx.MockTransport(page)) as client:
            got = await read_progress(client, BASE, METRICS, 5.0)
        wanted = "e:generation_tokens_total, e:prompt_tokens_total"
        assert got == f"GET http://127.0.0.1:8000/metrics has none of {wanted}"

    async def test_a_reading_sums_tokens_and_running(self, engine, autojump_clock):
        """Both token counters add up; the running gauge is read beside them."""
        await trio.sleep(10)
        async with httpx.AsyncClient(transport=httpx.MockTransport(engine.handle)) as client:
            got = await read_progress(client, BASE, METRICS, 5.0)
        assert got == Progress(tokens=205.0, running=7.0)


class Draining(Engine):
    """Hangs at ``hung_at``: canaries wait forever, but requests already streaming go on for ``drain`` s."""

    def __init__(self, hung_at: float, drain: float) -> None:
        super().__init__()
        self.hung_at, self.drain = hung_at, drain
        self.busy = True

    def tokens(self) -> float:
        return 20 * (min(trio.current_time(), self.hung_at + self.drain) - self.started)


async def test_streams_draining_after_a_hang_do_not_buy_the_engine_a_second_round(nursery, autojump_clock):
    """Tokens that keep coming for 4 s after the hang (streams in flight) end with the round: hung after one
    interval and one timeout, not two (the canary judges the counters' last moves, not the whole round)."""
    engine = Draining(hung_at=trio.current_time() + 6, drain=4)
    reports = watching(nursery, engine)
    with trio.fail_after(6 + PROBE.interval + PROBE.timeout + 1):
        await wait_for(lambda: reports, "the engine to be reported hung")
    assert "no token was produced in its last" in reports[0], reports


async def test_a_paused_agent_rearms_its_canary_instead_of_failing_the_engine(
    nursery, engine, autojump_clock, caplog
):
    """The agent's clock jumps 60 s (SIGSTOP) while a canary waits on an engine whose counters stand still:
    the round is void, the canary starts again, and the engine is never reported hung."""
    reports = watching(nursery, engine)
    await trio.sleep(PROBE.interval + 1)
    engine.busy, engine.hung = False, True  # counters frozen; the canary in flight waits
    await trio.sleep(1)
    autojump_clock.jump(60)
    engine.hung = False  # the engine was fine all along: the next canaries are answered
    await trio.sleep(60)
    assert reports == []
    assert "was paused (its clock jumped" in caplog.text


async def test_a_late_agent_charges_the_engine_only_its_own_time(nursery, autojump_clock):
    """Every tick of the agent's clock fires 0.8 s late (a loaded machine): 12 s of wall time with the canary
    unanswered and the counters still charge the engine under its 10 s, so it is not yet hung; it is once
    the engine's own time reaches the timeout."""
    engine = Engine()
    reports = watching(nursery, engine)

    async def lateness() -> None:
        while True:
            await trio.sleep(0.5)
            autojump_clock.jump(0.8)

    await trio.sleep(PROBE.interval + 0.1)
    engine.busy, engine.hung = False, True
    nursery.start_soon(lateness)
    await trio.sleep(12)
    assert reports == []
    with trio.fail_after(30):
        await wait_for(lambda: reports, "the engine to be reported hung")
