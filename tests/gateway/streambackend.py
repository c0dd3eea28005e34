"""A replica for the relay's fairness test: streams at a fixed pace, and bursts as fast as the reader takes.

Run as ``python streambackend.py --port N``. An asyncio server answering every
``POST`` with a chat completion stream: a body with ``"pace": SECONDS`` and
``"events": N`` gets N token events, one every SECONDS; a body with
``"burst": N`` gets N short token events written 512 to a write, as fast as
the connection takes them (so that the gateway always has a large read
waiting on it). ``GET`` answers 200 (health).
"""

from __future__ import annotations

import asyncio
import json

from llmgw.testing import sse_backend as sse

_ROLE = sse.event(b'"delta":{"role":"assistant"}', b"c")
_TOKEN = sse.event(b'"delta":{"content":"t"}', b"c")
_END = sse.event(b'"delta":{},"finish_reason":"stop"', b"c") + sse.DONE
#: events per write of a burst
_PER_WRITE = 512


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
                writer.write(sse.HEALTHY)
                continue
            writer.write(sse.STREAM_HEAD + sse.chunk(_ROLE))
            if "burst" in body:
                left = int(body["burst"])
                while left > 0:
                    count = min(left, _PER_WRITE)
                    writer.write(sse.chunk(_TOKEN * count))
                    left -= count
                    await writer.drain()
            else:
                for _ in range(int(body["events"])):
                    await writer.drain()
                    await asyncio.sleep(float(body["pace"]))
                    writer.write(sse.chunk(_TOKEN))
            writer.write(sse.chunk(_END) + sse.LAST_CHUNK)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


if __name__ == "__main__":
    args = sse.backend_parser(__doc__).parse_args()
    asyncio.run(sse.serve_forever(asyncio.start_server(_serve, args.host, args.port, backlog=256)))
