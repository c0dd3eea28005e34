"""``python -m llmgw.onboard``: the same as ``llmgw-onboard-node``."""

from llmgw.onboard.cli import main

main()
