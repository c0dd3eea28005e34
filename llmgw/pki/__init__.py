"""llmgw's own certificate authority: who may talk to the server, and as what.

Every llmgw process speaks mutual TLS with certificates from one CA made by
``llmgw ca init``. A certificate says two things: a *name* (the subject's
common name: a node id, an admin's name, a gateway's name, a server's first
host name) and a *role* (node, admin, gateway or server).

Where the role lives
--------------------
The authoritative role is a certificate policy: the X.509
``certificatePolicies`` extension holds exactly one OID under
:data:`ROLE_POLICY_ARC` (``.1`` node, ``.2`` admin, ``.3`` gateway, ``.4``
server). The subject's organizational unit (``OU=llmgw-node``...) repeats it
for people and logs, and :func:`role_of` refuses a certificate whose OU
disagrees with its policy. The name never decides anything: an admin named
``node-1`` is an admin, a node named ``admin`` is a node.

Why a policy and not the OU alone: the subject is text, the part of a
certificate a requester writes (a node sending a signing request at
onboarding would choose its own), and the part tools copy and print. A policy
OID is a typed value that only this CA's issuing code sets, that no name can
spell, and that every X.509 tool shows (``openssl x509 -text``). It is not in
the dict of ``ssl.SSLSocket.getpeercert()`` (which shows the subject, OU
included, but no extensions), so the server parses the DER from
``getpeercert(binary_form=True)`` with :func:`peer_identity`. The extended key
usage keeps the sides apart as well: clients carry ``clientAuth`` only and
servers ``serverAuth`` only, and OpenSSL checks it during the handshake.

A CA directory
--------------
``ca.key`` (0600, the CA's private key: keep it on the machine that issues),
``ca.pem`` (the root every process trusts), ``crl.pem`` (the signed
revocation list the server reads), ``issued/<serial>.json`` (one record per
certificate issued, so ``revoke`` and ``list`` work by name) and ``.lock``.

Revocation is checked by the server after the handshake, against the serials
of a CRL it reloads when the file changes (:class:`RevocationList`), so a
refusal can say why and no restart is needed.
"""

from __future__ import annotations

import datetime as dt
import enum
import fcntl
import ipaddress
import json
import os
import re
import secrets
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import LlmgwError

__all__ = [
    "ROLE_POLICY_ARC",
    "PkiError",
    "IdentityError",
    "Role",
    "CA",
    "Identity",
    "Issued",
    "IssuedRecord",
    "RevocationList",
    "init_ca",
    "load_ca",
    "issue_server",
    "issue_node",
    "issue_admin",
    "issue_gateway",
    "role_of",
    "identity_of",
    "peer_identity",
    "validate_name",
    "list_issued",
    "revoke",
    "load_crl",
    "load_revoked",
    "server_ssl_context",
    "client_ssl_context",
]

#: The OID arc of llmgw's role policies: a UUID OID (ITU-T X.667), which needs no registration.
ROLE_POLICY_ARC = "2.25.124886498740990280423305298744596932880"
#: Days a leaf certificate lives unless told otherwise.
DEFAULT_LEAF_DAYS = 365
#: How far back ``notBefore`` is set, so a node whose clock is a little behind accepts a new certificate.
_BACKDATE = dt.timedelta(minutes=5)
#: The ``nextUpdate`` of a CRL. The server reads serials and ignores it; OpenSSL-style checkers would not.
_CRL_DAYS = 365
_NAME_RULE = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")
_DNS_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_DNS_NAME = re.compile(rf"(\*\.)?{_DNS_LABEL}(\.{_DNS_LABEL})*")


class PkiError(LlmgwError):
    """A CA, certificate or key that cannot be used as asked; the message says what to do."""


class IdentityError(PkiError):
    """A peer certificate that carries no usable llmgw identity: the server refuses the peer."""


class Role(enum.Enum):
    """What a certificate's holder may do; read from the certificate's policy, never from its name."""

    NODE = "node"
    ADMIN = "admin"
    GATEWAY = "gateway"
    SERVER = "server"

    @property
    def policy_oid(self) -> x509.ObjectIdentifier:
        """The certificate policy OID that carries this role (authoritative)."""
        return _ROLE_OIDS[self]

    @property
    def unit(self) -> str:
        """The subject OU that repeats this role for people (``llmgw-node``...)."""
        return f"llmgw-{self.value}"


_ROLE_OIDS = {
    role: x509.ObjectIdentifier(f"{ROLE_POLICY_ARC}.{number}")
    for role, number in ((Role.NODE, 1), (Role.ADMIN, 2), (Role.GATEWAY, 3), (Role.SERVER, 4))
}
_ROLE_BY_OID = {oid: role for role, oid in _ROLE_OIDS.items()}


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
class Identity:
    """Who a verified certificate belongs to: its role, name, serial and expiry (UTC)."""

    role: Role
    name: str
    serial: int
    not_after: dt.datetime

    @property
    def serial_hex(self) -> str:
        """The serial as lowercase hex, as ``llmgw ca list`` prints it."""
        return _hex(self.serial)

    def expiry_warning(self, *, within_days: int = 30, now: dt.datetime | None = None) -> str | None:
        """A warning when the certificate expires within ``within_days``, or ``None`` when it does not.

        :returns: e.g. ``"certificate expires in 12 days (2026-01-04); reissue it with
            `llmgw ca issue-node node-1`"``, or ``"certificate expired on ..."``.
        """
        now = now or _now()
        left = self.not_after - now
        if left > dt.timedelta(days=within_days):
            return None
        fix = f"reissue it with `llmgw ca issue-{self.role.value} {self.name}`"
        if left <= dt.timedelta(0):
            return f"certificate expired on {self.not_after:%Y-%m-%d}; {fix}"
        return f"certificate expires in {left.days} days ({self.not_after:%Y-%m-%d}); {fix}"

    def __str__(self) -> str:
        return f"{self.role.value} {self.name!r} (serial {self.serial_hex})"


@attrs.frozen
class Issued:
    """What an ``issue_*`` call made: the certificate's identity and the three files written."""

    identity: Identity
    cert_path: Path
    key_path: Path
    ca_path: Path


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


# --- the CA --------------------------------------------------------------------------------------


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


# --- issuing -------------------------------------------------------------------------------------


def validate_name(name: str, role: Role = Role.NODE) -> str:
    """Check a node id (or admin or gateway name): 1 to 63 of ``a-z 0-9 - .``, first a letter or digit.

    :raises PkiError: saying what a valid name looks like.
    :returns: ``name`` unchanged.
    """
    if not _NAME_RULE.fullmatch(name):
        what = "node id" if role is Role.NODE else f"{role.value} name"
        raise PkiError(
            f"invalid {what} {name!r}: use 1 to 63 lowercase letters, digits, '-' and '.', "
            "starting with a letter or digit"
        )
    return name


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


# --- reading identities --------------------------------------------------------------------------


def role_of(cert: x509.Certificate) -> Role:
    """The role a certificate issued by ``llmgw ca`` carries, from its certificate policy.

    Called through :func:`identity_of`; the certificate's chain must already
    be verified (the TLS handshake does that).

    :raises IdentityError: when the certificate has no llmgw role policy, more
        than one, or a subject OU that names another role.
    :returns: the :class:`Role`.
    """
    try:
        policies = _extension(cert, x509.CertificatePolicies)
    except ValueError as exc:
        message = f"certificate serial {_hex(cert.serial_number)} has malformed extensions ({exc})"
        raise IdentityError(message) from None
    roles = {_ROLE_BY_OID[p.policy_identifier] for p in policies or () if p.policy_identifier in _ROLE_BY_OID}
    if len(roles) != 1:
        found = "no llmgw role" if not roles else "several llmgw roles"
        raise IdentityError(
            f"certificate {_describe(cert)} carries {found}; issue it with `llmgw ca issue-node` "
            "(or issue-admin, issue-gateway)"
        )
    (role,) = roles
    units = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
    if units != [role.unit]:
        raise IdentityError(f"certificate {_describe(cert)} has role {role.value} but OU {units}; refused")
    return role


def identity_of(cert: x509.Certificate) -> Identity:
    """The :class:`Identity` of a verified certificate: role from its policy, name from its common name.

    :raises IdentityError: as :func:`role_of`, or when the subject has not
        exactly one common name.
    :returns: the :class:`Identity`.
    """
    role = role_of(cert)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        raise IdentityError(f"certificate {_describe(cert)} has {len(names)} common names; it must have one")
    return Identity(role=role, name=str(names[0].value), serial=cert.serial_number,
                    not_after=cert.not_valid_after_utc)


def peer_identity(der: bytes | None) -> Identity:
    """The identity of a TLS peer, from ``SSLStream.getpeercert(binary_form=True)``.

    Called by the server after each handshake. The dict form of
    ``getpeercert()`` has no extensions, so the role policy is read from the
    DER. The handshake has verified the chain; this reads who it is.

    :raises IdentityError: when there is no certificate (``None``), it cannot
        be parsed, or it carries no usable identity.
    :returns: the peer's :class:`Identity`.
    """
    if not der:
        raise IdentityError("the peer sent no client certificate")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise IdentityError(f"the peer's certificate cannot be parsed ({exc})") from None
    return identity_of(cert)


# --- records and revocation ----------------------------------------------------------------------


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


# --- TLS contexts --------------------------------------------------------------------------------


def server_ssl_context(
    cert: str | os.PathLike, key: str | os.PathLike, ca: str | os.PathLike
) -> ssl.SSLContext:
    """A TLS ≥ 1.2 server context that requires a client certificate signed by ``ca``.

    Called by ``llmgw server`` (and tests). Identify the client afterwards with
    :func:`peer_identity` and check revocation with :class:`RevocationList`.

    :raises PkiError: naming the file that cannot be loaded.
    :returns: the context.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.verify_mode = ssl.CERT_REQUIRED
    return _finish_context(context, cert, key, ca)


def client_ssl_context(
    cert: str | os.PathLike | None, key: str | os.PathLike | None, ca: str | os.PathLike
) -> ssl.SSLContext:
    """A TLS ≥ 1.2 client context that verifies the server against ``ca``, host name included.

    Called by agents, ``llmgw ctl`` and gateways. ``cert`` and ``key`` are the
    client's own certificate; ``None`` makes a client without one (which the
    server refuses; useful in tests).

    :raises PkiError: naming the file that cannot be loaded.
    :returns: the context (``check_hostname`` on: connect with the name or IP the server's certificate lists).
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    return _finish_context(context, cert, key, ca)


def _finish_context(
    context: ssl.SSLContext,
    cert: str | os.PathLike | None,
    key: str | os.PathLike | None,
    ca: str | os.PathLike,
) -> ssl.SSLContext:
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    try:
        context.load_verify_locations(cafile=os.fspath(ca))
    except (OSError, ssl.SSLError) as exc:
        raise PkiError(f"cannot load the CA certificate {ca}: {exc}") from None
    if cert is not None:
        try:
            context.load_cert_chain(os.fspath(cert), os.fspath(key) if key is not None else None)
        except (OSError, ssl.SSLError) as exc:
            raise PkiError(f"cannot load the certificate {cert} with key {key}: {exc}") from None
    return context


# --- helpers -------------------------------------------------------------------------------------


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def _hex(serial: int) -> str:
    return format(serial, "x")


def _check_days(days: int) -> None:
    if days < 1:
        raise PkiError(f"--days must be at least 1, got {days}")


def _common_name(cert: x509.Certificate) -> str | None:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else None


def _describe(cert: x509.Certificate) -> str:
    return f"CN={_common_name(cert)!r} serial {_hex(cert.serial_number)}"


def _extension(cert: x509.Certificate, kind: type) -> object | None:
    try:
        return cert.extensions.get_extension_for_class(kind).value
    except x509.ExtensionNotFound:
        return None


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign, encipher_only=False,
        decipher_only=False,
    )


def _authority_key_id(ca: CA) -> x509.AuthorityKeyIdentifier:
    ski = _extension(ca.cert, x509.SubjectKeyIdentifier)
    if ski is not None:
        return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)
    return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key())


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        pass
    host = name.lower().rstrip(".")
    if len(host) > 253 or not _DNS_NAME.fullmatch(host):
        raise PkiError(f"server name {name!r} is neither an IP address nor a host name")
    return x509.DNSName(host)


def _read_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except FileNotFoundError:
        raise PkiError(f"{path} does not exist") from None
    except ValueError as exc:
        raise PkiError(f"{path} is not a PEM certificate ({exc}); restore it from a backup") from None


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


def _write_crl(ca: CA, records: list[IssuedRecord]) -> None:
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
