"""Who a certificate says its holder is: :class:`Role`, :class:`Identity`, and reading them.

Holds the package's errors, the role policy OIDs, name rules
(:func:`validate_name`), :func:`role_of`, :func:`identity_of` and
:func:`peer_identity`, and the small certificate readers the other parts share.
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
import re
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.x509.oid import NameOID

from llmgw.errors import LlmgwError

#: The OID arc of llmgw's role policies: a UUID OID (ITU-T X.667), which needs no registration.
ROLE_POLICY_ARC = "2.25.124886498740990280423305298744596932880"
_NAME_RULE = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")


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
    return _identity_of_der(der)


@functools.lru_cache(maxsize=8192)
def _identity_of_der(der: bytes) -> Identity:
    # Every request of a connection carries the same certificate: parse each one once
    # (a fleet's syncs would otherwise spend most of their CPU here). Refusals are not cached.
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise IdentityError(f"the peer's certificate cannot be parsed ({exc})") from None
    return identity_of(cert)


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


def _read_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except FileNotFoundError:
        raise PkiError(f"{path} does not exist") from None
    except ValueError as exc:
        raise PkiError(f"{path} is not a PEM certificate ({exc}); restore it from a backup") from None
