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

The parts
---------
:mod:`~llmgw.pki._identity` (roles, identities, name rules),
:mod:`~llmgw.pki._ca` (making, loading and issuing with a CA, revoking),
:mod:`~llmgw.pki._crl` (signed revocation lists), :mod:`~llmgw.pki._files`
(the CA directory's records, atomic writes, lock), :mod:`~llmgw.pki._tls`
(TLS contexts). Use them through this package: ``from llmgw import pki``.
"""

from llmgw.pki._ca import (
    CA,
    DEFAULT_LEAF_DAYS,
    Issued,
    init_ca,
    issue_admin,
    issue_gateway,
    issue_node,
    issue_server,
    load_ca,
    revoke,
)
from llmgw.pki._crl import RevocationList, load_crl, load_revoked
from llmgw.pki._files import IssuedRecord, list_issued
from llmgw.pki._identity import (
    ROLE_POLICY_ARC,
    Identity,
    IdentityError,
    PkiError,
    Role,
    identity_of,
    peer_identity,
    role_of,
    validate_name,
)
from llmgw.pki._tls import client_ssl_context, server_ssl_context

__all__ = [
    "ROLE_POLICY_ARC",
    "DEFAULT_LEAF_DAYS",
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
