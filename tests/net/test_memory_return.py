"""An HTTP server gives the memory of large bodies back to the system once they are answered."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import trio

from llmgw.testing.processes import free_port, processes, wait_for  # noqa: F401

#: a real llmgw HTTP server in a process of its own, answering each POST with its body's length
SERVER = """
import sys, trio
from llmgw.net.server import HttpServer, Limits, Response

async def handler(request):
    return Response.json(200, {"length": len(request.body)})

async def main(port):
    server = HttpServer(handler, limits=Limits(max_body_bytes=64 << 20))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, "127.0.0.1", port)
        print("listening", file=sys.stderr, flush=True)

trio.run(main, int(sys.argv[1]))
"""
BODY_MIB = 24
BODIES = 6


def rss(pid: int) -> int:
    """The resident memory of ``pid`` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def test_large_bodies_are_given_back(processes):  # noqa: F811
    """Six 24 MiB bodies at once raise the server's RSS; within seconds it is back near where it began."""
    port = free_port()
    server = processes.start([sys.executable, "-c", SERVER, str(port)], name="http-server")
    await server.wait_for_stderr_trio("listening")
    url = f"http://127.0.0.1:{port}"
    body = b"x" * (BODY_MIB << 20)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        assert (await client.post("/", content=b"warm")).status_code == 200
        before = rss(server.pid)
        peak = before

        async def send() -> None:
            nonlocal peak
            response = await client.post("/", content=body)
            assert response.json() == {"length": len(body)}
            peak = max(peak, rss(server.pid))

        async with trio.open_nursery() as nursery:
            for _ in range(BODIES):
                nursery.start_soon(send)
    assert peak - before > BODY_MIB << 20, "the bodies never raised the server's memory: nothing to check"
    with trio.fail_after(20):
        await wait_for(
            lambda: rss(server.pid) < before + (16 << 20),
            f"the server's RSS back within 16 MiB of {before >> 20} MiB (peak {peak >> 20} MiB)",
            server,
        )
