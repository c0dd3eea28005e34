"""Every query the server runs: saving the cluster and loading it back at start, API keys, events.

Each function takes the store's connection (through :meth:`Store.run` for
reads, :meth:`Store.write` for writes); the API's request handlers run no SQL
of their own.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs

from llmgw.catalog import parse_catalog
from llmgw.engine import Engine
from llmgw.errors import CatalogError
from llmgw.models import NodeFacts
from llmgw.scheduler import Replica
from llmgw.server.persist.adapters import adapters_text, restore_adapters
from llmgw.server.persist.manifests import load_manifests
from llmgw.server.persist.sqlite import Store
from llmgw.server.state.cluster import ClusterState, Event, NodeRecord, ReplicaRecord, Settings
from llmgw.server.state.gateways import GatewayBook
from llmgw.server.state.records import EventKind, KeyRecord, Launch
from llmgw.wire import (
    CatalogHistory,
    CatalogRevision,
    CatalogText,
    EventEntry,
    EventList,
    KeyLimits,
    from_json,
    to_json,
)

__all__ = [
    "load_cluster",
    "flush",
    "Changes",
    "take_changes",
    "write_changes",
    "restore_changes",
    "load_api_keys",
    "add_api_key",
    "revoke_api_key",
    "set_api_key_limits",
    "add_key_usage",
    "key_usage_days",
    "key_usage_by_model",
    "recent_events",
    "catalog_revision",
    "catalog_history",
]

T = TypeVar("T")


def load_cluster(
    conn: sqlite3.Connection,
    settings: Settings,
    engines: Mapping[str, Engine],
    now: float,
    *,
    memo: Callable[[tuple, Callable[[], Any]], Any] | None = None,
) -> ClusterState:
    """Build the cluster from the store, as the server starts (and a standby, each time it moved).

    Nodes get ``now`` as their last sync, so a server that was down does not
    declare every node lost at once: they have ``lost_after`` to come back.
    Observed shards are not stored: agents report them again, and replicas
    that still run are adopted as they are; so are the LoRA adapters stored
    with them (:mod:`~llmgw.server.persist.adapters`).

    :param memo: ``memo(key, make)`` returns ``make()`` or what it returned before for ``key``
        (the stored text and what it is read as): a standby reading the store again parses only what changed.
    :raises CatalogError: the stored catalog no longer validates (an engine
        plugin was uninstalled); the message says what to do.
    """
    if memo is None:
        memo = _no_memo
    cluster = ClusterState(settings, revision=Store.get_setting(conn, "revision", 0) + 1)
    cluster.next_attempt = Store.get_setting(conn, "next_attempt", 1)
    cluster.routes_generation = Store.get_setting(conn, "routes_generation", 0)
    # Gateways keep the routes revision they last saw; start past any earlier run's.
    cluster.routes_revision = int(now * 1000)
    # a server that loads the state has heard from no gateway yet
    cluster.gateways = GatewayBook(started=now)
    row = conn.execute("SELECT revision, text FROM catalog ORDER BY revision DESC LIMIT 1").fetchone()
    if row is not None:
        source = f"stored catalog revision {row[0]}"
        try:
            cluster.catalog = memo(("catalog", row[1]), lambda: parse_catalog(row[1], engines, source=source))
        except CatalogError as exc:
            hint = " (install the engine plugins it uses, or apply a new catalog)"
            raise CatalogError(exc.source + hint, exc.problems) from None
        cluster.catalog_text, cluster.catalog_revision = row[1], row[0]
    for (
        node_id,
        address,
        facts,
        port_range,
        cordoned,
        draining,
        lost,
        serial,
        not_after,
        first_seen,
    ) in conn.execute(
        "SELECT node_id, address, facts, port_range, cordoned, draining, lost, cert_serial, cert_not_after,"
        " first_seen FROM nodes"
    ):
        cluster.nodes[node_id] = NodeRecord(
            node_id=node_id,
            address=address,
            facts=_read(memo, NodeFacts, facts),
            port_range=tuple(json.loads(port_range)),
            first_seen=first_seen,
            last_seen=now,
            cordoned=bool(cordoned),
            draining=bool(draining),
            lost=bool(lost),
            cert_serial=int(serial, 16) if serial else None,
            cert_not_after=not_after,
        )
    cluster.manifests = load_manifests(conn)
    cluster.rollouts.load(Store.get_setting(conn, "paused_rollouts", {}))
    cluster.rollouts.rolling = set(Store.get_setting(conn, "rolling_models", []))
    for placement, attempt, failures, consecutive, sent, state, reason, launch, adapters in conn.execute(
        "SELECT placement, attempt, failures, consecutive_failures, sent_revision, state, reason, launch, "
        "adapters FROM replicas"
    ):
        replica = _read(memo, Replica, placement)
        # rows stored before launches were recorded run what the catalog in force asks
        started = _read(memo, Launch, launch) if launch else Launch.of(cluster.catalog, replica.model)
        record = cluster.replicas[replica.id] = ReplicaRecord(
            placement=replica,
            attempt=attempt,
            failures=failures,
            consecutive_failures=consecutive,
            sent_revision=sent,
            state=state,
            reason=reason,
            started_at=now,
            ready_since=now if state == "ready" else None,
            not_before=now,
            launch=started,
        )
        restore_adapters(cluster.adapters, record, adapters)
    return cluster


def _no_memo(key: tuple, make: Callable[[], Any]) -> Any:
    return make()


def _read(memo: Callable[[tuple, Callable[[], Any]], Any], cls: type, text: str) -> Any:
    """The stored JSON ``text`` read as a ``cls`` (frozen: safe to share between loads)."""
    return memo((cls, text), lambda: from_json(json.loads(text), cls))


@attrs.frozen
class Changes:
    """What changed in the cluster since the last flush, as rows: taken on the loop, written in a thread."""

    #: revision, text, author
    catalog: tuple[int, str, str | None] | None
    #: node rows to write, and node ids to delete
    nodes: tuple[tuple[object, ...], ...]
    gone_nodes: tuple[str, ...]
    replicas: tuple[tuple[object, ...], ...]
    gone_replicas: tuple[str, ...]
    events: tuple[Event, ...]
    settings: tuple[tuple[str, object], ...]
    now: float

    def __bool__(self) -> bool:
        rows = (self.nodes, self.gone_nodes, self.replicas, self.gone_replicas, self.events, self.settings)
        return self.catalog is not None or any(rows)


def take_changes(cluster: ClusterState, now: float) -> Changes:
    """Everything :func:`write_changes` must store, taken out of ``cluster`` (its dirty marks are cleared).

    Called on the event loop, so the rows are a consistent snapshot while
    syncs go on changing the cluster; cheap (only what changed). A failed
    write hands the changes back with :func:`restore_changes`.
    """
    catalog = None
    if cluster.dirty_catalog:
        catalog = (cluster.catalog_revision, cluster.catalog_text, cluster.catalog_author)
    nodes, gone_nodes = _rows(cluster.dirty_nodes, cluster.nodes, _node_row)
    replicas, gone_replicas = _rows(
        cluster.dirty_replicas, cluster.replicas, lambda r: _replica_row(r, now, cluster)
    )
    settings: dict[str, object] = {
        "revision": cluster.revision,
        "next_attempt": cluster.next_attempt,
        "routes_generation": cluster.routes_generation,
        "paused_rollouts": cluster.rollouts.saved(),
        # the rollouts under way: a restart says neither "started" nor "done" again
        "rolling_models": sorted(cluster.rollouts.rolling),
    }
    changed_settings = tuple((k, v) for k, v in settings.items() if cluster.saved_settings.get(k) != v)
    cluster.saved_settings.update(settings)
    changes = Changes(
        catalog=catalog,
        nodes=tuple(nodes),
        gone_nodes=tuple(gone_nodes),
        replicas=tuple(replicas),
        gone_replicas=tuple(gone_replicas),
        events=tuple(cluster.take_events()),
        settings=changed_settings,
        now=now,
    )
    cluster.dirty_catalog = False
    cluster.dirty_nodes.clear()
    cluster.dirty_replicas.clear()
    return changes


def _rows(
    dirty: set[str], records: Mapping[str, T], row: Callable[[T], tuple[object, ...]]
) -> tuple[list[tuple[object, ...]], list[str]]:
    """The rows (by ``row``) of the ``dirty`` ids still in ``records``, and the ids gone from it; sorted."""
    rows, gone = [], []
    for key in sorted(dirty):
        record = records.get(key)
        if record is None:
            gone.append(key)
        else:
            rows.append(row(record))
    return rows, gone


def _node_row(node: NodeRecord) -> tuple[object, ...]:
    """``node`` as a row of ``_NODE_COLUMNS``."""
    return (
        node.node_id,
        node.address,
        json.dumps(to_json(node.facts)),
        json.dumps(list(node.port_range)),
        int(node.cordoned),
        int(node.draining),
        int(node.lost),
        format(node.cert_serial, "x") if node.cert_serial is not None else None,
        node.cert_not_after,
        node.first_seen,
        node.last_seen,
    )


def _replica_row(record: ReplicaRecord, now: float, cluster: ClusterState) -> tuple[object, ...]:
    """``record`` as a row of ``_REPLICA_COLUMNS``, changed at ``now`` (its adapters from ``cluster``)."""
    return (
        record.id,
        record.placement.model,
        json.dumps(to_json(record.placement)),
        record.attempt,
        record.failures,
        record.consecutive_failures,
        record.sent_revision,
        str(record.state),
        record.reason,
        now,
        json.dumps(to_json(record.launch)) if record.launch is not None else None,
        adapters_text(cluster.adapters, record),
    )


def restore_changes(cluster: ClusterState, changes: Changes) -> None:
    """Mark what ``changes`` held dirty again, after its write failed: the next flush retries it."""
    cluster.dirty_catalog = cluster.dirty_catalog or changes.catalog is not None
    cluster.dirty_nodes.update(row[0] for row in changes.nodes)
    cluster.dirty_nodes.update(changes.gone_nodes)
    cluster.dirty_replicas.update(row[0] for row in changes.replicas)
    cluster.dirty_replicas.update(changes.gone_replicas)
    cluster.event_log.put_back(changes.events)
    for key, _ in changes.settings:
        cluster.saved_settings.pop(key, None)


def write_changes(conn: sqlite3.Connection, changes: Changes) -> None:
    """Store ``changes`` in the caller's transaction (``Store.write``); runs in the store's thread."""
    if changes.catalog is not None:
        upsert = _upsert("catalog", "revision", "text", "author", "applied_at")
        conn.execute(upsert, (*changes.catalog, changes.now))
    conn.executemany("DELETE FROM nodes WHERE node_id = ?", [(n,) for n in changes.gone_nodes])
    conn.executemany(
        _upsert("nodes", *_NODE_COLUMNS),
        changes.nodes,
    )
    conn.executemany("DELETE FROM replicas WHERE replica_id = ?", [(r,) for r in changes.gone_replicas])
    conn.executemany(
        _upsert("replicas", *_REPLICA_COLUMNS),
        changes.replicas,
    )
    for event in changes.events:
        Store.add_event(conn, str(event.kind), event.subject, event.message, at=event.at)
    if changes.events:
        _trim_events(conn, changes.now)
    for key, value in changes.settings:
        Store.set_setting(conn, key, value)


#: the columns of a node's row and a replica's, key first, in the order of take_changes' tuples
_NODE_COLUMNS = (
    "node_id", "address", "facts", "port_range", "cordoned", "draining", "lost",
    "cert_serial", "cert_not_after", "first_seen", "last_seen",
)  # fmt: skip
_REPLICA_COLUMNS = (
    "replica_id", "model", "placement", "attempt", "failures", "consecutive_failures",
    "sent_revision", "state", "reason", "changed_at", "launch", "adapters",
)  # fmt: skip


def _upsert(table: str, key: str, *columns: str) -> str:
    """An insert of a whole row replacing the one with the same ``key`` (sqlite and PostgreSQL alike)."""
    names = ", ".join((key, *columns))
    marks = ", ".join("?" * (1 + len(columns)))
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns)
    return f"INSERT INTO {table} ({names}) VALUES ({marks}) ON CONFLICT ({key}) DO UPDATE SET {updates}"


def flush(conn: sqlite3.Connection, cluster: ClusterState, now: float) -> None:
    """Write what changed since the last flush, in the caller's transaction (``Store.write``).

    For tools and tests that own the cluster; the server takes the changes
    on its event loop and writes them in the store's thread.
    """
    write_changes(conn, take_changes(cluster, now))


# -- catalog revisions -------------------------------------------------------


def catalog_revision(conn: sqlite3.Connection, revision: int) -> CatalogText | None:
    """Stored catalog revision ``revision`` (``ctl catalog --revision N``); None when there is none."""
    row = conn.execute(
        "SELECT revision, text, applied_at, author FROM catalog WHERE revision = ?", (revision,)
    ).fetchone()
    return CatalogText(*row) if row else None


def catalog_history(conn: sqlite3.Connection, limit: int) -> CatalogHistory:
    """The last ``limit`` stored catalog revisions, oldest first (``ctl catalog history``)."""
    rows = conn.execute(
        "SELECT revision, applied_at, author FROM catalog ORDER BY revision DESC LIMIT ?", (limit,)
    ).fetchall()
    return CatalogHistory(tuple(CatalogRevision(*row) for row in reversed(rows)))


# -- API keys ----------------------------------------------------------------


def load_api_keys(conn: sqlite3.Connection) -> dict[str, KeyRecord]:
    """API key name -> its record (hash of the secret, dates, limits); read at start and by standbys."""
    rows = conn.execute("SELECT name, sha256, created_at, revoked_at, limits FROM api_keys").fetchall()
    return {
        name: KeyRecord(sha, created, revoked, _limits_of(text)) for name, sha, created, revoked, text in rows
    }


def _limits_of(text: str | None) -> KeyLimits:
    """A key's stored limits: NULL (every key made before limits, and unlimited ones) is no limit."""
    return KeyLimits() if text is None else from_json(json.loads(text), KeyLimits)


def _limits_text(limits: KeyLimits) -> str | None:
    return None if limits.is_default() else json.dumps(to_json(limits), sort_keys=True)


def add_api_key(
    conn: sqlite3.Connection, name: str, digest: str, now: float, by: str, limits: KeyLimits | None = None
) -> None:
    """Store a new API key's hash and limits, and say who created it (inside a ``Store.write``)."""
    limits = limits or KeyLimits()
    conn.execute(
        "INSERT INTO api_keys (name, sha256, created_at, limits) VALUES (?, ?, ?, ?)",
        (name, digest, now, _limits_text(limits)),
    )
    shown = "" if limits.is_default() else f" ({limits.summary()})"
    Store.add_event(conn, EventKind.KEY, name, f"API key created by {by}{shown}", at=now)


def set_api_key_limits(conn: sqlite3.Connection, name: str, limits: KeyLimits, now: float, by: str) -> None:
    """Replace an API key's limits and say who changed them to what (inside a ``Store.write``)."""
    conn.execute("UPDATE api_keys SET limits = ? WHERE name = ?", (_limits_text(limits), name))
    Store.add_event(conn, EventKind.KEY, name, f"API key limits set by {by}: {limits.summary()}", at=now)


def revoke_api_key(conn: sqlite3.Connection, name: str, now: float, by: str) -> None:
    """Mark an API key revoked at ``now`` and say who did it (inside a ``Store.write``)."""
    conn.execute("UPDATE api_keys SET revoked_at = ? WHERE name = ?", (now, name))
    Store.add_event(conn, EventKind.KEY, name, f"API key revoked by {by}", at=now)


# -- what API keys used ------------------------------------------------------


def add_key_usage(conn: sqlite3.Connection, rows: Iterable[tuple[str, str, str, int, int, int]]) -> None:
    """Add (key name, UTC day, model, requests, prompt tokens, completion tokens) to what is stored
    (inside a ``Store.write``; the leader's, from the gateways' reports)."""
    conn.executemany(
        "INSERT INTO key_usage (key_name, day, model, requests, prompt_tokens, completion_tokens) "
        "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key_name, day, model) DO UPDATE SET "
        "requests = key_usage.requests + excluded.requests, "
        "prompt_tokens = key_usage.prompt_tokens + excluded.prompt_tokens, "
        "completion_tokens = key_usage.completion_tokens + excluded.completion_tokens",
        list(rows),
    )


def key_usage_days(conn: sqlite3.Connection, since: str) -> list[tuple[str, str, int]]:
    """(key name, UTC day, prompt + completion tokens) of every day from ``since`` (``YYYY-MM-DD``) on."""
    rows = conn.execute(
        "SELECT key_name, day, SUM(prompt_tokens + completion_tokens) FROM key_usage WHERE day >= ? "
        "GROUP BY key_name, day",
        (since,),
    ).fetchall()
    return [(name, day, int(tokens)) for name, day, tokens in rows]


def key_usage_by_model(conn: sqlite3.Connection, name: str, since: str) -> list[tuple[str, int, int, int]]:
    """(model, requests, prompt tokens, completion tokens) of key ``name`` from UTC day ``since`` on."""
    rows = conn.execute(
        "SELECT model, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens) FROM key_usage "
        "WHERE key_name = ? AND day >= ? GROUP BY model ORDER BY model",
        (name, since),
    ).fetchall()
    return [
        (model, int(requests), int(prompt), int(completion)) for model, requests, prompt, completion in rows
    ]


# -- events ------------------------------------------------------------------


#: events kept for ``ctl events``: the newest this many; older ones are deleted as new ones arrive
MAX_EVENTS = 100_000
#: and none older than this many seconds (30 days)
MAX_EVENT_AGE = 30 * 86400.0


def _trim_events(conn: sqlite3.Connection, now: float) -> None:
    # ids only grow, so the newest MAX_EVENTS are those above max(id) - MAX_EVENTS: no scan
    conn.execute("DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (MAX_EVENTS,))
    # events are stored in time order: the old ones are the lowest ids, found from the start of the index
    conn.execute(
        "DELETE FROM events WHERE id < (SELECT id FROM events WHERE at >= ? ORDER BY id LIMIT 1)",
        (now - MAX_EVENT_AGE,),
    )


def recent_events(conn: sqlite3.Connection, since: int, limit: int) -> EventList:
    """The last ``limit`` events after id ``since``, oldest first (``ctl events``)."""
    rows = conn.execute(
        "SELECT id, at, kind, subject, message FROM events WHERE id > ? ORDER BY id DESC LIMIT ?",
        (since, limit),
    ).fetchall()
    return EventList(tuple(EventEntry(*row) for row in reversed(rows)))
