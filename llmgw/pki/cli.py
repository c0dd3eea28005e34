"""``llmgw ca``: make the cluster's CA, issue its certificates, revoke them.

Every command but ``init`` takes ``--ca-dir`` (or ``LLMGW_CA_DIR``). Each
``issue-*`` command writes a bundle into ``--out``: ``ROLE.pem``, ``ROLE.key``
(0600) and the CA's ``ca.pem``, the three files the holder passes as
``--cert``, ``--key`` and ``--ca``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import click
from tabulate import tabulate

from llmgw import pki
from llmgw.cli import Group

__all__ = ["ca"]


_DIR = click.Path(file_okay=False, path_type=Path)

ca_dir_option = click.option(
    "--ca-dir", required=True, type=_DIR, envvar="LLMGW_CA_DIR", show_envvar=True, help="The CA's directory."
)
out_option = click.option(
    "--out", required=True, type=_DIR, help="Directory to write ROLE.pem, ROLE.key (0600) and ca.pem into."
)
days_option = click.option(
    "--days", default=pki.DEFAULT_LEAF_DAYS, show_default=True, type=click.IntRange(min=1),
    help="How long the certificate is valid.",
)
force_option = click.option(
    "--force", is_flag=True, help="Replace a certificate and key already in --out (a renewal)."
)


@click.group(cls=Group)
def ca() -> None:
    """The cluster's certificate authority: every server, node, admin and gateway certificate."""


@ca.command()
@click.argument("directory", type=_DIR)
@click.option("--name", default="llmgw CA", show_default=True, help="The CA's common name.")
@click.option(
    "--days", default=3650, show_default=True, type=click.IntRange(min=1), help="How long the CA lives."
)
def init(directory: Path, name: str, days: int) -> None:
    """Create a new CA in DIRECTORY (made 0700); refuses to overwrite an existing one."""
    authority = pki.init_ca(directory, name=name, days=days)
    expires = authority.cert.not_valid_after_utc
    click.echo(f"created CA {name!r} in {directory}, valid until {expires:%Y-%m-%d}")
    click.echo(f"  {authority.key_path}  private key (0600): keep it on this machine, back it up offline")
    click.echo(f"  {authority.cert_path}  root certificate: every server, node, admin and gateway trusts it")
    click.echo(f"  {authority.crl_path}  revocation list: the server reads it")
    click.echo(f"next: llmgw ca issue-server --ca-dir {directory} --name HOSTNAME --name IP --out DIR")


def _issued(issued: pki.Issued) -> None:
    identity = issued.identity
    click.echo(
        f"issued {identity.role.value} certificate {identity.name!r}, serial {identity.serial_hex}, "
        f"valid until {identity.not_after:%Y-%m-%d}"
    )
    click.echo(f"  {issued.cert_path}  (--cert)")
    click.echo(f"  {issued.key_path}  (--key, 0600)")
    click.echo(f"  {issued.ca_path}  (--ca)")


@ca.command("issue-server")
@ca_dir_option
@click.option(
    "--name", "names", multiple=True, required=True, metavar="NAME",
    help="A host name or IP address clients connect to (repeatable; IPs become IP SANs).",
)
@out_option
@days_option
@force_option
def issue_server(ca_dir: Path, names: tuple[str, ...], out: Path, days: int, force: bool) -> None:
    """Issue the server's certificate for every --name it is reached by."""
    issued = pki.issue_server(pki.load_ca(ca_dir), list(names), out=out, days=days, overwrite=force)
    _issued(issued)
    click.echo(f"  names: {', '.join(names)}")


def _client_command(role: pki.Role, issue: Callable[..., pki.Issued], metavar: str, doc: str) -> None:
    @ca.command(f"issue-{role.value}", help=doc)
    @click.argument("name", metavar=metavar)
    @ca_dir_option
    @out_option
    @days_option
    @force_option
    def command(name: str, ca_dir: Path, out: Path, days: int, force: bool) -> None:
        _issued(issue(pki.load_ca(ca_dir), name, out=out, days=days, overwrite=force))


_client_command(
    pki.Role.NODE, pki.issue_node, "NODE_ID",
    "Issue a node's client certificate; its common name is NODE_ID, the id its agent syncs as.",
)
_client_command(
    pki.Role.ADMIN, pki.issue_admin, "NAME",
    "Issue an admin's client certificate for `llmgw ctl`; it is an admin whatever NAME says.",
)
_client_command(
    pki.Role.GATEWAY, pki.issue_gateway, "NAME",
    "Issue a gateway's client certificate; it may read routes and nothing else.",
)


@ca.command()
@click.argument("name", required=False, metavar="[NODE_ID]")
@ca_dir_option
@click.option(
    "--role", type=click.Choice([r.value for r in pki.Role]), default="node", show_default=True,
    help="The role of the certificates named NODE_ID.",
)
@click.option(
    "--serial", metavar="HEX", help="Revoke one certificate by its serial (as `llmgw ca list` shows it)."
)
def revoke(name: str | None, ca_dir: Path, role: str, serial: str | None) -> None:
    """Revoke every certificate of NODE_ID (or the one --serial) and rewrite the CA's crl.pem.

    The server refuses a revoked certificate from its next request on, with no
    restart; if it runs elsewhere, copy crl.pem to the path it reads.
    """
    if (name is None) == (serial is None):
        raise pki.PkiError("give a NODE_ID or --serial HEX (one of them)")
    if serial is not None:
        try:
            target: str | int = int(serial.replace(":", ""), 16)
        except ValueError:
            raise pki.PkiError(f"--serial {serial!r} is not a hexadecimal serial number") from None
    else:
        target = name
    authority = pki.load_ca(ca_dir)
    revoked = pki.revoke(authority, target, role=pki.Role(role))
    if not revoked:
        click.echo(f"{name or serial}: already revoked; {authority.crl_path} unchanged")
        return
    for record in revoked:
        click.echo(f"revoked {record.identity}")
    click.echo(f"wrote {authority.crl_path}; the server reloads it on its next request")


@ca.command("list")
@ca_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON records instead of a table.")
def list_(ca_dir: Path, as_json: bool) -> None:
    """List every certificate the CA issued: role, name, serial, expiry and status."""
    pki.load_ca(ca_dir)
    records = pki.list_issued(ca_dir)
    if as_json:
        click.echo(json.dumps([dict(r.to_json(), status=r.status()) for r in records], indent=2))
        return
    rows = [
        [r.identity.role.value, r.identity.name, r.identity.serial_hex, f"{r.identity.not_after:%Y-%m-%d}",
         r.status() + (f" {r.revoked_at:%Y-%m-%d}" if r.revoked_at else "")]
        for r in records
    ]
    click.echo(tabulate(rows, headers=["role", "name", "serial", "expires", "status"], tablefmt="simple"))
