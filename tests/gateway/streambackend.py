"""A replica for the relay's fairness test: streams at a fixed pace, and bursts as fast as the reader takes.

Run as ``python streambackend.py --port N``. An asyncio server answering every
``POST`` with a chat completion stream: a body with ``"pace": SECONDS`` and
``"events": N`` gets N token events, one every SECONDS; a body with
``"burst": N`` gets N short token events written 512 to a write, as fast as
the connection takes them (so that the gateway always has a large read
waiting on it). ``GET`` answers 200 (health).
"""

from __future__ import annotations

import argparse
import asyncio
import json

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_EVENT = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,%s}]}\n\n'
_ROLE = _EVENT % b'"delta":{"role":"assistant"}'
_TOKEN = _EVENT % b'"delta":{"content":"t"}'
_END = _EVENT % b'"delta":{},"finish_reason":"stop"' + b"data: [DONE]\n\n"
#: events per write of a burst
_PER_WRITE = 512


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = json.loads(await reader.readexactly(length)) if length else {}
            if not head.startswith(b"POST"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                continue
            writer.write(_HEAD + _chunk(_ROLE))
            if "burst" in body:
                left = int(body["burst"])
                while left > 0:
                    count = min(left, _PER_WRITE)
                    writer.write(_chunk(_TOKEN * count))
                    left -= count
                    await writer.drain()
            else:
                for _ in range(int(body["events"])):
                    await writer.drain()
                    await asyncio.sleep(float(body["pace"]))
                    writer.write(_chunk(_TOKEN))
            writer.write(_chunk(_END) + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(host: str, port: int) -> None:
    """Serve until killed."""
    server = await asyncio.start_server(_serve, host, port, backlog=256)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(main(args.host, args.port))
