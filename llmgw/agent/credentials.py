"""The node's credentials: its certificate and key on disk, used from the next sync on when they change.

The agent checks them before every sync (:meth:`Credentials.reload_if_changed`)
so a re-onboarded or renewed node needs no restart, and reads the
certificate's expiry (:meth:`Credentials.expired`): a node whose certificate
expired fences itself rather than run what no server can vouch for.
"""

from __future__ import annotations

import logging
import ssl
import time
from pathlib import Path

from cryptography import x509

from llmgw.agent.replies import file_stamp
from llmgw.pki import PkiError, client_ssl_context

__all__ = ["Credentials"]

log = logging.getLogger("llmgw.agent")


class Credentials:
    """The TLS context made from ``cert``/``key``/``ca`` and the certificate's expiry, kept current."""

    def __init__(self, node: str, cert: Path, key: Path, ca: Path, context: ssl.SSLContext | None) -> None:
        self.node, self.cert, self.key, self.ca = node, cert, key, ca
        #: the client TLS context syncs use
        self.context = context
        #: when this node's certificate expires (epoch seconds; None: not known)
        self.not_after: float | None = None
        self._stamp: tuple | None = None

    def read_expiry(self) -> None:
        """Read the expiry of the certificate on disk; called once at start, after the context was made."""
        certificate = x509.load_pem_x509_certificate(self.cert.read_bytes())
        self.not_after = certificate.not_valid_after_utc.timestamp()

    def reload_if_changed(self) -> bool:
        """Whether ``cert``/``key`` changed on disk (re-onboarded, renewed); if so, use them from now on.

        Called before every sync. A pair that cannot be loaded (half written)
        is logged and tried again once the files change again.
        """
        stamp = file_stamp(self.cert, self.key)
        if self._stamp is None or stamp == self._stamp:
            self._stamp = stamp
            return False
        self._stamp = stamp
        try:
            context = client_ssl_context(self.cert, self.key, self.ca)
            certificate = x509.load_pem_x509_certificate(self.cert.read_bytes())
        except (PkiError, OSError, ValueError) as exc:
            log.warning("node %s: the changed certificate cannot be used yet: %s", self.node, exc)
            return False
        self.context = context
        self.not_after = certificate.not_valid_after_utc.timestamp()
        serial = certificate.serial_number
        log.info("node %s: using the new certificate %s (serial %x)", self.node, self.cert, serial)
        return True

    def expired(self) -> str | None:
        """Why the node must fence itself (its certificate expired), or None; called before every sync."""
        if self.not_after is None or time.time() < self.not_after:
            return None
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.not_after))
        return f"this node's certificate {self.cert} expired at {when}; re-onboard the node"
