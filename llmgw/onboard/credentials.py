"""The node's certificate for onboarding: keep the one issued before while it is good, else issue one.

:func:`node_credentials` is called once per onboarding, after the node was
probed; its files live in ``<ca-dir>/nodes/<node>/``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

from llmgw import pki

__all__ = ["RENEW_WITHIN", "node_credentials"]

#: A kept certificate must have at least this much life left; otherwise onboarding issues a new one.
RENEW_WITHIN = dt.timedelta(days=30)


def node_credentials(ca_dir: Path, node: str, echo: Callable[[str], None]) -> pki.Issued:
    """The node's certificate, key and CA root in ``<ca-dir>/nodes/<node>/``: kept if still good, else issued.

    A certificate is kept when the CA's records list it as valid for more than
    :data:`RENEW_WITHIN`, it is for this node, and the key beside it is its key.
    """
    ca = pki.load_ca(ca_dir)
    out = ca.directory / "nodes" / node
    cert_path, key_path = out / "node.pem", out / "node.key"
    reason = "none was issued by onboarding yet"
    if cert_path.exists() and key_path.exists():
        reason = _unusable(ca, cert_path, key_path, node)
        if reason is None:
            identity = pki.identity_of(_load_cert(cert_path))
            echo(
                f"certificate: keeping serial {identity.serial_hex} of node {node} "
                f"(valid until {identity.not_after:%Y-%m-%d})"
            )
            ca_path = out / "ca.pem"
            ca_path.write_bytes(ca.cert_path.read_bytes())
            return pki.Issued(identity=identity, cert_path=cert_path, key_path=key_path, ca_path=ca_path)
    issued = pki.issue_node(ca, node, out=out, overwrite=True)
    echo(
        f"certificate: issued serial {issued.identity.serial_hex} for node {node} "
        f"(valid until {issued.identity.not_after:%Y-%m-%d}; {reason})"
    )
    others = [
        r
        for r in pki.list_issued(ca.directory)
        if r.identity.role is pki.Role.NODE
        and r.identity.name == node
        and r.identity.serial != issued.identity.serial
        and r.status() == "valid"
    ]
    if others:
        serials = ", ".join(r.identity.serial_hex for r in others)
        echo(
            f"note: {len(others)} older certificate(s) of {node} are still valid (serial {serials}); "
            f"revoke one with `llmgw ca revoke --serial SERIAL --ca-dir {ca.directory}`"
        )
    return issued


def _load_cert(path: Path):
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes())


def _unusable(ca: pki.CA, cert_path: Path, key_path: Path, node: str) -> str | None:
    """Why the certificate in the node's folder cannot be kept, or ``None`` when it can."""
    from cryptography.hazmat.primitives import serialization

    try:
        cert = _load_cert(cert_path)
        identity = pki.identity_of(cert)
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, pki.PkiError) as exc:
        return f"the one in {cert_path.parent} cannot be read ({exc})"
    if identity.role is not pki.Role.NODE or identity.name != node:
        return f"the one in {cert_path.parent} is for {identity}"
    if cert.issuer != ca.cert.subject or key.public_key() != cert.public_key():
        return f"the one in {cert_path.parent} is not from this CA or does not match its key"
    record = next((r for r in pki.list_issued(ca.directory) if r.identity.serial == identity.serial), None)
    if record is None:
        return f"serial {identity.serial_hex} is not in the CA's records"
    status = record.status()
    if status != "valid":
        return f"serial {identity.serial_hex} is {status}"
    if identity.not_after - dt.datetime.now(dt.UTC) < RENEW_WITHIN:
        return f"serial {identity.serial_hex} expires on {identity.not_after:%Y-%m-%d}"
    return None
