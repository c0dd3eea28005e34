"""``llmgw server migrate --from STATE_DIR --to postgresql://...``: the state from sqlite to PostgreSQL.

Copies every table of the sqlite state (catalog history, nodes, replicas, API
keys, events, settings) into a PostgreSQL database migrated to the same
schema, in one transaction, and refuses a target that holds any of them
already. Stop the old server first; start the new ones with ``--store``:
agents keep their shards, and the new leader adopts them as after a restart.
"""

from __future__ import annotations

from pathlib import Path

import click
import trio

from llmgw.cli import Command
from llmgw.server.persist.postgres import PgStore, open_pg_store, redact
from llmgw.server.persist.sqlite import Store, StoreError, open_store

__all__ = ["copy_state", "migrate_command"]

#: tables only PostgreSQL servers use (the lease, the servers' check-ins, the change feed): never copied
NOT_COPIED = frozenset({"leader", "servers", "feed", "sqlite_sequence"})


async def copy_state(source: Store, target: PgStore) -> dict[str, int]:
    """Copy every table of ``source`` into ``target``, which must hold none of their rows; rows per table.

    :raises StoreError: the target is not empty (nothing is written then).
    """

    def read(conn) -> dict[str, tuple[list[str], list[tuple]]]:
        names = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        tables = {}
        for name in sorted(set(names) - NOT_COPIED):
            cursor = conn.execute(f'SELECT * FROM "{name}"')
            tables[name] = ([d[0] for d in cursor.description], cursor.fetchall())
        return tables

    tables = await source.run(read)

    def write(conn) -> dict[str, int]:
        filled = [name for name in tables if conn.execute(f'SELECT 1 FROM "{name}" LIMIT 1').fetchone()]
        if filled:
            raise StoreError(
                f"{target.path} already holds state (rows in {', '.join(filled)}); "
                "migrate into an empty database, or drop it and create it again"
            )
        for name, (columns, rows) in tables.items():
            listed = ", ".join(f'"{c}"' for c in columns)
            marks = ", ".join("?" * len(columns))
            conn.executemany(f'INSERT INTO "{name}" ({listed}) VALUES ({marks})', rows)
        if "events" in tables:  # the next event id goes on after the copied ones
            conn.execute(
                "SELECT setval(pg_get_serial_sequence('events', 'id'),"
                " (SELECT COALESCE(MAX(id), 0) + 1 FROM events), false)"
            )
        return {name: len(rows) for name, (_, rows) in tables.items()}

    return await target.write(write)


@click.command("migrate", cls=Command)
@click.option(
    "--from",
    "state_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    required=True,
    help="The state dir of the sqlite server to copy (stop that server first).",
)
@click.option(
    "--to",
    "url",
    required=True,
    metavar="postgresql://USER@HOST[:PORT]/DB",
    help="An empty PostgreSQL database (the password as for --store: a file or PGPASSWORD / PGPASSFILE).",
)
@click.option(
    "--store-password-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A file whose first line is the PostgreSQL password.",
)
def migrate_command(state_dir: Path, url: str, store_password_file: Path | None) -> None:
    """Copy a server's sqlite state (--from STATE_DIR) into an empty PostgreSQL database (--to URL).

    Catalog history, nodes, replicas, API keys and events; a target that holds any of them is refused.
    """
    if not (state_dir / "state.db").exists():
        raise click.BadParameter(f"{state_dir} holds no state.db", param_hint="--from")

    async def run() -> dict[str, int]:
        source = open_store(state_dir)
        try:
            target = open_pg_store(url, store_password_file)
        except BaseException:
            source.close()
            raise
        try:
            return await copy_state(source, target)
        finally:
            source.close()
            target.close()

    counts = trio.run(run)
    summary = ", ".join(f"{count} {name}" for name, count in counts.items())
    click.echo(f"copied {state_dir} into {redact(url)}: {summary}")
