"""``python -m llmgw.gateway``: the ``llmgw gateway`` command on its own."""

import sys

from llmgw.cli import Group
from llmgw.gateway.cli import gateway_command


def main() -> None:
    """Run the gateway command, showing llmgw errors as messages (as ``llmgw gateway`` does)."""
    group = Group("llmgw", commands=[gateway_command])
    group(["gateway", *sys.argv[1:]], prog_name="llmgw")


if __name__ == "__main__":
    main()
