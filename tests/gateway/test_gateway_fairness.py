"""Every stream gets its turn: ``llmgw gateway`` as a process relaying paced streams beside bursting ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trio

from llmgw.gateway.relay import TURN_BYTES, turn_end
from llmgw.net.client import ConnectionPool
from llmgw.testing.gateway import FakeRoutesFeed, wait_healthy
from llmgw.testing.processes import free_port, processes  # noqa: F401

BACKEND = Path(__file__).with_name("streambackend.py")
#: seconds between two events of a paced stream
PACE = 0.02
PACED = 4
PACED_EVENTS = 60
BURSTING = 16
#: short token events per bursting stream: some 1.2 MB each, more than the paced streams' second
BURST_EVENTS = 24_000


class TestTurnEnd:
    """Where one turn of a large read of an event stream ends."""

    def test_after_the_last_whole_event_within_a_turn(self):
        """The turn ends after the last event that fits whole, wherever it begins."""
        event = b"data: " + b"x" * 94 + b"\n\n"
        data = event * (3 * TURN_BYTES // len(event))
        end = turn_end(data, 0)
        assert end == len(event) * (TURN_BYTES // len(event))
        assert turn_end(data, end) == 2 * end

    def test_an_event_longer_than_a_turn_is_cut_within_it(self):
        """An event longer than a turn goes on a turn's bytes at a time (the relay holds partial events)."""
        data = b"data: " + b"x" * (3 * TURN_BYTES) + b"\n\n"
        assert turn_end(data, 10) == 10 + TURN_BYTES


class TestTurns:
    """Streams relayed side by side by one gateway process."""

    async def test_paced_and_bursting_streams_each_arrive_whole(self, nursery, processes):  # noqa: F811
        """Streams paced at 20 ms beside 16 others bursting megabytes, relayed in bounded turns: every
        stream gets each of its events once. How long a paced stream waits between two events is a
        timing figure: ``bench/gateway.py --tokens-only`` prints the gaps (before the bounded turns a
        paced stream here waited 0.3 s and more, 15 paces, between two events; after, 0.06-0.15 s
        on the loaded 2-core machine; in a whole suite run on 3 workers, up to 0.5 s)."""
        backend_port, port = free_port(), free_port()
        processes.start([sys.executable, str(BACKEND), "--port", str(backend_port)], name="backend")
        feed = FakeRoutesFeed()
        feed_url = await nursery.start(feed.serve)
        feed.set(routes={"m": [("m-0", f"http://127.0.0.1:{backend_port}")]})
        argv = [sys.executable, "-m", "llmgw.gateway", "--server", feed_url, "--no-keys"]
        processes.start([*argv, "--listen", f"127.0.0.1:{port}"], name="gateway")
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with trio.fail_after(15):
            await wait_healthy([f"http://127.0.0.1:{port}", f"http://127.0.0.1:{backend_port}"])
        request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        #: the events each bursting stream received
        burst_events: list[int] = []
        #: the events each paced stream received
        paced_events: list[int] = []
        bursting_done = trio.Event()

        async with ConnectionPool(max_idle_per_host=PACED + BURSTING, read_timeout=30) as pool:

            async def paced() -> None:
                body = json.dumps({**request, "pace": PACE, "events": PACED_EVENTS}).encode()
                async with pool.stream("POST", url, body=body) as response:
                    assert response.status == 200
                    body = await response.read()
                paced_events.append(body.count(b"data: "))

            async def bursting() -> None:
                body = json.dumps({**request, "burst": BURST_EVENTS}).encode()
                async with pool.stream("POST", url, body=body) as response:
                    assert response.status == 200
                    answer = await response.read()
                assert answer.endswith(b"data: [DONE]\n\n")
                burst_events.append(answer.count(b"data: "))
                if len(burst_events) == BURSTING:
                    bursting_done.set()

            with trio.fail_after(120):
                async with trio.open_nursery() as streams:
                    for _ in range(PACED):
                        streams.start_soon(paced)
                    await trio.sleep(4 * PACE)  # the paced streams are under way when the bursts begin
                    for _ in range(BURSTING):
                        streams.start_soon(bursting)
                    await bursting_done.wait()
        # each event once, in turns cut at event boundaries: the role, the tokens, the end, [DONE]
        assert burst_events == [BURST_EVENTS + 3] * BURSTING
        assert paced_events == [PACED_EVENTS + 3] * PACED
