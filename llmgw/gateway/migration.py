"""Mid-stream migration: a stream whose replica broke goes on from another replica, in the same response.

When the upstream of a server-sent-events stream breaks after events went to
the client (the connection closed, nothing came within ``--upstream-timeout``,
the replica was found stalled or left the routes and went silent), the proxy
(:mod:`llmgw.gateway.proxy`) asks another replica for the rest of the answer:

- :class:`Transcript` keeps the events the client received (whole events
  only: the relay holds back a partial one), and reads them only when a
  stream broke (:meth:`Transcript.carried`);
- :func:`plan` rewrites the request: a chat gets its answer so far as a final
  assistant message with ``continue_final_message: true`` and
  ``add_generation_prompt: false`` (vLLM's and SGLang's names; llama.cpp
  continues a last assistant message by itself), a completion its text so
  far appended to the prompt; ``max_tokens`` (and ``max_completion_tokens``)
  less the tokens sent, and the usage always asked for;
- :class:`Rewriter` turns the new replica's events into the rest of the
  client's stream: the first response's ``id`` and ``created``, no second
  ``role`` delta, and the usage as if one replica had answered (prompt tokens
  once, completion tokens all those the client received).

A token is one event with text, as vLLM and SGLang stream by default (an
engine batching several tokens per event makes the carried count an
underestimate). A request is not continued, and its stream ends with an error
event as before, for one of the reasons of :class:`NotContinued`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import Any

import attrs

__all__ = [
    "MigrationCause",
    "NotContinued",
    "Carried",
    "FOLD_BYTES",
    "Plan",
    "Transcript",
    "Rewriter",
    "event_boundary",
    "plan",
]


class MigrationCause(enum.Enum):
    """Why a stream's replica stopped answering mid-way: the ``cause`` label of the migration metrics."""

    #: the connection closed or was reset (the engine died, or its node)
    CLOSED = "closed"
    #: nothing arrived within ``--upstream-timeout``
    TIMEOUT = "timeout"
    #: the replica was found stalled (``--stall-timeout``, :mod:`llmgw.gateway.stalls`)
    STALLED = "stalled"
    #: the replica left the routes (a drain, a removal) and sent nothing for the stall timeout
    LEFT_ROUTES = "left_routes"


class NotContinued(enum.Enum):
    """Why a broken stream was not continued and ended with an error event: the ``reason`` label."""

    #: ``--migration-limit 0``
    DISABLED = "disabled"
    #: the request was continued ``--migration-limit`` times already
    LIMIT = "limit"
    #: several choices (``n`` > 1)
    CHOICES = "choices"
    #: log probabilities asked for (a continuation cannot give those of the text carried over)
    LOGPROBS = "logprobs"
    #: the request cannot be rewritten: prompt token ids, ``echo``, structured output, tool calls in
    #: the answer so far, a body that is not a JSON object
    REQUEST = "request"
    #: no other replica of the model runs an engine version that continues a final assistant message
    ENGINE = "engine"
    #: no other replica of the model, or those that could continue it were all tried, out (open
    #: breaker), or failed
    NO_REPLICA = "no_replica"


#: request fields that constrain the whole answer (a grammar restarted mid-answer would break it)
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def event_boundary(data: bytes) -> int:
    """Where the last whole server-sent event in ``data`` ends (0: none is whole)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _events(data: bytes) -> list[bytes]:
    """The ``data:`` payloads of the whole events in ``data``."""
    lines = data.replace(b"\r\n", b"\n").split(b"\n")
    return [line[5:].strip() for line in lines if line.startswith(b"data:")]


def _parsed(payloads: list[bytes]) -> list[dict[str, Any]]:
    """The JSON objects among ``payloads`` (``[DONE]`` and anything else left out): read as one array,
    one C call for them all, or one by one when the array does not parse."""
    payloads = [p for p in payloads if p.startswith(b"{")]
    try:
        events = json.loads(b"[" + b",".join(payloads) + b"]")
    except ValueError:
        events = []
        for payload in payloads:
            try:
                events.append(json.loads(payload))
            except ValueError:
                continue
    return [event for event in events if isinstance(event, dict)]


@attrs.frozen
class Carried:
    """What a client received of a stream, read from its events."""

    #: the response's ``id`` and ``created`` (None until an event had them)
    id: str | None
    created: int | None
    #: the answer's text so far
    text: str
    #: events that carried text: the tokens sent
    tokens: int
    #: a choice ended (``finish_reason`` sent): nothing is left to generate
    finished: bool
    #: the answer so far holds tool calls (not text that can be continued)
    tool_calls: bool
    #: the ``role`` delta went out (a chat's first event): the continuing replica's is not sent again
    role_sent: bool = False


#: bytes of events a transcript keeps before it reads them into what they carried (bounding its memory:
#: a stream longer than this, some 450 events, pays about 3.5 µs of CPU per event for the reading). One
#: reading is one step of the relay's task, during which no other stream moves: 512 KiB took 20-100 ms
FOLD_BYTES = 64 * 1024
_NOTHING = Carried(None, None, "", 0, False, False)


class Transcript:
    """The whole events a stream sent its client, kept as bytes and read when it breaks (or, to bound
    its memory, each time :data:`FOLD_BYTES` of them piled up: then only what they carried is kept)."""

    __slots__ = ("_chunks", "_size", "_read")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        #: what the events read so far carried
        self._read = _NOTHING

    def add(self, events: bytes) -> None:
        """Keep ``events`` (whole events), as they go to the client."""
        self._chunks.append(events)
        self._size += len(events)
        if self._size > FOLD_BYTES:
            self._read = self.carried()
            self._chunks, self._size = [], 0

    def carried(self) -> Carried:
        """Read what the client received so far."""
        read = self._read
        id_, created = read.id, read.created
        text = [read.text]
        tokens, finished, tool_calls, role_sent = read.tokens, read.finished, read.tool_calls, read.role_sent
        for event in _parsed(_events(b"".join(self._chunks))):
            if id_ is None and "id" in event:
                id_, created = event["id"], event.get("created")
            for choice in event.get("choices") or ():
                delta = choice.get("delta")
                piece = (delta.get("content") if isinstance(delta, dict) else None) or choice.get("text")
                if isinstance(delta, dict):
                    tool_calls = tool_calls or bool(delta.get("tool_calls"))
                    role_sent = role_sent or "role" in delta
                if isinstance(piece, str) and piece:
                    text.append(piece)
                    tokens += 1
                finished = finished or choice.get("finish_reason") is not None
        return Carried(id_, created, "".join(text), tokens, finished, tool_calls, role_sent)


@attrs.frozen
class Plan:
    """How a broken stream goes on."""

    #: the request to send to another replica (None: nothing is left to generate, see :attr:`tail`)
    body: bytes | None
    #: the request's ``prompt_text`` basis, for prefix-aware routing (the rewritten request as a dict)
    request: dict[str, Any]
    #: the client asked for the usage (``stream_options.include_usage``)
    wants_usage: bool = False
    #: the events that end the stream when nothing is left to generate
    tail: bytes = b""


def plan(body: bytes, endpoint: str, carried: Carried) -> Plan | NotContinued:
    """The continuation of a stream broken after the client received ``carried``, or why there is none.

    Called by the proxy once per break, before choosing the replica to continue on.

    :param body: the client's request body.
    :param endpoint: ``chat/completions`` or ``completions``.
    """
    try:
        request = json.loads(body)
    except ValueError:
        return NotContinued.REQUEST
    if not isinstance(request, dict) or endpoint not in ("chat/completions", "completions"):
        return NotContinued.REQUEST
    if (request.get("n") or 1) != 1:
        return NotContinued.CHOICES
    if request.get("logprobs") or request.get("top_logprobs"):
        return NotContinued.LOGPROBS
    response_format = request.get("response_format")
    structured = isinstance(response_format, dict) and response_format.get("type") not in (None, "text")
    if structured or any(request.get(name) is not None for name in _STRUCTURED):
        return NotContinued.REQUEST
    if request.get("echo") or carried.tool_calls:
        return NotContinued.REQUEST
    limits = [name for name in ("max_tokens", "max_completion_tokens") if isinstance(request.get(name), int)]
    left = min((request[name] - carried.tokens for name in limits), default=None)
    options = request.get("stream_options")
    wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    if carried.finished or (left is not None and left <= 0):
        return Plan(None, request, wants_usage, _tail(carried))
    rewritten = dict(request)
    for name in limits:
        rewritten[name] = request[name] - carried.tokens
    rewritten["stream_options"] = {**(request.get("stream_options") or {}), "include_usage": True}
    if carried.text and endpoint == "chat/completions":
        messages = request.get("messages")
        if not isinstance(messages, list):
            return NotContinued.REQUEST
        rewritten["messages"] = [*messages, {"role": "assistant", "content": carried.text}]
        rewritten["continue_final_message"] = True
        rewritten["add_generation_prompt"] = False
    elif carried.text:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return NotContinued.REQUEST
        rewritten["prompt"] = prompt + carried.text
    return Plan(json.dumps(rewritten).encode(), rewritten, wants_usage)


def _tail(carried: Carried) -> bytes:
    """The end of a stream whose answer is whole or at ``max_tokens``: its last choice event if it was
    not sent, then ``[DONE]``."""
    if carried.finished or carried.id is None:
        return b"data: [DONE]\n\n"
    chat = carried.id.startswith("chatcmpl")
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    choice.update({"delta": {}} if chat else {"text": ""})
    kind = "chat.completion.chunk" if chat else "text_completion"
    event = {"id": carried.id, "object": kind, "created": carried.created, "choices": [choice]}
    return b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"


class Rewriter:
    """Turns a continuing replica's events into the rest of the client's stream.

    :param carried: what the client had received when the stream broke.
    :param in_prompt: whether the text carried went into the continuation's prompt (its tokens are
        counted there by the engine, and taken out of the usage's prompt tokens).
    :param wants_usage: the client asked for the usage (``stream_options.include_usage``); if not,
        the usage event is kept from it and read into :attr:`usage` only.
    :param on_usage: called with each (prompt, completion) usage as the client should see it.
    """

    __slots__ = ("_carried", "_in_prompt", "_wants_usage", "_on_usage")

    def __init__(
        self, carried: Carried, in_prompt: bool, wants_usage: bool, on_usage: Callable[[int, int], None]
    ) -> None:
        self._carried = carried
        self._in_prompt = carried.tokens if in_prompt else 0
        self._wants_usage = wants_usage
        self._on_usage = on_usage

    def rewrite(self, events: bytes) -> bytes:
        """The client's events for the replica's whole ``events``."""
        out = []
        for payload in _events(events):
            if payload == b"[DONE]":
                out.append(b"data: [DONE]\n\n")
                continue
            try:
                event = json.loads(payload)
            except ValueError:
                out.append(b"data: " + payload + b"\n\n")
                continue
            event = self._event(event) if isinstance(event, dict) else event
            if event is not None:
                out.append(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
        return b"".join(out)

    def _event(self, event: dict[str, Any]) -> dict[str, Any] | None:
        carried = self._carried
        if carried.id is not None:
            event["id"] = carried.id
        if carried.created is not None:
            event["created"] = carried.created
        choices = event.get("choices")
        if isinstance(choices, list) and choices and carried.role_sent:
            kept = [choice for choice in choices if not _only_role(choice)]
            for choice in kept:
                delta = choice.get("delta")
                if isinstance(delta, dict):
                    delta.pop("role", None)
            if not kept and not event.get("usage"):
                return None
            event["choices"] = kept
        usage = event.get("usage")
        if isinstance(usage, dict) and "prompt_tokens" in usage:
            prompt = max(0, int(usage["prompt_tokens"]) - self._in_prompt)
            completion = int(usage.get("completion_tokens") or 0) + carried.tokens
            usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
            self._on_usage(prompt, completion)
            if not self._wants_usage:
                if not event.get("choices"):
                    return None
                del event["usage"]
        elif "usage" in event and not self._wants_usage:
            del event["usage"]
        return event


def _only_role(choice: Any) -> bool:
    """A choice whose delta announces the role and carries nothing else (sent once, at the start)."""
    if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
        return False
    delta = choice.get("delta")
    if not isinstance(delta, dict) or "role" not in delta:
        return False
    return not delta.get("content") and not delta.get("tool_calls")
