"""``python -m llmgw.gateway``: the ``llmgw gateway`` command on its own."""

from llmgw.gateway.cli import gateway_command


def main() -> None:
    """Run the gateway command; llmgw errors are shown as messages, as ``llmgw gateway`` does."""
    gateway_command(prog_name="llmgw gateway")


if __name__ == "__main__":
    main()
