"""What one onboarding of a node is told: :class:`Settings`, from ``llmgw-onboard-node``'s command line."""

from __future__ import annotations

from pathlib import Path

import attrs

from llmgw.onboard.release import Release

__all__ = ["Settings"]


@attrs.frozen
class Settings:
    """Everything one onboarding needs, from the command line."""

    node: str
    server: str
    #: the address the agent reports and engines bind
    address: str
    fabrics: tuple[str, ...]
    ca_dir: Path
    release: Release
    nvidia_smi: str | None = None
    ib_root: str | None = None
    #: seconds to wait for the node to appear; 0: do not wait
    wait: float = 180.0
    #: prefix of every remote path (tests only)
    remote_root: str = ""
