"""The CA: real certificates, real mutual-TLS handshakes on 127.0.0.1, revocation and the ``llmgw ca`` CLI."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import ssl
import stat
from functools import partial
from pathlib import Path

import attrs
import pytest
import trio
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw import pki
from llmgw.pki import Role
from llmgw.pki.cli import ca as ca_cli


@pytest.fixture
def authority(tmp_path: Path) -> pki.CA:
    """A fresh CA in tmp_path/ca."""
    return pki.init_ca(tmp_path / "ca")


@pytest.fixture
def server(authority: pki.CA, tmp_path: Path) -> pki.Issued:
    """A server certificate for localhost and 127.0.0.1."""
    return pki.issue_server(authority, ["localhost", "127.0.0.1"], out=tmp_path / "server")


def server_context(server: pki.Issued) -> ssl.SSLContext:
    return pki.server_ssl_context(server.cert_path, server.key_path, server.ca_path)


def client_context(issued: pki.Issued | None, ca_path: Path) -> ssl.SSLContext:
    if issued is None:
        return pki.client_ssl_context(None, None, ca_path)
    return pki.client_ssl_context(issued.cert_path, issued.key_path, ca_path)


@attrs.frozen
class Outcome:
    """What each side of one connection saw."""

    client_ok: bool
    client_error: str | None
    server_identity: pki.Identity | None
    server_error: str | None
    peercert: dict | None = None


async def connect(
    nursery: trio.Nursery,
    server_ctx: ssl.SSLContext,
    client_ctx: ssl.SSLContext,
    server_hostname: str = "127.0.0.1",
) -> Outcome:
    """Serve one TLS connection on 127.0.0.1 port 0 as the llmgw server would, and connect to it."""
    send, receive = trio.open_memory_channel(1)

    async def handler(stream: trio.SSLStream) -> None:
        # As the server must: a failed handshake ends this connection, never the listener.
        try:
            await stream.do_handshake()
            identity = pki.peer_identity(stream.getpeercert(binary_form=True))
            await send.send((identity, None, stream.getpeercert()))
            await stream.send_all(b"ok")
        except (trio.BrokenResourceError, pki.IdentityError) as exc:
            await send.send((None, _reason(exc), None))
        finally:
            await trio.aclose_forcefully(stream)

    serve = partial(trio.serve_ssl_over_tcp, host="127.0.0.1")
    listeners = await nursery.start(serve, handler, 0, server_ctx)
    port = listeners[0].transport_listener.socket.getsockname()[1]
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    client = trio.SSLStream(tcp, client_ctx, server_hostname=server_hostname)
    client_error = None
    try:
        await client.do_handshake()
        # TLS 1.3: the server judges the client's certificate after the client's handshake is done.
        client_ok = await client.receive_some() == b"ok"
    except trio.BrokenResourceError as exc:
        client_ok, client_error = False, _reason(exc)
    finally:
        await trio.aclose_forcefully(client)
    with trio.fail_after(5):
        identity, error, peercert = await receive.receive()
    return Outcome(client_ok, client_error, identity, error, peercert)


def _reason(exc: BaseException) -> str:
    """The SSL error behind trio's BrokenResourceError, as text to match on."""
    return f"{exc!r} {exc.__cause__!r}"


class TestHandshake:
    """Mutual TLS with real certificates: who gets in, and as what."""

    async def test_node_gets_in_as_node(self, nursery, authority, server, tmp_path):
        """A node certificate completes the handshake and peer_identity gives role node and its id."""
        node = pki.issue_node(authority, "node-1", out=tmp_path / "node")
        outcome = await connect(nursery, server_context(server), client_context(node, node.ca_path))
        assert outcome.client_ok
        assert outcome.server_identity.role is Role.NODE
        assert outcome.server_identity.name == "node-1"
        assert outcome.server_identity.serial == node.identity.serial

    async def test_getpeercert_dict_has_the_ou_but_not_the_policy(self, nursery, authority, server, tmp_path):
        """getpeercert()'s dict shows the OU and no extensions, which is why the server parses the DER."""
        node = pki.issue_node(authority, "node-1", out=tmp_path / "node")
        outcome = await connect(nursery, server_context(server), client_context(node, node.ca_path))
        subject = dict(pair for rdn in outcome.peercert["subject"] for pair in rdn)
        assert subject == {"organizationalUnitName": "llmgw-node", "commonName": "node-1"}
        assert pki.ROLE_POLICY_ARC not in repr(outcome.peercert)

    async def test_admin_gets_in_as_admin(self, nursery, authority, server, tmp_path):
        """An admin certificate gives role admin."""
        admin = pki.issue_admin(authority, "alice", out=tmp_path / "admin")
        outcome = await connect(nursery, server_context(server), client_context(admin, admin.ca_path))
        assert outcome.server_identity == admin.identity
        assert outcome.server_identity.role is Role.ADMIN

    async def test_gateway_gets_in_as_gateway(self, nursery, authority, server, tmp_path):
        """A gateway certificate gives role gateway."""
        gateway = pki.issue_gateway(authority, "gw-1", out=tmp_path / "gw")
        outcome = await connect(nursery, server_context(server), client_context(gateway, gateway.ca_path))
        assert (outcome.server_identity.role, outcome.server_identity.name) == (Role.GATEWAY, "gw-1")

    async def test_role_does_not_come_from_the_name(self, nursery, authority, server, tmp_path):
        """An admin named like a node is an admin; a node named 'admin' is a node."""
        admin = pki.issue_admin(authority, "node-1", out=tmp_path / "admin")
        node = pki.issue_node(authority, "admin", out=tmp_path / "node")
        as_admin = await connect(nursery, server_context(server), client_context(admin, admin.ca_path))
        as_node = await connect(nursery, server_context(server), client_context(node, node.ca_path))
        assert (as_admin.server_identity.role, as_admin.server_identity.name) == (Role.ADMIN, "node-1")
        assert (as_node.server_identity.role, as_node.server_identity.name) == (Role.NODE, "admin")

    async def test_no_client_certificate_is_refused(self, nursery, server):
        """A client without a certificate fails the handshake, and the server keeps listening."""
        outcome = await connect(nursery, server_context(server), client_context(None, server.ca_path))
        assert not outcome.client_ok
        assert outcome.server_identity is None
        assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in outcome.server_error

    async def test_certificate_from_another_ca_is_refused(self, nursery, server, tmp_path):
        """A node certificate signed by another CA fails the handshake."""
        other = pki.init_ca(tmp_path / "other-ca")
        stranger = pki.issue_node(other, "node-1", out=tmp_path / "stranger")
        # The stranger trusts our server, so only its own certificate is at stake.
        outcome = await connect(nursery, server_context(server), client_context(stranger, server.ca_path))
        assert not outcome.client_ok
        assert "unable to get local issuer certificate" in outcome.server_error

    async def test_server_certificate_cannot_act_as_client(self, nursery, authority, server, tmp_path):
        """A server certificate (serverAuth only) is refused as a client certificate."""
        outcome = await connect(nursery, server_context(server), client_context(server, server.ca_path))
        assert not outcome.client_ok
        assert "unsuitable certificate purpose" in outcome.server_error

    async def test_node_certificate_cannot_act_as_server(self, nursery, authority, tmp_path):
        """A client refuses a server presenting a node certificate (clientAuth only)."""
        node = pki.issue_node(authority, "127.0.0.1", out=tmp_path / "node")
        posing = pki.server_ssl_context(node.cert_path, node.key_path, node.ca_path)
        admin = pki.issue_admin(authority, "alice", out=tmp_path / "admin")
        outcome = await connect(nursery, posing, client_context(admin, admin.ca_path))
        assert not outcome.client_ok
        assert "unsuitable certificate purpose" in outcome.client_error

    async def test_client_refuses_server_from_another_ca(self, nursery, authority, server, tmp_path):
        """A client refuses a server whose certificate another CA signed."""
        other = pki.init_ca(tmp_path / "other-ca")
        impostor = pki.issue_server(other, ["127.0.0.1"], out=tmp_path / "impostor")
        impostor_ctx = pki.server_ssl_context(impostor.cert_path, impostor.key_path, server.ca_path)
        node = pki.issue_node(authority, "node-1", out=tmp_path / "node")
        outcome = await connect(nursery, impostor_ctx, client_context(node, node.ca_path))
        assert not outcome.client_ok
        assert "unable to get local issuer certificate" in outcome.client_error

    @pytest.mark.parametrize("hostname", ["127.0.0.1", "localhost"])
    async def test_hostname_verification_accepts_listed_names(
        self, nursery, authority, server, tmp_path, hostname
    ):
        """A client verifying 127.0.0.1 or localhost accepts a server certificate listing them."""
        node = pki.issue_node(authority, "node-1", out=tmp_path / "node")
        outcome = await connect(nursery, server_context(server), client_context(node, node.ca_path), hostname)
        assert outcome.client_ok

    async def test_hostname_verification_refuses_other_names(self, nursery, authority, server, tmp_path):
        """A client expecting a name the server certificate lacks refuses it."""
        node = pki.issue_node(authority, "node-1", out=tmp_path / "node")
        outcome = await connect(
            nursery, server_context(server), client_context(node, node.ca_path), "cp.example.org"
        )
        assert not outcome.client_ok
        assert "Hostname mismatch" in outcome.client_error


class TestIdentity:
    """Reading the role: only the policy decides, and OU and policy must agree."""

    def forge(self, authority: pki.CA, *, unit: str | None, policy: Role | None) -> x509.Certificate:
        """A certificate signed by the real CA but not made by issue_*, to test role_of's checks."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = [x509.NameAttribute(NameOID.COMMON_NAME, "node-1")]
        if unit:
            subject.insert(0, x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit))
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(subject))
            .issuer_name(authority.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        )
        if policy:
            builder = builder.add_extension(
                x509.CertificatePolicies([x509.PolicyInformation(policy.policy_oid, None)]), critical=False
            )
        return builder.sign(authority.key, hashes.SHA256())

    def test_ou_alone_does_not_make_an_admin(self, authority):
        """A certificate with OU llmgw-admin but no role policy has no identity."""
        with pytest.raises(pki.IdentityError, match="no llmgw role"):
            pki.role_of(self.forge(authority, unit="llmgw-admin", policy=None))

    def test_ou_that_disagrees_with_the_policy_is_refused(self, authority):
        """A node policy with an admin OU is refused rather than guessed."""
        with pytest.raises(pki.IdentityError, match="role node but OU"):
            pki.role_of(self.forge(authority, unit="llmgw-admin", policy=Role.NODE))

    def test_policy_and_ou_agreeing_give_the_role(self, authority):
        """A certificate with the node policy and OU llmgw-node is a node."""
        assert pki.role_of(self.forge(authority, unit="llmgw-node", policy=Role.NODE)) is Role.NODE

    def test_peer_without_certificate(self):
        """peer_identity(None), what getpeercert gives for no certificate, is an IdentityError."""
        with pytest.raises(pki.IdentityError, match="no client certificate"):
            pki.peer_identity(None)

    def test_expiry_warning(self, authority, tmp_path):
        """A certificate expiring within 30 days warns and says how to renew; a fresh one does not."""
        node = pki.issue_node(authority, "node-1", out=tmp_path / "n", days=365)
        assert node.identity.expiry_warning() is None
        soon = node.identity.not_after - dt.timedelta(days=10, hours=1)
        warning = node.identity.expiry_warning(now=soon)
        assert "expires in 10 days" in warning and "llmgw ca issue-node node-1" in warning
        assert "expired on" in node.identity.expiry_warning(now=node.identity.not_after)


class TestInitAndLoad:
    """Making and loading a CA."""

    def test_init_refuses_to_overwrite(self, authority):
        """A second init in the same directory fails, names it, and leaves the CA unchanged."""
        before = authority.key_path.read_bytes()
        with pytest.raises(pki.PkiError, match="CA already exists at .*ca.pem.*remove it first"):
            pki.init_ca(authority.directory)
        assert authority.key_path.read_bytes() == before

    def test_key_files_are_private(self, authority, tmp_path):
        """ca.key, every issued key, the CA directory and the issued records' folder allow only the owner."""
        node = pki.issue_node(authority, "node-1", out=tmp_path / "node")
        for path in (authority.key_path, node.key_path):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert stat.S_IMODE(authority.directory.stat().st_mode) == 0o700
        assert not list(authority.directory.glob(".*.tmp")), "temporary files left behind"

    def test_load_round_trip(self, authority):
        """load_ca reads back the same certificate and key."""
        loaded = pki.load_ca(authority.directory)
        assert loaded.cert == authority.cert
        assert loaded.key.public_key() == authority.key.public_key()

    def test_load_missing(self, tmp_path):
        """A directory without a CA says how to make one."""
        with pytest.raises(pki.PkiError, match="no CA at .*llmgw ca init"):
            pki.load_ca(tmp_path / "nothing")

    def test_load_corrupt(self, authority):
        """A corrupt ca.pem is named."""
        authority.cert_path.write_text("not a certificate")
        with pytest.raises(pki.PkiError, match="ca.pem is not a PEM certificate"):
            pki.load_ca(authority.directory)

    def test_load_refuses_a_readable_key(self, authority):
        """A CA key readable by others is refused with the chmod that fixes it."""
        authority.key_path.chmod(0o644)
        with pytest.raises(pki.PkiError, match="chmod 600"):
            pki.load_ca(authority.directory)

    def test_load_refuses_a_mismatched_key(self, authority, tmp_path):
        """A ca.key that is not ca.pem's key is refused."""
        other = pki.init_ca(tmp_path / "other")
        authority.key_path.write_bytes(other.key_path.read_bytes())
        with pytest.raises(pki.PkiError, match="is not the key of"):
            pki.load_ca(authority.directory)


class TestIssue:
    """Issuing server and client certificates."""

    def test_server_sans(self, server):
        """IPs become IP SANs and host names DNS SANs; the usage is serverAuth only."""
        cert = x509.load_pem_x509_certificate(server.cert_path.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == ["localhost"]
        assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
        assert pki.role_of(cert) is Role.SERVER

    def test_server_ipv6_and_bad_names(self, authority, tmp_path):
        """An IPv6 address is an IP SAN; a name that is neither address nor host is refused."""
        issued = pki.issue_server(authority, ["::1", "CP.Example.org"], out=tmp_path / "s")
        cert = x509.load_pem_x509_certificate(issued.cert_path.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("::1")]
        assert san.get_values_for_type(x509.DNSName) == ["cp.example.org"]
        with pytest.raises(pki.PkiError, match="neither an IP address nor a host name"):
            pki.issue_server(authority, ["bad name!"], out=tmp_path / "t")

    @pytest.mark.parametrize("node_id", ["a", "node-1", "gpu01.rack-2", "0", "a" * 63])
    def test_valid_node_ids(self, node_id):
        """Lowercase letters, digits, '-' and '.', up to 63, are node ids."""
        assert pki.validate_name(node_id) == node_id

    @pytest.mark.parametrize("node_id", ["", "Node1", "-a", ".a", "a_b", "a b", "a" * 64, "nöde"])
    def test_invalid_node_ids(self, authority, tmp_path, node_id):
        """Anything else is refused, saying what a node id looks like."""
        with pytest.raises(pki.PkiError, match="invalid node id .*lowercase letters"):
            pki.issue_node(authority, node_id, out=tmp_path / "n")

    def test_default_lifetime_and_client_usage(self, authority, tmp_path):
        """A node certificate lives 365 days by default and is for client authentication only."""
        node = pki.issue_node(authority, "node-1", out=tmp_path / "n")
        cert = x509.load_pem_x509_certificate(node.cert_path.read_bytes())
        lifetime = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
        assert dt.timedelta(days=364) < lifetime <= dt.timedelta(days=365)
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]

    def test_lifetime_cannot_outlive_the_ca(self, tmp_path):
        """A certificate asked to outlive the CA is refused with the CA's expiry."""
        short = pki.init_ca(tmp_path / "ca", days=30)
        with pytest.raises(pki.PkiError, match="would outlive the CA"):
            pki.issue_node(short, "node-1", out=tmp_path / "n", days=60)

    def test_existing_files_need_overwrite(self, authority, tmp_path):
        """Issuing into a directory that holds a node certificate needs overwrite (--force)."""
        first = pki.issue_node(authority, "node-1", out=tmp_path / "n")
        with pytest.raises(pki.PkiError, match="already exist.*--force"):
            pki.issue_node(authority, "node-1", out=tmp_path / "n")
        renewed = pki.issue_node(authority, "node-1", out=tmp_path / "n", overwrite=True)
        assert renewed.identity.serial != first.identity.serial

    def test_records_every_issued_certificate(self, authority, tmp_path):
        """Every issued certificate is listed with its role and name."""
        pki.issue_node(authority, "node-1", out=tmp_path / "n")
        pki.issue_admin(authority, "node-1", out=tmp_path / "a")
        records = pki.list_issued(authority.directory)
        listed = {(r.identity.role, r.identity.name, r.status()) for r in records}
        assert listed == {(Role.NODE, "node-1", "valid"), (Role.ADMIN, "node-1", "valid")}


class TestRevocation:
    """Revoking writes a signed CRL that the server can reload cheaply."""

    def test_revoke_by_name_puts_the_serial_in_the_crl(self, authority, tmp_path):
        """Revoking a node puts its serial in crl.pem, and load_revoked reads it back."""
        node = pki.issue_node(authority, "node-1", out=tmp_path / "n")
        other = pki.issue_node(authority, "node-2", out=tmp_path / "m")
        assert pki.load_revoked(authority.directory) == frozenset()
        revoked = pki.revoke(authority.directory, "node-1")
        assert [r.identity.serial for r in revoked] == [node.identity.serial]
        assert pki.load_revoked(authority.directory) == {node.identity.serial}
        assert other.identity.serial not in pki.load_revoked(authority.directory)

    def test_revoking_a_node_spares_an_admin_of_the_same_name(self, authority, tmp_path):
        """Revoking node 'node-1' leaves admin 'node-1' valid."""
        admin = pki.issue_admin(authority, "node-1", out=tmp_path / "a")
        pki.issue_node(authority, "node-1", out=tmp_path / "n")
        pki.revoke(authority, "node-1")
        assert admin.identity.serial not in pki.load_revoked(authority.directory)

    def test_revoke_by_serial_and_twice(self, authority, tmp_path):
        """A serial revokes that certificate; revoking again changes nothing."""
        admin = pki.issue_admin(authority, "alice", out=tmp_path / "a")
        assert len(pki.revoke(authority, admin.identity.serial)) == 1
        assert pki.revoke(authority, admin.identity.serial) == []
        assert pki.load_revoked(authority.directory) == {admin.identity.serial}

    def test_revoke_unknown(self, authority):
        """Revoking a name the CA never issued says where to look."""
        with pytest.raises(pki.PkiError, match="never issued a node certificate named 'ghost'.*ca list"):
            pki.revoke(authority, "ghost")

    def test_crl_from_another_ca_is_refused(self, authority, tmp_path):
        """A CRL signed by another CA is not accepted as this CA's."""
        other = pki.init_ca(tmp_path / "other")
        with pytest.raises(pki.PkiError, match="not signed by the CA"):
            pki.load_crl(other.crl_path, authority.cert_path)

    def test_revocation_list_reloads_when_the_file_changes(self, authority, tmp_path):
        """RevocationList sees a new revocation with no restart, and keeps the last good list on garbage."""
        node = pki.issue_node(authority, "node-1", out=tmp_path / "n")
        served = tmp_path / "server-crl.pem"
        served.write_bytes(authority.crl_path.read_bytes())
        revocations = pki.RevocationList(served, authority.cert_path)
        assert not revocations.is_revoked(node.identity.serial)
        assert revocations.refresh() is False

        pki.revoke(authority, "node-1")
        served.write_bytes(authority.crl_path.read_bytes())
        assert revocations.is_revoked(node.identity.serial)

        served.write_text("garbage")
        assert revocations.is_revoked(node.identity.serial)
        assert "not a PEM revocation list" in revocations.problem

    def test_reissued_node_is_valid_again(self, authority, tmp_path):
        """A node re-issued after revocation gets a new serial that is not revoked."""
        pki.issue_node(authority, "node-1", out=tmp_path / "n")
        pki.revoke(authority, "node-1")
        fresh = pki.issue_node(authority, "node-1", out=tmp_path / "n", overwrite=True)
        assert fresh.identity.serial not in pki.load_revoked(authority.directory)


class TestCli:
    """``llmgw ca`` through click's CliRunner."""

    def run(self, *args: str, code: int = 0):
        result = CliRunner().invoke(ca_cli, [str(a) for a in args])
        assert result.exit_code == code, result.output + (result.stderr if code == 0 else "")
        return result

    def test_init_then_refuses(self, tmp_path):
        """ca init makes the CA; a second ca init errors with what to do."""
        out = self.run("init", tmp_path / "ca").output
        assert "ca.key" in out and "issue-server" in out
        result = self.run("init", tmp_path / "ca", code=1)
        assert "error: CA already exists at" in result.stderr and "remove it first" in result.stderr

    def test_issue_list_revoke(self, tmp_path):
        """Issue every kind, list them, revoke a node and see it listed as revoked."""
        ca_dir = tmp_path / "ca"
        self.run("init", ca_dir)
        self.run("issue-server", "--ca-dir", ca_dir, "--name", "localhost", "--name", "127.0.0.1",
                 "--out", tmp_path / "server")
        self.run("issue-node", "node-1", "--ca-dir", ca_dir, "--out", tmp_path / "node")
        self.run("issue-admin", "node-1", "--ca-dir", ca_dir, "--out", tmp_path / "admin")
        self.run("issue-gateway", "gw-1", "--ca-dir", ca_dir, "--out", tmp_path / "gw", "--days", "30")
        assert (tmp_path / "node" / "node.key").exists() and (tmp_path / "admin" / "admin.pem").exists()

        out = self.run("revoke", "node-1", "--ca-dir", ca_dir).output
        assert "revoked node 'node-1'" in out
        listing = self.run("list", "--ca-dir", ca_dir).output.splitlines()
        rows = {tuple(line.split()[:2]): line for line in listing}
        assert "revoked" in rows[("node", "node-1")]
        assert rows[("admin", "node-1")].rstrip().endswith("valid")
        assert ("server", "localhost") in rows and ("gateway", "gw-1") in rows

    def test_errors_say_what_to_do(self, tmp_path):
        """A bad node id, a missing CA and an unknown revocation are one-line errors with exit code 1."""
        self.run("init", tmp_path / "ca")
        bad = self.run("issue-node", "Node_1", "--ca-dir", tmp_path / "ca", "--out", tmp_path / "n", code=1)
        assert bad.stderr.startswith("error: invalid node id 'Node_1'")
        missing = self.run("issue-node", "n-1", "--ca-dir", tmp_path / "no", "--out", tmp_path / "n", code=1)
        assert "llmgw ca init" in missing.stderr
        ghost = self.run("revoke", "ghost", "--ca-dir", tmp_path / "ca", code=1)
        assert "never issued a node certificate named 'ghost'" in ghost.stderr

    def test_list_json(self, tmp_path):
        """ca list --json gives role, name, serial, expiry and status per certificate."""
        self.run("init", tmp_path / "ca")
        self.run("issue-node", "node-1", "--ca-dir", tmp_path / "ca", "--out", tmp_path / "n")
        (record,) = json.loads(self.run("list", "--ca-dir", tmp_path / "ca", "--json").output)
        assert record["role"] == "node" and record["name"] == "node-1" and record["status"] == "valid"
        assert int(record["serial"], 16) > 0 and record["not_after"]
