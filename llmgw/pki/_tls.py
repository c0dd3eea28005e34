"""TLS contexts for mutual TLS with the llmgw CA's certificates: server side and client side."""

from __future__ import annotations

import os
import ssl

from llmgw.pki._identity import PkiError


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
