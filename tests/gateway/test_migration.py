"""Mid-stream migration's pure parts: reading what a client received, rewriting the request, the stream
the continuing replica sends, and the usage as if one replica had answered."""

from __future__ import annotations

import json

import pytest

from llmgw.gateway.balancer import Balancer
from llmgw.gateway.migration import (
    FOLD_BYTES,
    Carried,
    NotContinued,
    Plan,
    Rewriter,
    Transcript,
    event_boundary,
    plan,
)
from llmgw.wire import Route, RouteTable, from_json


def sse(*events: dict | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n" for e in events
    )


def chat_chunk(id_: str, delta: dict, finish: str | None = None, **extra) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"id": id_, "object": "chat.completion.chunk", "created": 100, "choices": [choice], **extra}


def received(*words: str) -> Transcript:
    """A transcript of a chat stream that sent the role, then ``words`` one event each."""
    transcript = Transcript()
    transcript.add(sse(chat_chunk("chatcmpl-a", {"role": "assistant", "content": ""})))
    for word in words:
        transcript.add(sse(chat_chunk("chatcmpl-a", {"content": word})))
    return transcript


def request(**fields) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, **fields}
    return json.dumps(body).encode()


def payloads(stream: bytes) -> list[dict | str]:
    out: list[dict | str] = []
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: "):
            data = event[6:]
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


class TestTranscript:
    """What the client received, read from its events."""

    def test_reads_text_tokens_and_id(self):
        """The text is the deltas joined; a token is an event with text; the id is the first event's."""
        carried = received("The", " fleet", " serves").carried()
        assert carried == Carried("chatcmpl-a", 100, "The fleet serves", 3, False, False, role_sent=True)

    def test_a_long_stream_is_read_as_it_goes(self):
        """Past FOLD_BYTES the events are read into text and counts: the same as reading them at the end."""
        words = [f" w{i}" for i in range(2 * FOLD_BYTES // 100)]
        carried = received(*words).carried()
        assert carried.text == "".join(words) and carried.tokens == len(words)
        assert carried.id == "chatcmpl-a" and carried.role_sent

    def test_completion_text(self):
        """A completion's events carry ``text``."""
        transcript = Transcript()
        for word in ("a", " b"):
            transcript.add(sse({"id": "cmpl-x", "created": 5, "choices": [{"index": 0, "text": word}]}))
        assert transcript.carried() == Carried("cmpl-x", 5, "a b", 2, False, False)

    def test_finish_and_tool_calls_are_seen(self):
        """A sent finish_reason and tool-call deltas are noted."""
        transcript = received("x")
        transcript.add(sse(chat_chunk("chatcmpl-a", {"tool_calls": [{"index": 0}]}, "tool_calls")))
        carried = transcript.carried()
        assert carried.finished and carried.tool_calls

    @pytest.mark.parametrize(
        ("data", "cut"),
        [(b"data: 1\n\ndata: 2", 9), (b"data: 1\n\n", 9), (b"data: 1", 0), (b"data: 1\r\n\r\ndata: 2", 11)],
    )
    def test_event_boundary(self, data, cut):
        """Only whole events go out: the cut is after the last blank line."""
        assert event_boundary(data) == cut


class TestPlan:
    """The continuation request."""

    def test_chat_gets_the_text_as_a_final_assistant_message(self):
        """A chat is continued from an assistant message, max_tokens less the tokens sent, usage asked."""
        planned = plan(request(max_tokens=20), "chat/completions", received("The", " fleet").carried())
        assert isinstance(planned, Plan) and not planned.wants_usage
        body = json.loads(planned.body)
        assert body["messages"] == [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "The fleet"},
        ]
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
        assert body["max_tokens"] == 18
        assert body["stream_options"] == {"include_usage": True}

    def test_max_completion_tokens_is_reduced_too(self):
        """Both spellings of the limit are reduced."""
        planned = plan(request(max_completion_tokens=10), "chat/completions", received("a", " b").carried())
        assert json.loads(planned.body)["max_completion_tokens"] == 8

    def test_completion_prompt_gets_the_text_appended(self):
        """A completion's prompt is continued with the text so far."""
        body = json.dumps({"model": "m", "prompt": "once upon", "max_tokens": 9, "stream": True}).encode()
        transcript = Transcript()
        transcript.add(sse({"id": "cmpl-x", "created": 1, "choices": [{"index": 0, "text": " a"}]}))
        planned = plan(body, "completions", transcript.carried())
        assert json.loads(planned.body)["prompt"] == "once upon a"
        assert json.loads(planned.body)["max_tokens"] == 8

    def test_nothing_sent_yet_resends_the_request(self):
        """With only the role sent, the request goes again as it was (no assistant message)."""
        planned = plan(request(max_tokens=5), "chat/completions", received().carried())
        body = json.loads(planned.body)
        assert len(body["messages"]) == 1 and "continue_final_message" not in body

    def test_a_finished_answer_is_only_ended(self):
        """When the finish went out, nothing is asked of another replica: the stream gets [DONE]."""
        transcript = received("a")
        transcript.add(sse(chat_chunk("chatcmpl-a", {}, "stop")))
        planned = plan(request(), "chat/completions", transcript.carried())
        assert planned.body is None and planned.tail == b"data: [DONE]\n\n"

    def test_max_tokens_reached_ends_with_length(self):
        """Every token sent but not the finish: the stream ends with finish_reason length."""
        planned = plan(request(max_tokens=2), "chat/completions", received("a", " b").carried())
        assert planned.body is None
        assert [e["choices"][0]["finish_reason"] for e in payloads(planned.tail)[:-1]] == ["length"]
        assert payloads(planned.tail)[0]["id"] == "chatcmpl-a" and payloads(planned.tail)[-1] == "[DONE]"

    @pytest.mark.parametrize(
        ("fields", "reason"),
        [
            ({"n": 2}, NotContinued.CHOICES),
            ({"logprobs": True}, NotContinued.LOGPROBS),
            ({"top_logprobs": 2}, NotContinued.LOGPROBS),
            ({"response_format": {"type": "json_object"}}, NotContinued.REQUEST),
            ({"guided_json": {}}, NotContinued.REQUEST),
            ({"echo": True}, NotContinued.REQUEST),
        ],
    )
    def test_what_cannot_be_continued(self, fields, reason):
        """Several choices, logprobs, constrained output and echo are not continued, each with its reason."""
        assert plan(request(**fields), "chat/completions", received("a").carried()) is reason

    def test_token_id_prompts_are_not_continued(self):
        """A completion prompt of token ids cannot get text appended."""
        body = json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode()
        assert plan(body, "completions", received("a").carried()) is NotContinued.REQUEST

    def test_tool_calls_are_not_continued(self):
        """An answer that streamed tool calls is not text to continue."""
        transcript = received()
        transcript.add(sse(chat_chunk("chatcmpl-a", {"tool_calls": [{"index": 0, "id": "c"}]})))
        assert plan(request(), "chat/completions", transcript.carried()) is NotContinued.REQUEST


class TestRewriter:
    """The continuing replica's events as the rest of the client's stream."""

    def continued(self, *, wants_usage: bool, in_prompt: bool = True) -> tuple[list, list]:
        seen: list[tuple[int, int]] = []
        rewriter = Rewriter(
            received("The", " fleet").carried(), in_prompt, wants_usage, lambda p, c: seen.append((p, c))
        )
        usage_field = {"usage": None}
        upstream = sse(
            chat_chunk("chatcmpl-b", {"role": "assistant", "content": ""}, **usage_field),
            chat_chunk("chatcmpl-b", {"content": " serves"}, **usage_field),
            chat_chunk("chatcmpl-b", {}, "length", **usage_field),
            {
                "id": "chatcmpl-b",
                "created": 999,
                "choices": [],
                "usage": {"prompt_tokens": 7, "completion_tokens": 1},
            },
            "[DONE]",
        )
        return payloads(rewriter.rewrite(upstream)), seen

    def test_same_id_no_second_role(self):
        """The first response's id and created; the role delta is not sent again."""
        events, _ = self.continued(wants_usage=True)
        assert {e["id"] for e in events[:-1]} == {"chatcmpl-a"}
        assert {e["created"] for e in events[:-1]} == {100}
        assert [e["choices"][0]["delta"] for e in events[:2]] == [{"content": " serves"}, {}]
        assert events[-1] == "[DONE]"

    def test_usage_counts_prompt_once_and_every_token_received(self):
        """Prompt tokens less the carried text; completion tokens plus the carried ones."""
        events, seen = self.continued(wants_usage=True)
        assert events[-2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        assert seen == [(5, 3)]

    def test_usage_not_asked_is_kept_from_the_client(self):
        """A client that did not ask for the usage gets none (not even null fields), but it is counted."""
        events, seen = self.continued(wants_usage=False)
        assert all("usage" not in e for e in events[:-1]) and len(events) == 3
        assert seen == [(5, 3)]

    def test_the_role_goes_out_once(self):
        """A stream broken before its first event gets the continuing replica's role delta: once in all."""
        rewriter = Rewriter(Transcript().carried(), False, True, lambda p, c: None)
        upstream = sse(chat_chunk("chatcmpl-b", {"role": "assistant", "content": ""}), "[DONE]")
        assert payloads(rewriter.rewrite(upstream))[0]["choices"][0]["delta"]["role"] == "assistant"

    def test_text_not_in_prompt_is_not_taken_out(self):
        """A resent request (no text carried in the prompt) keeps its prompt tokens."""
        _, seen = self.continued(wants_usage=True, in_prompt=False)
        assert seen == [(7, 3)]


class TestContinuingReplicas:
    """The routes say which replicas continue; the balancer chooses among those for a continuation."""

    def test_route_reads_continues(self):
        """``continues`` comes through the routes document, False when absent (an older server)."""
        table = from_json(
            {
                "revision": 1,
                "routes": {
                    "m": [
                        {"replica": "a", "url": "http://h:1", "continues": True},
                        {"replica": "b", "url": "http://h:2"},
                    ]
                },
            },
            RouteTable,
        )
        assert [r.continues for r in table.routes["m"]] == [True, False]

    def test_only_continuing_replicas_are_chosen(self):
        """A continuation goes only to a replica that continues; none left gives None."""
        balancer = Balancer(routing="least-outstanding")
        balancer.update({"m": [Route("a", "http://h:1", True), Route("b", "http://h:2")]})
        a = balancer.replicas("m")[0]
        assert all(balancer.choose("m", 0.0, continuing=True) is a for _ in range(20))
        assert balancer.choose("m", 0.0, continuing=True, exclude=[a]) is None
