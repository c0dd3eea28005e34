"""The ``llmgw-onboard-node`` command line.

Exit status: 0 onboarded (the server sees the node), 1 failed, 2 bad flags or a refused release.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from llmgw.cli import Command
from llmgw.errors import LlmgwError

__all__ = ["main", "onboard_node"]

_DIR = click.Path(file_okay=False, path_type=Path)


@click.command(cls=Command, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--node", required=True, help="The node id: its certificate's common name.")
@click.option("--addr", required=True, metavar="HOST[:PORT]", help="Where to ssh to (port 22 by default).")
@click.option("--server", required=True, metavar="URL", help="The server's URL, https://HOST:PORT.")
@click.option(
    "--fabric",
    "fabrics",
    multiple=True,
    metavar="NAME[:ADAPTER,...]",
    help="A fabric the node is on (repeatable); none: an island.",
)
@click.option(
    "--ca-dir",
    required=True,
    type=_DIR,
    envvar="LLMGW_CA_DIR",
    show_envvar=True,
    help="The CA's directory (llmgw ca init); node certificates are kept in its nodes/, "
    "ssh host keys in its known_hosts.",
)
@click.option(
    "--release",
    "release_dir",
    required=True,
    type=_DIR,
    metavar="DIR",
    help="A release folder built by scripts/release (RELEASE manifest, wheels).",
)
@click.option("--ssh-user", default="root", show_default=True, help="Who to ssh as (not root: sudo -n).")
@click.option(
    "--ssh-key",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="The ssh private key  [default: ssh's own choice].",
)
@click.option("--ssh-port", type=click.IntRange(1, 65535), help="The ssh port (overrides --addr's).")
@click.option(
    "--address",
    metavar="IP",
    help="The address the agent reports and engines bind  [default: --addr's host].",
)
@click.option("--nvidia-smi", metavar="PATH", help="The node's nvidia-smi, when it is not on PATH.")
@click.option(
    "--ib-root", metavar="DIR", help="The node's sysfs RDMA root  [default: /sys/class/infiniband]."
)
@click.option(
    "--admin-config-dir",
    type=_DIR,
    help="Where ctl's credentials are (ca.pem, admin.pem, admin.key), to watch the node list  "
    "[default: llmgw ctl's].",
)
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    default=180,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait for the node to appear in the server's node list; 0: do not wait.",
)
@click.option("--remote-root", default="", hidden=True, help="Tests: prefix of every path on the node.")
@click.option(
    "--remote-path", multiple=True, hidden=True, help="Tests: folders put first on the node's PATH."
)
def onboard_node(
    node: str,
    addr: str,
    server: str,
    fabrics: tuple[str, ...],
    ca_dir: Path,
    release_dir: Path,
    ssh_user: str,
    ssh_key: Path | None,
    ssh_port: int | None,
    address: str | None,
    nvidia_smi: str | None,
    ib_root: str | None,
    admin_config_dir: Path | None,
    wait: float,
    remote_root: str,
    remote_path: tuple[str, ...],
) -> None:
    """Onboard a machine as llmgw node NODE, from the host that holds the CA.

    Issues the node's certificate (or keeps a valid one), and over ssh installs
    it with its key and the CA root under /etc/llmgw, trusts the root
    system-wide, installs llmgw and the engine plugins from --release into
    /opt/llmgw/venv, writes /etc/llmgw/agent.toml and the llmgw-agent systemd
    unit, starts the agent, and waits until the server lists the node.

    Safe to re-run: only what differs is sent, each item is reported as
    installed, updated or unchanged, and the agent is restarted only when
    something changed.
    """
    from llmgw.agent.config import AgentConfigError, _check_server
    from llmgw.ctl.client import AdminClient, ClientConfig
    from llmgw.node.fabric import parse_fabric_option
    from llmgw.onboard.node import Settings, onboard
    from llmgw.onboard.release import check_release
    from llmgw.onboard.remote import OnboardError, Ssh, SshTarget, parse_addr
    from llmgw.pki import load_ca, validate_name

    admin = None
    try:
        try:
            validate_name(node)
        except LlmgwError as exc:
            raise click.BadParameter(str(exc), param_hint="--node") from None
        try:
            _check_server(server)
        except AgentConfigError as exc:
            raise click.BadParameter(str(exc).removeprefix("--server "), param_hint="--server") from None
        for text in fabrics:
            parse_fabric_option(text)
        release = check_release(release_dir)
        ca = load_ca(ca_dir)
        host, port = parse_addr(addr, ssh_port)
        if wait > 0:
            try:
                admin = AdminClient(ClientConfig.resolve(server, None, None, None, admin_config_dir))
            except LlmgwError as exc:
                raise OnboardError(
                    f"cannot watch the server's node list: {exc}\n(pass --admin-config-dir, or --wait 0 "
                    "to onboard without waiting for the node to appear)"
                ) from None
        if address is None and not _is_ip(host):
            click.echo(
                f"note: the agent will report {host} as its address (engines bind it); "
                "pass --address IP if that name does not resolve to the node's fabric-facing IP"
            )
        settings = Settings(
            node=node,
            server=server.rstrip("/"),
            address=address or host,
            fabrics=fabrics,
            ca_dir=ca.directory,
            release=release,
            nvidia_smi=nvidia_smi,
            ib_root=ib_root,
            wait=wait,
            remote_root=remote_root.rstrip("/"),
        )
        target = SshTarget(
            host=host, port=port, user=ssh_user, known_hosts=ca.directory / "known_hosts", key=ssh_key
        )
        onboard(settings, Ssh(target, remote_path=remote_path), click.echo, admin)
    finally:
        if admin is not None:
            admin.close()
    click.echo(f"onboarded {node}")


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def main() -> None:
    """Entry point of the ``llmgw-onboard-node`` console script."""
    onboard_node(prog_name="llmgw-onboard-node")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
