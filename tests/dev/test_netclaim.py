"""One local cluster per node network: a second one is refused at once, naming the first and the way out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmgw.dev.netclaim import NetTaken, claim_net


def test_a_second_claim_names_the_holder_and_llmgw_dev_net(tmp_path):
    """The network is held until released; the refusal names the holder's pid and state dir, and the fix."""
    first = claim_net("127.0.88", tmp_path / "one", folder=tmp_path)
    with pytest.raises(NetTaken) as taken:
        claim_net("127.0.88", tmp_path / "two", folder=tmp_path)
    message = str(taken.value)
    assert f"pid {os.getpid()}, state in {tmp_path / 'one'}" in message
    assert "127.0.88.x" in message and "LLMGW_DEV_NET" in message
    claim_net("127.0.89", tmp_path / "two", folder=tmp_path).release()  # another network is free
    first.release()
    claim_net("127.0.88", tmp_path / "two", folder=tmp_path).release()


def test_a_killed_holder_leaves_the_network_free(tmp_path):
    """A cluster's process killed with SIGKILL holds nothing: the next one claims the network."""
    code = (
        "import sys, pathlib; from llmgw.dev.netclaim import claim_net;"
        f"c = claim_net('127.0.88', pathlib.Path('x'), folder=pathlib.Path({str(tmp_path)!r}));"
        "print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        with pytest.raises(NetTaken):
            claim_net("127.0.88", tmp_path / "two", folder=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    claim_net("127.0.88", tmp_path / "two", folder=tmp_path).release()
