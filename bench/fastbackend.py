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

import argparse
import asyncio
import json
import re

import httptools

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
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
    + delta
    + b',"finish_reason":'
    + finish
    + b"}]}\n\n"
    for delta, finish in (
        (b'{"role":"assistant"}', b"null"),
        (b'{"content":"ok"}', b"null"),
        (b"{}", b'"stop"'),
    )
] + [b"data: [DONE]\n\n"]
#: one token event of a ``bench_events`` stream
_TOKEN = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
    b'{"content":" tok"},"finish_reason":null}]}\n\n'
)
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


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
            self.transport.write(_HEALTH)
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
        transport.write(_STREAM_HEAD + _chunk(_EVENTS[0]))
        for event in _EVENTS[1:]:
            await asyncio.sleep(0)  # each event in its own write, as an engine sends them
            if transport.is_closing():
                return
            transport.write(_chunk(event))
        transport.write(b"0\r\n\r\n")

    async def _tokens(self, count: int) -> None:
        """A stream of ``count`` token events, each its own write, between the role and the end."""
        transport = self.transport
        transport.write(_STREAM_HEAD + _chunk(_EVENTS[0]))
        for _ in range(count):
            await asyncio.sleep(0)  # each token in its own write, as an engine sends them
            if transport.is_closing():
                return
            transport.write(_chunk(_TOKEN))
        transport.write(_chunk(_EVENTS[2] + _EVENTS[3]) + b"0\r\n\r\n")


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
    server = await asyncio.get_running_loop().create_server(_Protocol, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
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
