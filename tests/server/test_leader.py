"""The leader's lease in PostgreSQL: one holder at a time, epochs, and the fence on every write."""

from __future__ import annotations

import time

import pytest
import trio

from llmgw.server.ha.lease import Lease, LostLease, NotLeader
from llmgw.server.persist.lease import CHANNEL
from llmgw.server.persist.postgres import open_pg_store
from llmgw.server.persist.sqlite import Store, StoreError
from llmgw.testing.processes import wait_for


@pytest.fixture
def store(pg_url):
    """A PostgreSQL store on a new database."""
    opened = open_pg_store(pg_url)
    try:
        yield opened
    finally:
        opened.close()


async def count_events(store) -> int:
    return await store.run(lambda c: c.execute("SELECT count(*) FROM events").fetchone()[0])


async def test_one_holder_at_a_time_and_each_takeover_raises_the_epoch(store):
    """While A's lease runs, B cannot take it; once it expired, B takes it with the next epoch."""
    a, b = Lease(store.connect, "https://a", 0.5), Lease(store.connect, "https://b", 0.5)
    try:
        previous = await a.acquire()
        assert previous.holder == "" and a.epoch == 1
        assert await b._in_thread(b._try_acquire) is None
        assert b.seen.address == "https://a" and b.seen.epoch == 1
        with trio.fail_after(5):
            previous = await b.acquire()
        assert (previous.address, previous.epoch, b.epoch) == ("https://a", 1, 2)
        assert not await a._in_thread(a._renew), "A's renewal after the takeover is refused"
    finally:
        a.close()
        b.close()


async def test_write_of_a_superseded_epoch_is_refused_by_the_database(store, pg_url):
    """A leader whose own clock still trusts its lease (its deadline) is refused by the row: nothing lands."""
    a, b = Lease(store.connect, "https://a", 0.5), Lease(store.connect, "https://b", 0.5)
    store.before_write = a.fence
    try:
        await a.acquire()
        await store.write(lambda c: Store.add_event(c, "test", "a", "while leading"))
        with trio.fail_after(5):
            await b.acquire()
        a.deadline = time.monotonic() + 60  # as if A's clock had not seen the time pass
        with pytest.raises(NotLeader, match="the lease of epoch 1 is over .* holds epoch 2"):
            await store.write(lambda c: Store.add_event(c, "test", "a", "after the takeover"))
        assert await count_events(store) == 1
    finally:
        a.close()
        b.close()


async def test_leader_past_its_local_deadline_does_not_even_ask(store):
    """A leader past its own deadline (it was paused) refuses its writes itself, naming how late it is."""
    a = Lease(store.connect, "https://a", 30)
    store.before_write = a.fence
    try:
        await a.acquire()
        a.deadline = time.monotonic() - 2
        with pytest.raises(NotLeader, match=r"ran out 2\.\d s ago; not writing"):
            await store.write(lambda c: Store.add_event(c, "test", "a", "late"))
        assert await count_events(store) == 0
    finally:
        a.close()


async def test_released_lease_wakes_a_standby_at_once(store):
    """A leader that stops lets go: a standby waiting on a 60 s lease (read again every 12 s) leads at once,
    woken by the leader's NOTIFY."""
    a, b = Lease(store.connect, "https://a", 60), Lease(store.connect, "https://b", 60)

    def standby_listens(conn) -> bool:
        query = f"SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' AND query = 'LISTEN {CHANNEL}'"
        return conn.execute(query).fetchone()[0] == 1

    try:
        await a.acquire()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.acquire)
            with trio.fail_after(10):
                await wait_for(lambda: store.run(standby_listens), "the standby to listen for the leader")
            started = trio.current_time()
            await a.release()
        assert b.epoch == 2 and trio.current_time() - started < 3, "the standby waited for its next read"
    finally:
        a.close()
        b.close()


async def test_leader_that_cannot_renew_says_so_not_that_it_was_paused(store):
    """A leader whose renewals fail (the database unreachable) steps down naming the error, not a pause."""
    a = Lease(store.connect, "https://a", 0.6)
    try:
        await a.acquire()

        def unreachable():
            raise StoreError("postgresql://llmgw@db/llmgw: cannot connect to PostgreSQL: connection refused")

        a._connect = unreachable
        a._drop_connection()
        with trio.fail_after(5), pytest.raises(LostLease) as lost:
            await a.keep()
        message = str(lost.value)
        assert "could not be renewed for" in message and "connection refused" in message, message
        assert "paused" not in message
    finally:
        a.close()
