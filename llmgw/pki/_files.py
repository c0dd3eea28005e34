"""The CA directory's files: issued-certificate records, atomic writes and the directory's lock.

:class:`IssuedRecord` is one ``issued/<serial>.json``; :func:`list_issued`
reads them all. Every file is written atomically with its final mode from the
first byte (:func:`_write_file`), under the directory's lock (:func:`_locked`).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw.pki._identity import Identity, PkiError, Role, _now


@attrs.frozen
class IssuedRecord:
    """One certificate the CA issued, as recorded in ``issued/<serial>.json``."""

    identity: Identity
    issued_at: dt.datetime
    #: The SANs of a server certificate; empty for clients.
    names: tuple[str, ...] = ()
    revoked_at: dt.datetime | None = None

    def status(self, now: dt.datetime | None = None) -> str:
        """``"revoked"``, ``"expired"`` or ``"valid"``."""
        if self.revoked_at is not None:
            return "revoked"
        return "expired" if self.identity.not_after <= (now or _now()) else "valid"

    def to_json(self) -> dict:
        """The record as stored on disk and printed by ``llmgw ca list --json``."""
        return {
            "role": self.identity.role.value,
            "name": self.identity.name,
            "serial": self.identity.serial_hex,
            "not_after": self.identity.not_after.isoformat(),
            "issued_at": self.issued_at.isoformat(),
            "names": list(self.names),
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
        }

    @classmethod
    def from_json(cls, data: dict) -> IssuedRecord:
        """Read a record written by :meth:`to_json`."""
        identity = Identity(
            role=Role(data["role"]),
            name=data["name"],
            serial=int(data["serial"], 16),
            not_after=dt.datetime.fromisoformat(data["not_after"]),
        )
        revoked = data.get("revoked_at")
        return cls(
            identity=identity,
            issued_at=dt.datetime.fromisoformat(data["issued_at"]),
            names=tuple(data.get("names", ())),
            revoked_at=dt.datetime.fromisoformat(revoked) if revoked else None,
        )


def list_issued(ca_dir: str | os.PathLike) -> list[IssuedRecord]:
    """Every certificate the CA in ``ca_dir`` issued, oldest first.

    Called by ``llmgw ca list`` and :func:`revoke`.

    :raises PkiError: naming a record file that cannot be read.
    :returns: the records; empty when nothing was issued.
    """
    records = []
    for path in sorted((Path(ca_dir) / "issued").glob("*.json")):
        try:
            records.append(IssuedRecord.from_json(json.loads(path.read_text())))
        except (ValueError, KeyError, TypeError) as exc:
            raise PkiError(f"{path} is not a certificate record ({exc!r}); restore it or remove it") from None
    return sorted(records, key=lambda r: r.issued_at)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write_file(path: Path, data: bytes, *, mode: int, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` atomically: never partly written, never more open than ``mode``.

    The temporary file is created with ``mode`` (O_EXCL), so a key is 0600 from
    its first byte; it is then renamed over ``path``, or hard-linked when
    ``exclusive`` (which raises :class:`FileExistsError` if ``path`` exists).
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        if exclusive:
            os.link(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold the CA directory's lock, so concurrent issue and revoke calls do not lose records."""
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_record(ca_dir: Path, record: IssuedRecord) -> None:
    issued = ca_dir / "issued"
    issued.mkdir(mode=0o700, exist_ok=True)
    text = json.dumps(record.to_json(), indent=2) + "\n"
    _write_file(issued / f"{record.identity.serial_hex}.json", text.encode(), mode=0o644)
