"""Parallel test runs: each pytest-xdist worker's simulated nodes live on a network of their own."""

from __future__ import annotations

import os

import pytest

from llmgw.testing.pytest_plugin import worker_net


def test_each_worker_moves_the_second_part_of_the_base():
    """gw0 and gw1 of a run on 127.0.26 get 127.1.26 and 127.2.26; another run's base never meets them."""
    assert [worker_net("127.0.26", f"gw{n}") for n in range(3)] == ["127.1.26", "127.2.26", "127.3.26"]
    assert worker_net("127.0.0", "gw0") == "127.1.0"
    assert worker_net("127.0.27", "gw0") != worker_net("127.0.26", "gw0")


@pytest.mark.parametrize(("base", "worker"), [("127.0", "gw0"), ("127.x.26", "gw0"), ("127.250.0", "gw9")])
def test_a_base_that_cannot_serve_the_workers_is_refused_by_name(base, worker):
    """A base that is not three numbers, or runs past 127.255, stops the run naming LLMGW_DEV_NET."""
    with pytest.raises(pytest.UsageError, match=f"LLMGW_DEV_NET={base!r}"):
        worker_net(base, worker)


def test_this_worker_runs_on_its_own_network():
    """In a worker (``-n``), $LLMGW_DEV_NET is the worker's network; in a serial run it is left as it was."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        pytest.skip("a serial run: no worker network to check")
    from llmgw.dev.cluster import NODE_NET

    assert NODE_NET == os.environ["LLMGW_DEV_NET"]
    assert int(NODE_NET.split(".")[1]) >= int(worker.removeprefix("gw")) + 1
