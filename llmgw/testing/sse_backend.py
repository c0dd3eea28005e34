"""Fake engines written straight on asyncio sockets: chunked server-sent events, the command line they run by.

For backends that must be faster than the gateway (``bench/fastbackend.py``) or write exactly what a test
asks (``tests/gateway/streambackend.py``), with no HTTP library between them and the socket::

    writer.write(STREAM_HEAD + chunk(event(b'"delta":{"role":"assistant"}')))
    ...
    writer.write(chunk(event(b'"delta":{},"finish_reason":"stop"') + DONE) + LAST_CHUNK)

    if __name__ == "__main__":
        args = backend_parser(__doc__).parse_args()
        asyncio.run(serve_forever(asyncio.start_server(handle, args.host, args.port)))
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable

__all__ = [
    "DONE", "HEALTHY", "LAST_CHUNK", "STREAM_HEAD", "backend_parser", "chunk", "event", "serve_forever",
]

#: the head of a 200 answer streaming events in chunks
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
#: a whole empty 200 answer (what ``GET /health`` gets)
HEALTHY = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
#: the chunk that ends a chunked body
LAST_CHUNK = b"0\r\n\r\n"
#: the event that ends an OpenAI stream
DONE = b"data: [DONE]\n\n"


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(choice: bytes, completion_id: bytes = b"chatcmpl-bench") -> bytes:
    """One chat completion chunk event whose only choice (index 0) has the fields ``choice`` (JSON, no
    braces: ``b'"delta":{"content":"t"},"finish_reason":null'``)."""
    return (
        b'data: {"id":"%s","object":"chat.completion.chunk","choices":[{"index":0,%s}]}\n\n'
        % (completion_id, choice)
    )


def backend_parser(doc: str) -> argparse.ArgumentParser:
    """The flags of a fake backend's command line, ``--host`` (default 127.0.0.1) and ``--port``, described
    by the first line of its module's ``doc``; it may add its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    return parser


async def serve_forever(starting: Awaitable[asyncio.Server]) -> None:
    """Serve with the server ``starting`` gives until cancelled or killed."""
    server = await starting
    async with server:
        await server.serve_forever()
