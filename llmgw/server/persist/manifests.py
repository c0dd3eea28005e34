"""The manifests table: the stored manifest of every distributable source (the first one made stays)."""

from __future__ import annotations

import json
import sqlite3

from llmgw.weights import Manifest
from llmgw.wire import from_json, to_json

__all__ = ["load_manifests", "save_manifest"]


def load_manifests(conn: sqlite3.Connection) -> dict[str, Manifest]:
    """Every stored manifest, by source."""
    rows = conn.execute("SELECT source, manifest FROM manifests").fetchall()
    return {source: from_json(json.loads(text), Manifest) for source, text in rows}


def save_manifest(conn: sqlite3.Connection, manifest: Manifest, now: float) -> Manifest:
    """Store ``manifest`` for its source unless one is stored already; returns the one stored (the first)."""
    conn.execute(
        "INSERT INTO manifests (source, digest, manifest, made_by, made_at) VALUES (?, ?, ?, ?, ?)"
        " ON CONFLICT (source) DO NOTHING",
        (manifest.source, manifest.digest, json.dumps(to_json(manifest)), manifest.made_by, now),
    )
    [text] = conn.execute("SELECT manifest FROM manifests WHERE source = ?", (manifest.source,)).fetchone()
    return from_json(json.loads(text), Manifest)
