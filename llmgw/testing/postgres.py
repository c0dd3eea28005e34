"""A throwaway PostgreSQL cluster for tests: ``initdb`` into a temporary folder, ``postgres`` on a free port.

:class:`PostgresCluster` runs Debian's (or any) PostgreSQL binaries as an
unprivileged user (``postgres``, else ``nobody``) when the tests run as root,
since PostgreSQL refuses to run as root. The server process leads its own
process group, which :meth:`PostgresCluster.stop` kills whole, also when a
test fails. Fixtures for a ``conftest.py``::

    from llmgw.testing.postgres import pg_url, postgres_cluster  # noqa: F401

``postgres_cluster`` (one per test session) is skipped when PostgreSQL is not
installed, unless ``LLMGW_REQUIRE_POSTGRESQL=1`` (CI), where it fails.
``pg_url`` is a new empty database for one test, dropped after it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.testing.processes import free_port, group_alive, wait_until

__all__ = ["PostgresCluster", "find_postgres_bin", "pg_url", "postgres_cluster", "running_postgres"]

#: set to 1 where PostgreSQL must be installed (CI): its tests then fail instead of being skipped
REQUIRE_ENV = "LLMGW_REQUIRE_POSTGRESQL"
#: the superuser the cluster is made with; tests connect as it over the unix socket (trust)
SUPERUSER = "llmgw"


def find_postgres_bin() -> Path | None:
    """The folder of ``initdb`` and ``postgres``: on PATH, else Debian's ``/usr/lib/postgresql/N/bin``."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("postgres"):
        return Path(on_path).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name),
        reverse=True,
    )
    return versions[0].parent if versions else None


class PostgresCluster:
    """A PostgreSQL cluster in ``root``: made by :meth:`start`, killed (process group) by :meth:`stop`."""

    def __init__(self, root: Path, bindir: Path) -> None:
        self.root = root
        self.bindir = bindir
        self.data = root / "data"
        self.socket_dir = root / "socket"
        self.port = 0
        self.process: subprocess.Popen | None = None
        self._user = _unprivileged_user()
        self._names = itertools.count(1)

    @property
    def log(self) -> Path:
        """The server's log file."""
        return self.root / "postgres.log"

    def start(self, timeout: float = 60) -> None:
        """``initdb``, then start ``postgres`` on a free port and wait until it accepts connections."""
        self.socket_dir.mkdir(parents=True)
        if self._user is not None:
            for path in (self.root, self.socket_dir):
                os.chown(path, self._user.pw_uid, self._user.pw_gid)
        self._run([self.bindir / "initdb", "-D", self.data, "-U", SUPERUSER, "--auth=trust", "-E", "UTF8"])
        self.port = free_port()
        self._launch(timeout)

    def crash(self) -> None:
        """Kill the server's whole process group at once (SIGKILL): clients lose their connections."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            wait_until(lambda: not group_alive(self.process.pid), 10, "PostgreSQL's processes to be gone")

    def restart(self, timeout: float = 60) -> None:
        """Start ``postgres`` again on the same data and port (after :meth:`crash`); it recovers first."""
        self._launch(timeout)

    def _launch(self, timeout: float) -> None:
        argv = [
            self.bindir / "postgres",
            "-D", self.data,
            "-p", str(self.port),
            "-k", self.socket_dir,
            "-c", "listen_addresses=127.0.0.1",
            "-c", "fsync=off",
            "-c", "synchronous_commit=off",
            "-c", "full_page_writes=off",
            "-c", "max_connections=200",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [str(a) for a in argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                **self._as_user(),
            )
        wait_until(self._accepting, timeout, f"PostgreSQL to accept connections (log: {self.log})")

    def url(self, database: str = "postgres") -> str:
        """A ``postgresql://`` URL for ``database`` over the cluster's unix socket."""
        return f"postgresql://{SUPERUSER}@/{database}?host={self.socket_dir}&port={self.port}"

    def tcp_url(self, database: str = "postgres") -> str:
        """A ``postgresql://`` URL for ``database`` over TCP on 127.0.0.1."""
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """Make a new empty database and return its name."""
        name = f"test_{os.getpid()}_{next(self._names)}"
        self.sql(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        """Drop database ``name``, ending its sessions first."""
        self.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def sql(self, statement: str, database: str = "postgres") -> list[tuple]:
        """Run one statement outside any transaction and return its rows (empty when it returns none)."""
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True) as conn:
            cursor = conn.execute(statement)
            return cursor.fetchall() if cursor.description else []

    def stop(self) -> None:
        """Kill the server's whole process group, wait (up to 5 s) for it to be gone, delete ``root``."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            deadline = time.monotonic() + 5
            while group_alive(self.process.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        shutil.rmtree(self.root, ignore_errors=True)

    def _accepting(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(
                f"postgres exited {self.process.returncode}:\n{self.log.read_text()[-3000:]}"
            )
        self.sql("SELECT 1")
        return True

    def _run(self, argv: list) -> None:
        done = subprocess.run(
            [str(a) for a in argv], capture_output=True, text=True, check=False, **self._as_user()
        )
        if done.returncode != 0:
            raise AssertionError(f"{argv[0]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")

    def _as_user(self) -> dict:
        if self._user is None:
            return {}
        return {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": [], "cwd": self.root}


def _unprivileged_user() -> pwd.struct_passwd | None:
    """Who runs PostgreSQL when we are root (it refuses root); None when we are not root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise AssertionError(
        "running as root, and there is neither a 'postgres' nor a 'nobody' user to run PostgreSQL"
    )


@contextlib.contextmanager
def running_postgres(prefix: str = "llmgw-pg-") -> Iterator[PostgresCluster]:
    """A PostgreSQL cluster of its own in a new temporary folder, stopped after; for fixtures.

    Skips the test when PostgreSQL is missing (fails it with ``LLMGW_REQUIRE_POSTGRESQL=1``, as in CI).
    :param prefix: the temporary folder's name prefix.
    """
    bindir = find_postgres_bin()
    if bindir is None:
        message = "PostgreSQL is not installed (apt-get install postgresql)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message}, and {REQUIRE_ENV}=1")
        pytest.skip(message)
    cluster = PostgresCluster(Path(tempfile.mkdtemp(prefix=prefix)), bindir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """One PostgreSQL cluster for the test session; skipped when PostgreSQL is missing (failed in CI)."""
    with running_postgres() as cluster:
        yield cluster


@pytest.fixture
def pg_url(postgres_cluster: PostgresCluster) -> Iterator[str]:
    """The URL of a new empty database, dropped when the test ends."""
    name = postgres_cluster.create_database()
    try:
        yield postgres_cluster.url(name)
    finally:
        postgres_cluster.drop_database(name)
