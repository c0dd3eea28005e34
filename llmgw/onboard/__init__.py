"""``llmgw-onboard-node``: give a machine its identity, the release and a running agent.

Run on the host that holds the CA; see ``docs/onboarding.md``.
"""

from llmgw.onboard.cli import main, onboard_node
from llmgw.onboard.node import Item, Settings, onboard
from llmgw.onboard.release import Release, ReleaseError, check_release
from llmgw.onboard.remote import OnboardError, Ssh, SshTarget

__all__ = [
    "Item",
    "OnboardError",
    "Release",
    "ReleaseError",
    "Settings",
    "Ssh",
    "SshTarget",
    "check_release",
    "main",
    "onboard",
    "onboard_node",
]
