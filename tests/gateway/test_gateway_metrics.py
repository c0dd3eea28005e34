"""What the gateway counts per request: tokens from usage by API key name, and its access lines."""

from __future__ import annotations

import logging

from llmgw.testing.metrics import promtool_check_metrics
from tests.gateway.test_gateway_api import KEY, MESSAGES, client, feed, gateway_url, metric_values, sims  # noqa: F401


async def test_tokens_keys_inter_token_latency_and_access_lines(gateway_url, caplog):  # noqa: F811
    """Usage of a JSON answer and of a stream's last chunk, by key name; one access line per request."""
    caplog.set_level(logging.INFO, logger="llmgw.gateway.access")
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 3}
    async with client(gateway_url) as http:
        answer = await http.post("/v1/chat/completions", json=body)
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/v1/chat/completions", json=stream) as streamed:
            await streamed.aread()
        assert (await http.post("/v1/chat/completions", json={**body, "model": "nope"})).status_code == 404
        async with client(gateway_url, key="sk-wrong-0123456789") as stranger:
            assert (await stranger.post("/v1/chat/completions", json=body)).status_code == 401
        exposition = await http.get("/metrics")
    usage = answer.json()["usage"]
    values = metric_values(exposition.text)
    alice = (("key", "alice"), ("model", "m"))
    assert values[("llmgw_gateway_prompt_tokens_total", alice)] == 2 * usage["prompt_tokens"]
    assert values[("llmgw_gateway_completion_tokens_total", alice)] == 2 * usage["completion_tokens"] == 6
    assert values[("llmgw_gateway_key_requests_total", (*alice, ("status", "200")))] == 2
    unknown = (("key", "alice"), ("model", "(unknown)"), ("status", "404"))
    assert values[("llmgw_gateway_key_requests_total", unknown)] == 1
    assert sum(v for (name, _), v in values.items() if name == "llmgw_gateway_key_requests_total") == 3
    assert "# TYPE llmgw_gateway_inter_token_latency_seconds histogram" in exposition.text  # counted: e2e
    assert values[("process_resident_memory_bytes", ())] > 0
    assert promtool_check_metrics(exposition.text) == []

    lines = [r for r in caplog.records if r.name == "llmgw.gateway.access"]
    assert [(r.model, r.status, r.key_name) for r in lines] == [
        ("m", 200, "alice"), ("m", 200, "alice"), ("(unknown)", 404, "alice"), ("(unknown)", 401, None),
    ]  # fmt: skip
    first, streamed_line = lines[0], lines[1]
    assert first.replica in ("m-0", "m-1") and first.ttft is None
    assert (first.prompt_tokens, first.completion_tokens) == (usage["prompt_tokens"], 3)
    assert streamed_line.ttft is not None and 0 < streamed_line.ttft <= streamed_line.duration
    assert "key=alice" in first.getMessage() and "tokens=" in first.getMessage()
    assert not any(KEY in r.getMessage() or "sk-wrong" in r.getMessage() for r in caplog.records)


def test_stream_usage_is_found_wherever_the_chunks_cut_it():
    """The last usage object of a stream is read whichever byte it is cut at, past a ``usage: null``."""
    from llmgw.gateway.usage import StreamUsage, read_usage

    usage_object = b'"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}'
    final = b'data: {"id":"x","choices":[],' + usage_object + b'}\n\n'
    for cut in range(1, len(final)):
        usage = StreamUsage()
        usage.feed(b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n')
        usage.feed(final[:cut])
        usage.feed(final[cut:])
        assert usage.usage == (12, 5), cut
    assert read_usage(b'{"data":[],"usage":{"prompt_tokens":7,"total_tokens":7}}') == (7, 0)  # embeddings
    assert read_usage(b'{"choices":[]}') is None
