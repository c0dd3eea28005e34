"""A fixed-body OpenAI-shaped backend, faster than the gateway, for ``bench/gateway.py``.

Run as ``python bench/fastbackend.py --port N``. An asyncio server with the
``httptools`` parser (llhttp, as in uvicorn) that answers every
``POST /v1/chat/completions`` with the same small completion (or, when the
body says ``"stream": true``, the same four server-sent events, one chunk
each; a body with ``"bench_events": N`` gets N token events, each its own
write, as an engine streams tokens), and ``GET /health`` with 200. Keep-alive,
no logging. It exists so that
the gateway's own cost shows: a backend slower than the gateway (the sim)
hides it.
"""

from __future__ import annotations

import asyncio
import json
import re

import httptools

from llmgw.testing.sse_backend import (
    DONE,
    HEALTHY,
    LAST_CHUNK,
    STREAM_HEAD,
    backend_parser,
    chunk,
    event,
    serve_forever,
)

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    },
    separators=(",", ":"),
).encode()
_PLAIN = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(_COMPLETION)
    + _COMPLETION
)
_EVENTS = [
    event(b'"delta":{"role":"assistant"},"finish_reason":null'),
    event(b'"delta":{"content":"ok"},"finish_reason":null'),
    event(b'"delta":{},"finish_reason":"stop"'),
    DONE,
]
#: one token event of a ``bench_events`` stream
_TOKEN = event(b'"delta":{"content":" tok"},"finish_reason":null')


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_begin(self) -> None:
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.parser.get_method() != b"POST":
            self.transport.write(HEALTHY)
            return
        body = b"".join(self.body)
        events = re.search(rb'"bench_events":\s*(\d{1,6})', body)
        if events is not None:
            asyncio.get_running_loop().create_task(self._tokens(int(events.group(1))))
        elif b'"stream":true' in body or b'"stream": true' in body:
            asyncio.get_running_loop().create_task(self._stream())
        else:
            self.transport.write(_PLAIN)

    async def _stream(self) -> None:
        transport = self.transport
        transport.write(STREAM_HEAD + chunk(_EVENTS[0]))
        for sent in _EVENTS[1:]:
            await asyncio.sleep(0)  # each event in its own write, as an engine sends them
            if transport.is_closing():
                return
            transport.write(chunk(sent))
        transport.write(LAST_CHUNK)

    async def _tokens(self, count: int) -> None:
        """A stream of ``count`` token events, each its own write, between the role and the end."""
        transport = self.transport
        transport.write(STREAM_HEAD + chunk(_EVENTS[0]))
        for _ in range(count):
            await asyncio.sleep(0)  # each token in its own write, as an engine sends them
            if transport.is_closing():
                return
            transport.write(chunk(_TOKEN))
        transport.write(chunk(_EVENTS[2] + _EVENTS[3]) + LAST_CHUNK)


async def asgi_app(scope: dict, receive, send) -> None:
    """The same answers as an ASGI app, for ``--uvicorn`` (the backend the gateway issue was measured on)."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["method"] != "POST":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    elif b'"stream":true' in body or b'"stream": true' in body:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for event in _EVENTS:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    else:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_COMPLETION))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": _COMPLETION})


async def serve(host: str, port: int) -> None:
    """Serve until cancelled."""
    loop = asyncio.get_running_loop()
    await serve_forever(loop.create_server(_Protocol, host, port, backlog=1024))


if __name__ == "__main__":
    parser = backend_parser(__doc__)
    parser.add_argument("--uvicorn", action="store_true", help="serve with uvicorn (httptools) instead")
    args = parser.parse_args()
    if args.uvicorn:
        import uvicorn

        uvicorn.run(
            asgi_app,
            host=args.host,
            port=args.port,
            http="httptools",
            loop="asyncio",
            log_level="error",
            access_log=False,
        )
    else:
        asyncio.run(serve(args.host, args.port))
