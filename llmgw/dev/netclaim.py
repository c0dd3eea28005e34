"""A local cluster's claim on its nodes' network: one cluster per ``LLMGW_DEV_NET`` on a machine.

The simulated nodes of a :class:`~llmgw.dev.cluster.LocalCluster` listen on
``NET.11``, ``NET.12``... with engines on the same port ranges. Two clusters on
one network (two ``llmgw dev``, a benchmark beside a test run) would reach each
other's engines: a worker joining another cluster's rank 0, a health check
answered by the wrong engine, "Address already in use" that no log explains.
So the first agent a cluster starts takes an exclusive lock on a file named for
the network (:func:`claim_net`); a second cluster is refused at once, naming
the first and what to do. The lock goes with the process that holds it, even
when it is killed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from llmgw.agent.records import FileClaimed, claim_file
from llmgw.errors import LlmgwError

__all__ = ["NetClaim", "NetTaken", "claim_net"]


class NetTaken(LlmgwError):
    """Another local cluster runs its nodes on this network."""


class NetClaim:
    """A held claim; :meth:`release` gives it up (also when the process ends)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the network up; called when the cluster stops. Calling it again does nothing."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim_net(net: str, state_dir: Path, folder: Path | None = None) -> NetClaim:
    """Claim ``net`` (``127.0.0``) for the cluster under ``state_dir``; called before its first agent starts.

    :param folder: where the lock files are (the system's temporary folder by default).
    :raises NetTaken: another process holds it, named with its state dir and what to do instead.
    """
    path = (folder or Path(tempfile.gettempdir())) / f"llmgw-dev-net-{net}.lock"
    try:
        fd = claim_file(path, f"pid {os.getpid()}, state in {state_dir}")
    except FileClaimed as claimed:
        holder = claimed.holder or "another process"
        raise NetTaken(
            f"another local cluster runs its nodes on {net}.x ({holder}); stop it, or set "
            "LLMGW_DEV_NET to another network (three numbers such as 127.0.27) to run beside it"
        ) from None
    return NetClaim(fd)
