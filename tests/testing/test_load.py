"""The shared load generator counts every request: a 200 whose body is garbled is a failure, not lost."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from llmgw.testing.load import GatewayLoad
from llmgw.testing.processes import wait_until


class _Garbled(http.server.BaseHTTPRequestHandler):
    """A backend that answers every completion 200 with a body that is not a completion."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        streamed = json.loads(self.rfile.read(int(self.headers["content-length"])))["stream"]
        body = b"data: {not json\n\ndata: [DONE]\n\n" if streamed else b'{"choices": []}'
        self.send_response(200)
        self.send_header("content-type", "text/event-stream" if streamed else "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def garbled_backend() -> Iterator[str]:
    """The URL of a real HTTP server on 127.0.0.1 answering every completion with a garbled 200."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbled)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_garbled_200_counts_as_failed_streamed_or_not(garbled_backend):
    """Both a plain and a streamed client see garbled 200s: each is a failure, and the clients go on."""
    with GatewayLoad(garbled_backend, 2) as load:
        # every answer, not the first few: on a loaded machine one client may answer dozens of times
        # before the other's first answer ends (CI: the first 50 were all one client's)
        failed_kinds = lambda: {a.stream for a in list(load.answers) if a.failure}  # noqa: E731
        wait_until(lambda: failed_kinds() == {True, False}, 30, "a failure from each client")
        wait_until(lambda: load.counts()[1] >= 10, 10, "the clients to go on after a garbled answer")
    succeeded, failed = load.counts()
    assert succeeded == 0 and failed == len(load.answers) >= 10, load.report()
    assert all(f.startswith("chat: garbled answer: ") for f in load.failures), set(load.failures)
    assert all(thread.is_alive() is False for thread in load.threads)
