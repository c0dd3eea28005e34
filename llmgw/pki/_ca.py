"""The certificate authority itself: making and loading a CA, issuing certificates, revoking them.

:func:`init_ca` and :func:`load_ca` give a :class:`CA`; the ``issue_*``
functions write a certificate, its key and the root into a directory and
record what they issued; :func:`revoke` marks records revoked and re-signs
the CA's revocation list.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.pki._crl import _authority_key_id, _write_crl
from llmgw.pki._files import IssuedRecord, _key_pem, _locked, _write_file, _write_record, list_issued
from llmgw.pki._identity import (
    Identity,
    PkiError,
    Role,
    _check_days,
    _common_name,
    _extension,
    _hex,
    _now,
    _read_cert,
    identity_of,
    validate_name,
)

#: Days a leaf certificate lives unless told otherwise.
DEFAULT_LEAF_DAYS = 365
#: How far back ``notBefore`` is set, so a node whose clock is a little behind accepts a new certificate.
_BACKDATE = dt.timedelta(minutes=5)
_DNS_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_DNS_NAME = re.compile(rf"(\*\.)?{_DNS_LABEL}(\.{_DNS_LABEL})*")


@attrs.frozen
class CA:
    """A loaded CA: its directory, root certificate and private key."""

    directory: Path
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_path(self) -> Path:
        """``ca.pem``: the root certificate every llmgw process trusts."""
        return self.directory / "ca.pem"

    @property
    def key_path(self) -> Path:
        """``ca.key``: the CA's private key (0600)."""
        return self.directory / "ca.key"

    @property
    def crl_path(self) -> Path:
        """``crl.pem``: the signed revocation list the server reads."""
        return self.directory / "crl.pem"

    @property
    def name(self) -> str:
        """The CA's common name."""
        return _common_name(self.cert) or "?"


@attrs.frozen
class Issued:
    """What an ``issue_*`` call made: the certificate's identity and the three files written."""

    identity: Identity
    cert_path: Path
    key_path: Path
    ca_path: Path


def init_ca(directory: str | os.PathLike, *, name: str = "llmgw CA", days: int = 3650) -> CA:
    """Create a new CA in ``directory``: ``ca.key`` (0600), ``ca.pem`` and an empty ``crl.pem``.

    Called by ``llmgw ca init`` and ``llmgw dev``. The directory is created
    with mode 0700 when missing. An ECDSA P-256 key signs everything.

    :raises PkiError: when ``directory`` already holds a CA; nothing is overwritten.
    :returns: the new :class:`CA`, ready to issue.
    """
    directory = Path(directory)
    _check_days(days)
    if not name.strip() or len(name) > 64:
        raise PkiError(f"CA name {name!r}: give 1 to 64 characters")
    existing = [p.name for p in (directory / "ca.pem", directory / "ca.key") if p.exists()]
    if existing:
        raise PkiError(
            f"CA already exists at {directory} ({', '.join(existing)}); "
            "use another directory or remove it first"
        )
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    ca = CA(directory=directory, cert=cert, key=key)
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    with _locked(directory):
        try:
            _write_file(ca.key_path, _key_pem(key), mode=0o600, exclusive=True)
            _write_file(ca.cert_path, cert_pem, mode=0o644, exclusive=True)
        except FileExistsError as exc:
            message = f"CA already exists at {directory} ({exc.filename}); another init got there first"
            raise PkiError(message) from None
        (directory / "issued").mkdir(mode=0o700, exist_ok=True)
        _write_crl(ca, [])
    return ca


def load_ca(directory: str | os.PathLike) -> CA:
    """Load the CA in ``directory`` to issue or revoke with it.

    Called by every ``llmgw ca`` command but ``init``, and by ``llmgw dev``.

    :raises PkiError: naming the file when the CA is missing, unreadable,
        corrupt, readable by others, or its key does not match its certificate.
    :returns: the :class:`CA`.
    """
    directory = Path(directory)
    cert_path, key_path = directory / "ca.pem", directory / "ca.key"
    missing = [p.name for p in (cert_path, key_path) if not p.exists()]
    if missing:
        raise PkiError(
            f"no CA at {directory} ({' and '.join(missing)} missing); "
            f"create one with `llmgw ca init {directory}` or pass the right --ca-dir"
        )
    cert = _read_cert(cert_path)
    mode = key_path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PkiError(f"{key_path} is readable by others (mode {mode:04o}); run `chmod 600 {key_path}`")
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        message = f"{key_path} is not an unencrypted PEM private key ({exc}); restore it from a backup"
        raise PkiError(message) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise PkiError(f"{key_path} is not the key of {cert_path}; restore the pair from a backup")
    constraints = _extension(cert, x509.BasicConstraints)
    if constraints is None or not constraints.ca:
        raise PkiError(
            f"{cert_path} is not a CA certificate; point --ca-dir at a directory made by `llmgw ca init`"
        )
    return CA(directory=directory, cert=cert, key=key)


def issue_server(
    ca: CA | str | os.PathLike,
    names: list[str],
    *,
    out: str | os.PathLike,
    days: int = DEFAULT_LEAF_DAYS,
    overwrite: bool = False,
) -> Issued:
    """Issue a server certificate for ``names`` into ``out``: ``server.pem``, ``server.key`` and ``ca.pem``.

    Called by ``llmgw ca issue-server`` and ``llmgw dev``. Each name becomes a
    SAN: an IP address (v4 or v6) as an IPAddress, anything else as a DNS name
    (lowercased). The first name is the subject's common name. The extended
    key usage is ``serverAuth`` only.

    :raises PkiError: on no names, a name that is neither an address nor a
        host name, or existing files in ``out`` (unless ``overwrite``).
    :returns: the :class:`Issued` certificate and its files.
    """
    if not names:
        raise PkiError("a server certificate needs at least one --name (a host name or an IP address)")
    sans = list(dict.fromkeys(_san(n) for n in names))
    labels = [str(s.value) for s in sans]
    common = labels[0] if len(labels[0]) <= 64 else "llmgw server"
    return _issue(ca, Role.SERVER, common, out=out, days=days, overwrite=overwrite, sans=sans)


def issue_node(
    ca: CA | str | os.PathLike,
    node_id: str,
    *,
    out: str | os.PathLike,
    days: int = DEFAULT_LEAF_DAYS,
    overwrite: bool = False,
) -> Issued:
    """Issue a node's certificate (CN = ``node_id``) into ``out``: ``node.pem``, ``node.key``, ``ca.pem``.

    Called by ``llmgw ca issue-node``, ``llmgw dev`` and onboarding.

    :raises PkiError: on an invalid node id (:func:`validate_name`) or existing
        files in ``out`` (unless ``overwrite``, which renews).
    :returns: the :class:`Issued` certificate and its files.
    """
    return _issue(ca, Role.NODE, validate_name(node_id, Role.NODE), out=out, days=days, overwrite=overwrite)


def issue_admin(
    ca: CA | str | os.PathLike,
    name: str,
    *,
    out: str | os.PathLike,
    days: int = DEFAULT_LEAF_DAYS,
    overwrite: bool = False,
) -> Issued:
    """Issue an admin's client certificate into ``out``: ``admin.pem``, ``admin.key``, ``ca.pem``.

    Called by ``llmgw ca issue-admin`` and ``llmgw dev`` (which writes it where
    ``llmgw ctl`` looks by default). Its role is admin whatever ``name`` says.

    :raises PkiError: as :func:`issue_node`.
    :returns: the :class:`Issued` certificate and its files.
    """
    return _issue(ca, Role.ADMIN, validate_name(name, Role.ADMIN), out=out, days=days, overwrite=overwrite)


def issue_gateway(
    ca: CA | str | os.PathLike,
    name: str,
    *,
    out: str | os.PathLike,
    days: int = DEFAULT_LEAF_DAYS,
    overwrite: bool = False,
) -> Issued:
    """Issue a gateway's client certificate into ``out``: ``gateway.pem``, ``gateway.key``, ``ca.pem``.

    Called by ``llmgw ca issue-gateway`` and ``llmgw dev``. A gateway reads routes and nothing else.

    :raises PkiError: as :func:`issue_node`.
    :returns: the :class:`Issued` certificate and its files.
    """
    name = validate_name(name, Role.GATEWAY)
    return _issue(ca, Role.GATEWAY, name, out=out, days=days, overwrite=overwrite)


def _issue(
    ca: CA | str | os.PathLike,
    role: Role,
    name: str,
    *,
    out: str | os.PathLike,
    days: int,
    overwrite: bool,
    sans: list[x509.GeneralName] | None = None,
) -> Issued:
    ca = ca if isinstance(ca, CA) else load_ca(ca)
    _check_days(days)
    now = _now()
    not_after = now + dt.timedelta(days=days)
    if not_after > ca.cert.not_valid_after_utc:
        raise PkiError(
            f"a {days}-day certificate would outlive the CA, which expires on "
            f"{ca.cert.not_valid_after_utc:%Y-%m-%d}; ask for fewer --days or make a new CA"
        )
    out = Path(out)
    cert_path, key_path, ca_path = out / f"{role.value}.pem", out / f"{role.value}.key", out / "ca.pem"
    ca_pem = ca.cert.public_bytes(serialization.Encoding.PEM)
    if not overwrite:
        taken = [str(p) for p in (cert_path, key_path) if p.exists()]
        if taken:
            raise PkiError(
                f"{' and '.join(taken)} already exist; pass --force to replace them (a renewal) "
                "or choose another --out directory"
            )
        if ca_path.exists() and ca_path.read_bytes() != ca_pem:
            raise PkiError(f"{ca_path} holds another CA's certificate; choose another --out directory")

    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if role is Role.SERVER else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.unit),
                                 x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.CertificatePolicies([x509.PolicyInformation(role.policy_oid, None)]), False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(_authority_key_id(ca), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    identity = identity_of(cert)
    record = IssuedRecord(identity=identity, issued_at=now, names=tuple(str(s.value) for s in sans or ()))

    # The record first: every certificate that leaves this function can be listed and revoked.
    with _locked(ca.directory):
        _write_record(ca.directory, record)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write_file(key_path, _key_pem(key), mode=0o600)
    _write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    _write_file(ca_path, ca_pem, mode=0o644)
    return Issued(identity=identity, cert_path=cert_path, key_path=key_path, ca_path=ca_path)


def revoke(ca: CA | str | os.PathLike, target: str | int, *, role: Role = Role.NODE) -> list[IssuedRecord]:
    """Revoke certificates and rewrite the CA's signed ``crl.pem``.

    Called by ``llmgw ca revoke``. ``target`` is either a name, revoking every
    certificate of ``role`` with that name (a node's renewed ones included), or
    an ``int`` serial, revoking that one certificate whatever its role. An
    admin named like a node is not touched by revoking the node.

    :raises PkiError: when the CA never issued a matching certificate.
    :returns: the records revoked by this call; empty when all were already revoked.
    """
    ca = ca if isinstance(ca, CA) else load_ca(ca)
    with _locked(ca.directory):
        records = list_issued(ca.directory)
        if isinstance(target, int):
            matching = [r for r in records if r.identity.serial == target]
            if not matching:
                raise PkiError(
                    f"this CA never issued serial {_hex(target)}; "
                    f"`llmgw ca list --ca-dir {ca.directory}` shows what it issued"
                )
        else:
            matching = [r for r in records if r.identity.name == target and r.identity.role is role]
            if not matching:
                raise PkiError(
                    f"this CA never issued a {role.value} certificate named {target!r}; "
                    f"`llmgw ca list --ca-dir {ca.directory}` shows what it issued"
                )
        now = _now()
        changed = [attrs.evolve(r, revoked_at=now) for r in matching if r.revoked_at is None]
        for record in changed:
            _write_record(ca.directory, record)
        if changed:
            _write_crl(ca, list_issued(ca.directory))
    return changed


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign, encipher_only=False,
        decipher_only=False,
    )


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        pass
    host = name.lower().rstrip(".")
    if len(host) > 253 or not _DNS_NAME.fullmatch(host):
        raise PkiError(f"server name {name!r} is neither an IP address nor a host name")
    return x509.DNSName(host)
