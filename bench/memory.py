"""Memory given back after abuse: the gateway after huge bodies, the server after many idle connections.

Run with ``python bench/memory.py`` (two to three minutes on a loaded machine). Two cases, each a
real process of its own:

- ``gateway``: ``llmgw gateway --no-keys`` in front of ``bench/fastbackend.py`` (routes from an
  in-process fake feed) is sent eight chat completions of 31 MiB each, all at once;
- ``server``: ``llmgw server`` (sqlite, mutual TLS) gets 2,000 connections from an admin certificate, each
  answered one ``GET /v1/admin/nodes`` and then left idle; then all are closed.

For each it prints the process's resident memory (``VmRSS``) before, at its peak (``VmHWM``) and a few
seconds after the abuse ended, with the ratios of peak and after to before. ``--bodies``, ``--body-mib``
and ``--connections`` change the abuse.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

from llmgw import pki
from llmgw.testing.gateway import FakeRoutesFeed, wait_healthy
from llmgw.testing.processes import ManagedProcess, free_port, start

HERE = Path(__file__).resolve().parent
#: how long the process is left alone before "after" is read
SETTLE = 3.0


def memory(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak) of ``pid`` in bytes, from ``/proc/PID/status``."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def reset_peak(pid: int) -> None:
    """Make ``VmHWM`` start again from the current RSS (``/proc/PID/clear_refs`` with 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def llmgw_argv(*args: str) -> list[str]:
    """The ``llmgw`` command of this environment."""
    return [shutil.which("llmgw", path=str(Path(sys.executable).parent)) or "llmgw", *args]


async def gateway_case(logs: Path, bodies: int, body_mib: int) -> tuple[int, int, int]:
    """(before, peak, after) RSS of a gateway sent ``bodies`` bodies of ``body_mib`` MiB at once."""
    started: list[ManagedProcess] = []
    try:
        async with trio.open_nursery() as nursery:
            feed = FakeRoutesFeed()
            feed_url = await nursery.start(feed.serve)
            backend_port, gateway_port = free_port(), free_port()
            backend = start([sys.executable, str(HERE / "fastbackend.py"), "--port", str(backend_port)],
                            name="backend", log_dir=logs)  # fmt: skip
            started.append(backend)
            feed.set(routes={"m": [("m-0", f"http://127.0.0.1:{backend_port}")]})
            argv = [sys.executable, "-m", "llmgw.gateway", "--server", feed_url, "--no-keys"]
            gateway = start([*argv, "--listen", f"127.0.0.1:{gateway_port}"], name="gateway", log_dir=logs)
            started.append(gateway)
            url = f"http://127.0.0.1:{gateway_port}"
            with trio.fail_after(30):
                await wait_healthy([url, f"http://127.0.0.1:{backend_port}"])
            small = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            huge = json.dumps({**small, "messages": [{"role": "user", "content": "x" * (body_mib << 20)}]})
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                for _ in range(3):  # warm up: connections, imports, caches
                    (await client.post("/v1/chat/completions", json=small)).raise_for_status()
                await trio.sleep(SETTLE)
                before = memory(gateway.pid)["VmRSS"]
                reset_peak(gateway.pid)

                statuses: list[int] = []

                async def send() -> None:
                    response = await client.post(
                        "/v1/chat/completions", content=huge, headers={"content-type": "application/json"}
                    )
                    statuses.append(response.status_code)  # past --max-buffered-bytes: 503, as it should

                async with trio.open_nursery() as senders:
                    for _ in range(bodies):
                        senders.start_soon(send)
                (await client.post("/v1/chat/completions", json=small)).raise_for_status()
            print(f"  gateway answered the bodies: {', '.join(map(str, sorted(statuses)))}")
            await trio.sleep(SETTLE)
            reading = memory(gateway.pid)
            nursery.cancel_scope.cancel()
        return before, reading["VmHWM"], reading["VmRSS"]
    finally:
        for process in started:
            process.kill_group()


async def server_case(logs: Path, connections: int) -> tuple[int, int, int]:
    """(before, peak, after) RSS of a server that served ``connections`` idle connections, then lost them."""
    root = logs / "pki"
    ca = pki.init_ca(root / "ca")
    server_tls = pki.issue_server(ca, ["127.0.0.1"], out=root / "server")
    admin = pki.issue_admin(ca, "bench", out=root / "admin")
    port = free_port()
    argv = llmgw_argv(
        "server", "--state-dir", str(logs / "state"), "--listen", f"127.0.0.1:{port}",
        "--cert", str(server_tls.cert_path), "--key", str(server_tls.key_path), "--ca", str(ca.cert_path),
    )  # fmt: skip
    server = start(argv, name="server", log_dir=logs)
    try:
        context = pki.client_ssl_context(admin.cert_path, admin.key_path, ca.cert_path)
        url = f"https://127.0.0.1:{port}"
        async with httpx.AsyncClient(verify=context, timeout=10) as client:
            with trio.fail_after(60):
                while True:
                    try:
                        if (await client.get(f"{url}/v1/admin/nodes")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.2)
        await trio.sleep(SETTLE)
        before = memory(server.pid)["VmRSS"]
        reset_peak(server.pid)
        streams: list[trio.SSLStream] = []
        request = b"GET /v1/admin/nodes HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"

        async def connect(limiter: trio.CapacityLimiter) -> None:
            async with limiter:
                stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=context)
                await stream.send_all(request)
                answer = b""
                while b"\r\n\r\n" not in answer:
                    answer += await stream.receive_some(65536)
                streams.append(stream)

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                limiter = trio.CapacityLimiter(32)
                for _ in range(connections):
                    nursery.start_soon(connect, limiter)
        idle = memory(server.pid)
        for stream in streams:
            await trio.aclose_forcefully(stream)
        await trio.sleep(SETTLE)
        after = memory(server.pid)
        print(f"  server with {len(streams)} idle connections open: {idle['VmRSS'] / 1e6:.0f} MB")
        return before, after["VmHWM"], after["VmRSS"]
    finally:
        server.kill_group()


def line(case: str, figures: tuple[int, int, int]) -> str:
    """One row of the report."""
    before, peak, after = figures
    return (
        f"{case:<36} {before / 1e6:>7.0f} MB {peak / 1e6:>7.0f} MB ({peak / before:4.2f}x) "
        f"{after / 1e6:>7.0f} MB ({after / before:4.2f}x)"
    )


async def main(bodies: int, body_mib: int, connections: int) -> None:
    logs = Path(tempfile.mkdtemp(prefix="llmgw-bench-memory-"))
    print(f"{'case':<36} {'before':>10} {'peak':>18} {'after':>18}")
    gateway = await gateway_case(logs, bodies, body_mib)
    print(line(f"gateway, {bodies} bodies of {body_mib} MiB", gateway), flush=True)
    server = await server_case(logs, connections)
    print(line(f"server, {connections} idle connections", server))
    print(f"(after: {SETTLE:g} s after the abuse ended; logs in {logs})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bodies", type=int, default=8)
    parser.add_argument("--body-mib", type=int, default=31)
    parser.add_argument("--connections", type=int, default=2000)
    args = parser.parse_args()
    started = time.monotonic()
    trio.run(main, args.bodies, args.body_mib, args.connections)
    print(f"took {time.monotonic() - started:.0f} s")
