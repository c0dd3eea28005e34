"""Budgets and the gateway's queue end to end: a real server, agents, sims and gateway processes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from llmgw.testing.catalogs import catalog_yaml, chat_catalog, model, sim_profile
from llmgw.testing.chat import chat_body
from llmgw.testing.load import ready_cluster
from llmgw.testing.processes import free_port
from tests.e2e.test_e2e_key_limits import chat, created, status_of

pytestmark = pytest.mark.timeout(240)


def stream(url: str, secret: str, max_tokens: int) -> tuple[int, str]:
    """A streamed chat completion read to its end: (status, the whole body)."""
    body = chat_body("chat", "hi", max_tokens, stream=True, usage=True)
    headers = {"authorization": f"Bearer {secret}"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60) as answer:
        return answer.status_code, answer.read().decode()


def test_a_budget_spent_mid_stream_never_cuts_it_and_refuses_the_next_request(tmp_path: Path):
    """A key with --budget 5 streams more than 5 tokens: the stream ends whole ([DONE], no error event);
    the key's next request is 429 budget_limit with Retry-After until UTC midnight, in every gateway (a
    restarted one too); `ctl keys usage` shows the tokens; another key is served."""
    with ready_cluster(tmp_path, chat_catalog(replicas=1), nodes=1) as cluster:
        limited = created(cluster, "team-batch", "--budget", "5")
        other = created(cluster, "team-web")
        cluster.start_gateway(free_port(), keys=True)
        url = cluster.gateway_url
        cluster.wait(lambda: status_of(url, other) == 200, "the gateway to serve team-web", 60)

        status, body = stream(url, limited, 200)
        assert status == 200 and body.rstrip().endswith("data: [DONE]"), body[-300:]
        assert '"error"' not in body
        used = json.loads(body.split("data: ")[-2])["usage"]["total_tokens"]
        assert used > 5  # the stream ran past the budget, whole
        cluster.wait(lambda: status_of(url, limited) == 429, "team-batch's budget to be spent", 30)
        refused = chat(url, limited)
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "budget_limit"
        assert "API key 'team-batch' has used its budget of 5 tokens per day (budget)" in error["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 86400
        assert chat(url, other).status_code == 200

        usage = cluster.ctl("keys", "usage", "team-batch", "-o", "json")
        assert usage.returncode == 0, usage.stderr
        (key,) = json.loads(usage.stdout)
        assert key["tokens"] >= used and key["models"][0]["model"] == "chat"
        table = cluster.ctl("keys", "usage", "team-batch").stdout
        assert "team-batch" in table and "/5 (" in table

        cluster.stop(cluster.gateway)  # the count is the server's: a new gateway refuses the key too
        cluster.start_gateway(free_port(), keys=True)
        url = cluster.gateway_url
        cluster.wait(lambda: status_of(url, other) == 200, "the restarted gateway to serve team-web", 60)
        cluster.wait(lambda: status_of(url, limited) == 429, "the restarted gateway to refuse team-batch", 30)
        raised = cluster.ctl("keys", "update", "team-batch", "--budget", "100000")
        assert raised.returncode == 0 and "budget 100000/day" in raised.stdout, raised.stderr
        cluster.wait(lambda: status_of(url, limited) == 200, "a raised budget to serve team-batch", 30)
        cluster.check()


def test_a_full_queue_is_503_naming_the_flag(tmp_path: Path):
    """A gateway with --replica-concurrency 1 --queue-size 1: while a long stream holds the one seat and a
    request waits, the next is 503 queue_full with Retry-After; the waiting one is served after the stream."""
    extra = ["--replica-concurrency", "1", "--queue-size", "1", "--queue-timeout", "60"]
    slow = sim_profile(1, "--time-to-first-token", "0.02", "--tokens-per-second", "2")
    catalog = catalog_yaml({"chat": model("{models}/chat", replicas=1)}, one=slow)
    with ready_cluster(tmp_path, catalog, nodes=1) as cluster:
        secret = created(cluster, "team-web")
        cluster.start_gateway(free_port(), keys=True, extra=extra)
        url = cluster.gateway_url
        cluster.wait(lambda: status_of(url, secret) == 200, "the gateway to serve", 60)
        answers: dict[str, object] = {}
        # 12 tokens at 2 a second hold the seat 6 s; the queueing and the refusal below take well under one
        long = threading.Thread(target=lambda: answers.update(long=stream(url, secret, 12)))
        long.start()
        started = "llmgw_gateway_in_flight_requests{"
        cluster.wait(lambda: _waiting(url, started) >= 1, "the stream to start", 30)
        waiting = threading.Thread(target=lambda: answers.update(waited=chat(url, secret)))
        waiting.start()
        cluster.wait(lambda: _waiting(url, "llmgw_gateway_queued_requests{") == 1, "a request to wait", 30)
        full = chat(url, secret)
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        error = full.json()["error"]
        assert error["code"] == "queue_full" and "(--queue-size 1)" in error["message"]
        long.join(60)
        waiting.join(60)
        assert answers["long"][0] == 200 and answers["waited"].status_code == 200
        cluster.check()


def _waiting(url: str, family: str) -> float:
    """The sum of a gauge family's samples on the gateway's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(family))
