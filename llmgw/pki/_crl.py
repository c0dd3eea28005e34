"""Revocation lists: signing the CA's ``crl.pem``, and reading one as the server does.

:func:`load_crl` and :func:`load_revoked` read the revoked serials after
checking the signature; :class:`RevocationList` is the server's copy, reloaded
when the file changes; :func:`_write_crl` signs a new list for ``revoke``.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Protocol

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw.pki._files import IssuedRecord, _write_file
from llmgw.pki._identity import PkiError, _common_name, _extension, _now, _read_cert


class Signer(Protocol):
    """What signing a CRL reads of the CA (:class:`llmgw.pki._ca.CA`): its certificate, key and CRL's path."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def crl_path(self) -> Path: ...

#: The ``nextUpdate`` of a CRL. The server reads serials and ignores it; OpenSSL-style checkers would not.
_CRL_DAYS = 365


def load_crl(crl_path: str | os.PathLike, ca_cert: str | os.PathLike | x509.Certificate) -> frozenset[int]:
    """The revoked serials of a CRL, after checking it is signed by the CA.

    Called by the server (through :class:`RevocationList`), which may hold a
    copy of ``crl.pem`` and ``ca.pem`` but not the CA's directory.

    :raises PkiError: when the file is missing, not a CRL, or not signed by ``ca_cert``.
    :returns: the serials; empty when nothing is revoked.
    """
    crl_path = Path(crl_path)
    issuer = ca_cert if isinstance(ca_cert, x509.Certificate) else _read_cert(Path(ca_cert))
    try:
        crl = x509.load_pem_x509_crl(crl_path.read_bytes())
    except FileNotFoundError:
        raise PkiError(f"no revocation list at {crl_path}; copy crl.pem from the CA directory") from None
    except ValueError as exc:
        raise PkiError(f"{crl_path} is not a PEM revocation list ({exc}); copy crl.pem again") from None
    try:
        valid = crl.issuer == issuer.subject and crl.is_signature_valid(issuer.public_key())
    except (InvalidSignature, TypeError):
        valid = False
    if not valid:
        raise PkiError(f"{crl_path} is not signed by the CA {_common_name(issuer)!r}; copy the right crl.pem")
    return frozenset(entry.serial_number for entry in crl)


def load_revoked(ca_dir: str | os.PathLike) -> frozenset[int]:
    """The revoked serials of the CA in ``ca_dir``, read from its signed ``crl.pem``.

    :raises PkiError: as :func:`load_crl`.
    :returns: the serials; empty when nothing is revoked.
    """
    ca_dir = Path(ca_dir)
    return load_crl(ca_dir / "crl.pem", ca_dir / "ca.pem")


class RevocationList:
    """A CRL file the server checks on every request and reloads when it changes, with no restart.

    The change check is one ``stat`` (inode, size, mtime): ``revoke`` replaces
    the file by a rename, so a new list is always a new inode. Loading at
    construction raises :class:`PkiError` (the server refuses to start with a
    bad list); a bad file later keeps the last good serials and sets
    :attr:`problem` for the server to log, rather than refusing every node.
    """

    def __init__(self, crl_path: str | os.PathLike, ca_cert: str | os.PathLike | x509.Certificate) -> None:
        self.path = Path(crl_path)
        self._ca = ca_cert if isinstance(ca_cert, x509.Certificate) else _read_cert(Path(ca_cert))
        self._stamp = self._stat()
        self.serials = load_crl(self.path, self._ca)
        #: Why the current file could not be loaded, or ``None``.
        self.problem: str | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def refresh(self) -> bool:
        """Reload the list if the file changed since the last look.

        :returns: ``True`` when a new list was loaded.
        """
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        try:
            serials = load_crl(self.path, self._ca)
        except PkiError as exc:
            self.problem = f"{exc}; still using the list loaded before"
            return False
        self._stamp, self.serials, self.problem = stamp, serials, None
        return True

    def is_revoked(self, serial: int) -> bool:
        """Whether ``serial`` is revoked, after a :meth:`refresh`."""
        self.refresh()
        return serial in self.serials


def _authority_key_id(ca: Signer) -> x509.AuthorityKeyIdentifier:
    ski = _extension(ca.cert, x509.SubjectKeyIdentifier)
    if ski is not None:
        return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)
    return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key())


def _write_crl(ca: Signer, records: list[IssuedRecord]) -> None:
    """Sign a CRL of every revoked record and put it at ``crl.pem``, numbered one past the last."""
    number = 1
    if ca.crl_path.exists():
        try:
            previous = x509.load_pem_x509_crl(ca.crl_path.read_bytes())
            number = previous.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number + 1
        except (ValueError, x509.ExtensionNotFound):
            pass
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.cert.subject)
        .last_update(now)
        .next_update(now + dt.timedelta(days=_CRL_DAYS))
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(_authority_key_id(ca), critical=False)
    )
    for record in records:
        if record.revoked_at is not None:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(record.identity.serial)
                .revocation_date(record.revoked_at)
                .build()
            )
    crl = builder.sign(ca.key, hashes.SHA256())
    _write_file(ca.crl_path, crl.public_bytes(serialization.Encoding.PEM), mode=0o644)
