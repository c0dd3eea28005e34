"""Several servers on one PostgreSQL database, one leader: the lease, its fencing epoch, the step-down.

The lease is the row ``leader`` (id 1): who holds it, under which epoch, and
until when, on the database's clock (``clock_timestamp()``), so no server's
own clock decides. Servers starting on a new database insert the row (one
insert lands) and lock it, so exactly one of them takes epoch 1. A standby
takes an expired lease by raising the epoch; the
leader renews it every third of its length from its own connection. Every
write of the leader runs :meth:`Lease.fence` first, in the write's
transaction: it takes the row ``FOR SHARE`` and refuses the write unless the
row still names this server and its epoch and the lease has not expired, so a leader that
was paused past its lease (SIGSTOP, a long GC, a partition) cannot write when
it resumes: it notices (:class:`NotLeader`) and steps down. A takeover waits
for the row's share lock, so no write of the old epoch lands after a new one
begins; a leader stopped inside a transaction is cut off by the database
after ``idle_in_transaction_session_timeout`` (the lease's length).

``NOTIFY llmgw_leader`` on release only wakes standbys early; they poll the
row anyway. Meanwhile a standby answers reads from the store
(:mod:`llmgw.server.ha.standby`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio

from llmgw.errors import LlmgwError
from llmgw.net.server import Response
from llmgw.server.persist import lease as queries
from llmgw.server.persist.postgres import connection_error, lock_busy
from llmgw.server.persist.sqlite import Store, StoreError
from llmgw.server.state.records import EventKind
from llmgw.serverlist import LEADER_HEADER, NOT_LEADER, STORE_HEADER, STORE_UNREACHABLE
from llmgw.wire import ErrorDetail, ErrorReply, to_json

if TYPE_CHECKING:
    from llmgw.server.ha.standby import StandbyView

__all__ = [
    "LEADER_HEADER",
    "LeaderInfo",
    "Lease",
    "LostLease",
    "NotLeader",
    "lead_when_elected",
    "not_leader_reply",
]

log = logging.getLogger("llmgw.server")



class NotLeader(LlmgwError):
    """A write refused because this server no longer holds the lease under its epoch."""


class LostLease(LlmgwError):
    """The leader could not keep its lease (taken over, expired, or unrenewable): it steps down."""


@attrs.frozen
class LeaderInfo:
    """The lease row as one server read it."""

    holder: str
    address: str
    epoch: int
    #: seconds since it was taken, and until it expires (negative: expired), on the database's clock
    age: float
    expires_in: float
    #: time.monotonic() when it was read
    read_at: float = attrs.field(factory=time.monotonic, eq=False)

    def left(self) -> float:
        """Seconds until the lease as read expires, counted from now (negative: it has expired)."""
        return self.expires_in - (time.monotonic() - self.read_at)


class Lease:
    """This server's side of the lease, on its own connection (renewals never wait behind the store's writes).

    :param connect: opens a new autocommit psycopg connection to the store's database.
    :param address: the URL clients reach this server at (shown to others while it leads).
    :param duration: the lease's length in seconds.
    """

    def __init__(self, connect: Callable[[], Any], address: str, duration: float) -> None:
        self._connect = connect
        self._conn: Any = None
        self._limiter = trio.CapacityLimiter(1)
        self.address = address
        #: unique per process: a restarted server never mistakes an older process's lease for its own
        self.holder = f"{address}#{secrets.token_hex(4)}"
        self.duration = duration
        #: the epoch this server leads under; None while it is a standby
        self.epoch: int | None = None
        #: time.monotonic() after which this server may no longer assume it leads, whatever the database says
        self.deadline = 0.0
        #: the last lease row read (the leader a standby points clients to)
        self.seen: LeaderInfo | None = None
        #: why the store could not be reached at the last try to take the lease; None when it answered
        self.unreachable: str | None = None

    # -- standby -------------------------------------------------------------

    async def acquire(self, on_standby: Callable[[], Awaitable[None]] | None = None) -> LeaderInfo:
        """Wait until this server holds the lease; return the row it replaced (holder '' when there was none).

        Polls every fifth of the lease and when the lease it read runs out, and wakes early on a
        ``NOTIFY`` from a leader letting go. ``on_standby`` is awaited once, when another server
        was found leading (or the database could not be reached).
        Errors reaching the database are logged (the first of a run of them as a warning) and retried.
        """
        failing = False
        while True:
            try:
                won = await self._in_thread(self._try_acquire)
                self.unreachable = None
                if failing:
                    log.warning("the store answers again; competing for the lease")
                    failing = False
                if won is not None:
                    return won
                on_standby, standing_by = None, on_standby
                if standing_by is not None:
                    await standing_by()
                await self._in_thread(self._wait_for_notify)
            except Exception as exc:  # unreachable, or the row is locked by a leader stopped mid-write
                level = logging.DEBUG if failing else logging.WARNING
                log.log(level, "cannot take the lease yet: %s", str(exc).strip())
                busy = lock_busy(exc)  # reached; the row was locked
                self.unreachable = None if busy else str(exc).strip() or type(exc).__name__
                failing = True
                self._drop_connection()
                on_standby, standing_by = None, on_standby
                if standing_by is not None:
                    await standing_by()
                await trio.sleep(self.duration / 5)

    def _try_acquire(self) -> LeaderInfo | None:
        conn = self._connection()
        sent = time.monotonic()
        self._check_in(conn)
        with conn.transaction():
            row = queries.lock_lease(conn)  # a new database gets its row here: always one to lock
            previous = LeaderInfo(*row)
            self.seen = previous if previous.holder else None
            if previous.holder and previous.expires_in > 0:
                return None
            epoch = previous.epoch + 1
            queries.take_lease(conn, self.holder, self.address, epoch, self.duration)
        self.epoch = epoch
        self.deadline = sent + self.duration * 0.9
        self.seen = LeaderInfo(self.holder, self.address, epoch, 0.0, self.duration)
        return previous

    def _wait_for_notify(self) -> None:
        # until the lease as last read runs out (a killed leader's is taken at once), a fifth of it at most
        left = self.seen.left() if self.seen is not None else self.duration
        conn = self._connection()
        queries.listen(conn)
        for _ in conn.notifies(timeout=min(self.duration / 5, max(left, 0.0) + 0.02), stop_after=1):
            pass

    # -- leader --------------------------------------------------------------

    async def keep(self) -> None:
        """Renew the lease every third of its length until it cannot be kept; raises :class:`LostLease` then.

        Runs beside the leader's work; it raises without writing when this
        process finds itself past its local deadline (it was paused).
        """
        #: (time.monotonic() of the first failed renewal in a row, the last error), None while they succeed
        failing: tuple[float, str] | None = None
        while True:
            await trio.sleep(self.duration / 3)
            late = time.monotonic() - self.deadline
            if late > 0:
                if failing is not None:
                    raise LostLease(
                        f"the lease (epoch {self.epoch}) ran out {late:.1f} s ago: it could not be "
                        f"renewed for {time.monotonic() - failing[0]:.1f} s (last error: {failing[1]})"
                    )
                raise LostLease(
                    f"the lease (epoch {self.epoch}) ran out {late:.1f} s ago while this server was paused"
                )
            try:
                kept = await self._in_thread(self._renew)
            except Exception as exc:
                error = str(exc).strip() or type(exc).__name__
                log.warning("cannot renew the lease (epoch %s): %s", self.epoch, error)
                failing = (failing[0] if failing else time.monotonic(), error)
                self._drop_connection()
                continue
            failing = None
            if not kept:
                raise LostLease(f"the lease (epoch {self.epoch}) was taken over or expired in the database")

    def _renew(self) -> bool:
        conn = self._connection()
        sent = time.monotonic()
        self._check_in(conn)
        queries.forget_servers_older_than(conn, self.duration * 20)
        if not queries.renew_lease(conn, self.holder, self.epoch, self.duration):
            return False
        self.deadline = sent + self.duration * 0.9
        return True

    def fence(self, conn: Any) -> None:
        """The store's ``before_write``: refuse this write unless this server still holds the lease.

        The row must name this server's holder and epoch together, unexpired: an epoch alone does not
        say who holds it.

        Runs in the write's transaction, which then holds the lease row (``FOR
        SHARE``) until it commits: a takeover waits for it.

        :raises NotLeader: this server is a standby, or its epoch is over, or its lease ran out.
        """
        if self.epoch is None:
            raise NotLeader("this server is a standby; only the leader writes")
        late = time.monotonic() - self.deadline
        if late > 0:
            raise NotLeader(f"the lease (epoch {self.epoch}) ran out {late:.1f} s ago; not writing")
        row = queries.lease_for_write(conn)
        if row is None or (row[0], row[1]) != (self.holder, self.epoch) or row[2] <= 0:
            holder = f"{row[0] or 'no server'} holds epoch {row[1]}" if row else "no lease row"
            raise NotLeader(f"the lease of epoch {self.epoch} is over ({holder}); not writing")

    async def release(self) -> None:
        """Let go of the lease now if this server holds it, waking the standbys; leave ``ctl servers``.

        Called once as the server stops; errors are only logged.
        """
        epoch, self.epoch = self.epoch, None

        def let_go() -> None:
            conn = self._connection()
            if epoch is not None:
                queries.let_go(conn, self.holder, epoch)
            queries.leave(conn, self.holder)

        try:
            await self._in_thread(let_go)
        except Exception as exc:
            log.warning("could not release the lease (epoch %s): %s", epoch, str(exc).strip())

    def step_down(self) -> None:
        """Forget the epoch: from now on every write is refused."""
        self.epoch = None

    def _check_in(self, conn: Any) -> None:
        """Say this server is up (``ctl servers``); not a write of the cluster's state, so not fenced.

        An older instance at the same address (killed, then this one started in its place) leaves the list.
        """
        queries.check_in(conn, self.holder, self.address)

    # -- plumbing ------------------------------------------------------------

    async def read(self) -> LeaderInfo | None:
        """The lease row now (None when no server ever led)."""

        def read() -> LeaderInfo | None:
            row = queries.read_lease(self._connection())
            return LeaderInfo(*row) if row else None

        self.seen = await self._in_thread(read)
        return self.seen

    async def _in_thread(self, work: Callable[[], Any]) -> Any:
        async with self._limiter:
            return await trio.to_thread.run_sync(work)

    def _connection(self) -> Any:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._drop_connection()
            self._conn = self._connect()
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        """Close the lease's connection (the server is stopping)."""
        self._drop_connection()


def not_leader_reply(lease: Lease, *, loading: bool = False) -> Response:
    """A standby's answer to every request: 503 ``not_leader``, naming the leader (``x-llmgw-leader``).

    ``loading``: this server took the lease and is loading the state: 503 ``starting`` instead.
    A server that cannot reach the store says so (and :data:`STORE_HEADER`); it never names itself.
    """
    if loading:
        message = f"this server leads now (epoch {lease.epoch}) and is loading the cluster's state; try again"
        return Response.json(503, to_json(ErrorReply(ErrorDetail(message, "starting"))))
    leader = _leader_seen(lease)
    headers: tuple[tuple[str, str], ...] = () if leader is None else ((LEADER_HEADER, leader.address),)
    if lease.unreachable is not None:
        known = "it knows no leader" if leader is None else f"the leader was {leader.address}"
        message = f"this server is a standby and cannot reach the store ({lease.unreachable}); {known}"
        headers += ((STORE_HEADER, STORE_UNREACHABLE),)
    elif leader is None:
        message = "this server is a standby and no server leads right now; try again in a few seconds"
    else:
        message = f"this server is a standby; the leader is {leader.address} (epoch {leader.epoch})"
    body = to_json(ErrorReply(ErrorDetail(message, NOT_LEADER)))
    return Response.json(503, body, headers=headers)


def _leader_seen(lease: Lease) -> LeaderInfo | None:
    """Another server's lease, as this one last read it, while it has not expired; else None."""
    seen = lease.seen
    if seen is None or seen.holder == lease.holder or seen.left() <= 0 or not seen.address:
        return None
    return seen


async def lead_when_elected(
    store: Any,
    front: Any,
    lead: Callable[[trio.Nursery], Awaitable[None]],
    *,
    address: str,
    duration: float,
    view: StandbyView | None = None,
) -> None:
    """Be a standby until this server holds the lease, then lead until it is lost; again, forever.

    Called by ``serve_server`` on a PostgreSQL store, once listening.
    While a standby, ``front.standby`` (``view``'s handler) answers reads from
    the store and ``front.refusal`` (:func:`not_leader_reply`) everything
    else; without a ``view``, the refusal answers every request.
    Leading is ``lead(nursery)``: load the state, start the reconciler in
    ``nursery`` and hand requests to the app, as a single server starts; it
    adopts running replicas as a restart does. A lost lease, a fenced write
    or a store that cannot be written cancels that nursery; events record
    every change of leader and why. The lease is released (standbys wake at
    once) when the server stops.
    """
    unreachable = connection_error()
    lease = Lease(store.connect, address, duration)
    store.before_write = lease.fence
    loading = False  # between taking the lease and answering as the leader
    front.refusal = lambda: not_leader_reply(lease, loading=loading)
    if view is not None:
        view.refusal = front.refusal
        view.leader = lambda: leader.address if (leader := _leader_seen(lease)) else None
    try:
        async with trio.open_nursery() as standby:
            while True:
                front.app = None
                following: list[trio.CancelScope] = []

                async def stand_by(following: list[trio.CancelScope] = following) -> None:
                    # only once another server leads: a server alone never answers as a standby
                    if view is not None:
                        following.append(await standby.start(view.follow))
                        front.standby = view.handle

                previous = await lease.acquire(stand_by)
                if not previous.holder:
                    why = "no server led before"
                else:
                    why = f"the lease of {previous.address} (epoch {previous.epoch}) expired"
                log.warning("this server leads now (epoch %d): %s", lease.epoch, why)
                reason = "stopped"
                loading = True
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(lease.keep)
                        message = f"{address} leads (epoch {lease.epoch}): {why}"
                        leads = EventKind.LEADER
                        event = partial(Store.add_event, kind=leads, subject=address, message=message)
                        await store.write(event)
                        await lead(nursery)
                        loading = False
                        _stop_following(front, view, following)  # the app answers from now on
                except* (LostLease, NotLeader, StoreError, unreachable) as group:
                    reason = "; ".join(str(e).strip() for e in _leaves(group))
                loading = False
                _stop_following(front, view, following)
                epoch = lease.epoch
                lease.step_down()
                front.app = None
                log.warning("stepped down (epoch %s): %s", epoch, reason)
    finally:
        with trio.CancelScope(shield=True):
            await lease.release()
        lease.close()


def _stop_following(front: Any, view: StandbyView | None, following: list[trio.CancelScope]) -> None:
    """This server leads (or stepped down): its standby view stops answering and following."""
    front.standby = None
    for scope in following:
        scope.cancel()
    if view is not None:
        view.clear()


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves
