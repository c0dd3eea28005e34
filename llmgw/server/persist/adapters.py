"""The LoRA adapters stored with each replica: what the leader asked its current attempt to keep loaded,
and what the routes feed says it has loaded.

A replica's row holds them (column ``adapters``, JSON) so that a standby's routes feed lists the adapters
as the leader last stored them, and a new leader (failover, or a restart on sqlite) starts with the
adapters its agents hold: its first sync answers ask for what the last leader's did, and no agent
unloads anything on a leader change. The text is written with the replica's row
(:func:`adapters_text`, from :func:`~llmgw.server.persist.cluster.take_changes`) and read back by
:func:`~llmgw.server.persist.cluster.load_cluster` (:func:`restore_adapters`).
"""

from __future__ import annotations

import json
import logging

from llmgw.server.state.adapters import AdapterBook
from llmgw.server.state.records import ReplicaRecord, ReplicaState

__all__ = ["adapters_text", "restore_adapters"]

log = logging.getLogger("llmgw.server")


def adapters_text(book: AdapterBook, record: ReplicaRecord) -> str | None:
    """The ``adapters`` column of ``record``'s row: its attempt, its desired adapters (name -> source) and
    the names routed as loaded; None when the book holds none for it (or it is not ready, or the book holds
    an earlier attempt's). Called for each replica row written.
    """
    held = book.desired.get(record.id)
    if record.state != ReplicaState.READY or (held is not None and held[0] != record.attempt):
        return None  # its engine holds nothing (yet): the book forgets it in this very pass
    desired = held[1] if held is not None else {}
    loaded = book.routed.get(record.id, frozenset())
    if not desired and not loaded:
        return None
    data = {"attempt": record.attempt, "desired": dict(desired), "loaded": sorted(loaded)}
    return json.dumps(data, sort_keys=True)


def restore_adapters(book: AdapterBook, record: ReplicaRecord, text: str | None) -> None:
    """Put back in ``book`` the adapters stored with ``record`` (``text``: its ``adapters`` column), when
    they belong to its current attempt and it is ready; else nothing. Called by ``load_cluster`` for each
    replica row. A ready replica is also marked for adoption (:attr:`AdapterBook.adopting`).

    A column that does not read as written is logged and skipped: the replica's adapters are then only
    those its agent reports (adopted), at worst loaded again on demand.
    """
    if record.state != ReplicaState.READY:
        return
    book.adopting.add(record.id)
    if not text:
        return
    try:
        data = json.loads(text)
        attempt, desired, loaded = data["attempt"], data["desired"], data["loaded"]
        if not (
            isinstance(attempt, int)
            and isinstance(desired, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in desired.items())
            and isinstance(loaded, list)
            and all(isinstance(name, str) for name in loaded)
        ):
            raise ValueError("expected {attempt: int, desired: {name: source}, loaded: [name]}")
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("replica %s: stored adapters not read (%s): %.200s", record.id, exc, text)
        return
    if attempt == record.attempt:
        book.restore(record.id, attempt, desired, frozenset(loaded))
