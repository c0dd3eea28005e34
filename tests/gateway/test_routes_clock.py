"""The gateway's routes watcher (long-poll, outage, retry), driven by trio's autojump clock.

The watcher reads only trio's clock; its pool here answers from memory, so a silent server's
request timeout and the retries after it pass in no real time.
"""

from __future__ import annotations

import json

import pytest
import trio

from llmgw.gateway.routes import RoutesWatcher, RouteTable
from llmgw.testing.processes import wait_for

REQUEST_TIMEOUT = 40.0
RETRY_INTERVAL = 2.0
POLL_TIMEOUT = 20.0


class Answer:
    """The server's JSON answer, as the pool's ``ClientResponse`` gives it."""

    def __init__(self, document: dict) -> None:
        self.status = 200
        self.content = json.dumps(document).encode()

    def json(self) -> dict:
        return json.loads(self.content)


class Feed:
    """The routes feed without sockets, with the server's long-poll; never answers while ``silent``."""

    def __init__(self) -> None:
        self.revision = 1
        self.silent = False
        self._changed = trio.Event()
        #: (trio time, URL) of every poll
        self.polls: list[tuple[float, str]] = []

    def set(self, revision: int) -> None:
        """Move to ``revision`` and answer the waiting polls."""
        self.revision = revision
        self._changed.set()
        self._changed = trio.Event()

    async def request(self, method: str, url: str, *, headers=()) -> Answer:
        self.polls.append((trio.current_time(), url))
        if self.silent:
            await trio.sleep_forever()
        if url.endswith(f"revision={self.revision}&wait=1"):
            with trio.move_on_after(POLL_TIMEOUT):
                await self._changed.wait()
        await trio.lowlevel.checkpoint()
        return Answer({"revision": self.revision, "models": ["m"], "routes": {}})


@pytest.fixture
async def watched(nursery) -> tuple[RoutesWatcher, Feed, list[RouteTable]]:
    """A watcher polling a :class:`Feed`, and the tables it handed on."""
    feed, tables = Feed(), []
    watcher = RoutesWatcher(
        feed,
        "https://server:7443",
        tables.append,
        request_timeout=REQUEST_TIMEOUT,
        retry_interval=RETRY_INTERVAL,
    )
    await nursery.start(watcher.run)
    return watcher, feed, tables


async def test_first_answer_then_long_polls_with_the_known_revision(watched, autojump_clock):
    """The first poll asks for the table at once; the next ones wait on the revision they have."""
    watcher, feed, tables = watched
    await trio.testing.wait_all_tasks_blocked()
    assert [t.revision for t in tables] == [1] and watcher.up
    assert feed.polls[0][1].endswith("revision=0&wait=0")
    assert feed.polls[-1][1].endswith("revision=1&wait=1")


async def test_silent_server_is_an_outage_after_the_request_timeout(watched, autojump_clock):
    """A poll never answered ends after request_timeout: the watcher is down and keeps its last table."""
    watcher, feed, tables = watched
    await trio.testing.wait_all_tasks_blocked()
    feed.silent = True
    feed.set(2)  # the poll in progress answers; the next one gets no answer
    await trio.testing.wait_all_tasks_blocked()
    assert tables[-1].revision == 2
    await trio.sleep(REQUEST_TIMEOUT - 1)
    assert watcher.up
    await trio.sleep(2)
    assert not watcher.up and watcher.table is not None and watcher.table.revision == 2
    assert watcher.age() == pytest.approx(REQUEST_TIMEOUT + 1, abs=0.1)


async def test_retries_after_an_outage_every_retry_interval(watched, autojump_clock):
    """While the server is silent, polls are spaced by request_timeout plus a jittered retry_interval."""
    watcher, feed, tables = watched
    await trio.testing.wait_all_tasks_blocked()
    feed.silent = True
    feed.set(2)
    await trio.sleep(5 * (REQUEST_TIMEOUT + RETRY_INTERVAL))
    times = [at for at, url in feed.polls if url.endswith("wait=0")]
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    assert len(gaps) >= 3
    assert all(
        REQUEST_TIMEOUT + 0.8 * RETRY_INTERVAL <= gap <= REQUEST_TIMEOUT + 1.2 * RETRY_INTERVAL
        for gap in gaps
    )
    feed.silent = False
    feed.set(3)
    with trio.fail_after(REQUEST_TIMEOUT + 2 * RETRY_INTERVAL):
        await wait_for(lambda: watcher.up, "the watcher to be up again")
    assert tables[-1].revision == 3


async def test_a_server_that_falls_silent_after_its_poll_timeouts_is_left_sooner(nursery, autojump_clock):
    """Once long-polls came back unchanged after POLL_TIMEOUT, a server silent past twice that (plus 2 s)
    is an outage then, not after the whole request timeout (a paused server left the gateway on stale
    routes for 30 s)."""
    feed = Feed()
    watcher = RoutesWatcher(feed, "https://server:7443", lambda table: None, request_timeout=100.0)
    await nursery.start(watcher.run)
    assert watcher.poll_limit() == 100.0
    await trio.sleep(POLL_TIMEOUT + 1)  # one long-poll answered unchanged, after the server's wait
    assert watcher.poll_limit() == pytest.approx(2 * POLL_TIMEOUT + 2, abs=0.1)
    feed.silent = True
    silent_from = trio.current_time()
    await wait_for(lambda: not watcher.up, "the watcher to give up on the silent server")
    assert trio.current_time() - silent_from <= 2 * (2 * POLL_TIMEOUT + 2)
    assert trio.current_time() - silent_from < 100.0


async def test_the_outage_line_names_the_silent_server_not_the_next(nursery, autojump_clock, caplog):
    """With two servers, a silent first one is named in the outage warning (the watcher has moved on to
    the second by the time it writes it: the line named the second, which nemesis seed 707 showed)."""
    feed = Feed()
    watcher = RoutesWatcher(
        feed, "https://a:7443,https://b:7443", lambda table: None, request_timeout=REQUEST_TIMEOUT
    )
    await nursery.start(watcher.run)
    await trio.testing.wait_all_tasks_blocked()
    first = watcher.server
    feed.silent = True
    feed.set(2)
    with caplog.at_level("WARNING", logger="llmgw.gateway"):
        await wait_for(lambda: not watcher.up, "the watcher to give up on the silent server")
    [line] = [r.getMessage() for r in caplog.records if "cannot read routes" in r.getMessage()]
    assert line.startswith(f"cannot read routes from {first}:"), line
    assert watcher.server != first, "it asks the other server next"
