"""Multi-node replicas: a real rendezvous between processes on 127.0.0.x."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from llmgw.testing.processes import free_port, wait_until

RANK0_HOST = "127.0.0.2"


@pytest.fixture
def worker_argv(sim_program):
    """``worker_argv(rank, nnodes, dist_init, *extra)``: the command of a worker on 127.0.0.(2 + rank)."""

    def build(rank: int, nnodes: int, dist_init: str, *extra: str) -> list[str]:
        return [
            sim_program,
            "--model",
            "test/model",
            "--host",
            f"127.0.0.{2 + rank}",
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(rank),
            "--dist-init-addr",
            dist_init,
            *extra,
        ]

    return build


def start_rank0(start_sim, nnodes: int, *extra: str):
    dist_init = f"{RANK0_HOST}:{free_port(RANK0_HOST)}"
    sim = start_sim(
        "--nnodes", str(nnodes), "--dist-init-addr", dist_init, *extra, host=RANK0_HOST, name="rank0"
    )
    sim.process.wait_for_stderr(f"rendezvous listening on {dist_init}", 10)
    return sim, dist_init


def worker_env(rank: int) -> dict[str, str]:
    return {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": f"{rank * 2},{rank * 2 + 1}",
        "NCCL_IB_HCA": f"=mlx5_{rank}",
    }


def test_replica_serves_once_all_joined_and_dies_with_a_worker(start_sim, processes, worker_argv):
    """Rank 0 is 503 until both workers joined; killing one worker ends every rank, non-zero."""
    sim, dist_init = start_rank0(start_sim, 3, "--peer-timeout", "1")
    assert sim.health() == 503
    workers = [processes.start(worker_argv(1, 3, dist_init), name="rank1", extra_env=worker_env(1))]
    workers[0].wait_for_stderr("joined rank 0", 10)
    sim.process.wait_for_stderr("rank 1 joined", 5)
    assert sim.health() == 503  # one of two workers is not enough
    workers.append(processes.start(worker_argv(2, 3, dist_init), name="rank2", extra_env=worker_env(2)))
    sim.wait_ready()
    for worker in workers:
        worker.wait_for_stderr("all 3 ranks joined", 10)

    info = httpx.get(f"{sim.url}/sim/info", timeout=5).json()
    assert info["nnodes"] == 3
    assert [worker["rank"] for worker in info["workers"]] == [1, 2]
    assert info["workers"][1]["env"] == {"CUDA_VISIBLE_DEVICES": "4,5", "NCCL_IB_HCA": "=mlx5_2"}
    assert info["workers"][1]["address"].startswith("127.0.0.4:")
    assert "--node-rank" in info["workers"][1]["argv"]
    completion = httpx.post(
        f"{sim.url}/v1/completions", json={"model": "test/model", "prompt": "hi"}, timeout=5
    )
    assert completion.status_code == 200

    workers[1].kill_group()
    survivors = [sim.process, workers[0]]
    wait_until(lambda: all(p.returncode is not None for p in survivors), 2, "every rank to exit", processes)
    assert sim.process.returncode == 1
    assert workers[0].returncode == 1
    assert "peer lost: rank 2" in sim.process.stderr()
    assert "peer lost: rank 0" in workers[0].stderr()


def test_silent_worker_is_lost_after_peer_timeout(start_sim, processes, worker_argv):
    """A worker that stops sending heartbeats (SIGSTOP) is lost; rank 0 exits non-zero."""
    sim, dist_init = start_rank0(start_sim, 2, "--peer-timeout", "0.3")
    worker = processes.start(worker_argv(1, 2, dist_init, "--peer-timeout", "0.3"), name="rank1")
    sim.wait_ready()
    os.killpg(worker.pid, signal.SIGSTOP)
    try:
        assert sim.process.wait_exit(5) == 1
    finally:
        os.killpg(worker.pid, signal.SIGCONT)
    assert "peer lost: rank 1" in sim.process.stderr()
    assert "no heartbeat for 0.3s" in sim.process.stderr()
    assert worker.wait_exit(5) == 1


def test_workers_exit_when_rank0_is_lost(start_sim, processes, worker_argv):
    """Killing rank 0 makes its worker exit non-zero, naming rank 0."""
    sim, dist_init = start_rank0(start_sim, 2)
    worker = processes.start(worker_argv(1, 2, dist_init), name="rank1")
    sim.wait_ready()
    sim.process.kill_group()
    assert worker.wait_exit(5) == 1
    assert "peer lost: rank 0" in worker.stderr()


def test_mismatched_nnodes_is_refused(start_sim, processes, worker_argv):
    """A worker that believes in another nnodes is refused and exits 1; rank 0 stays unready."""
    sim, dist_init = start_rank0(start_sim, 2)
    worker = processes.start(worker_argv(1, 3, dist_init), name="rank1")
    assert worker.wait_exit(10) == 1
    assert "refused this worker: rank 1 says nnodes=3, this replica has nnodes=2" in worker.stderr()
    sim.process.wait_for_stderr("refused", 5)
    assert sim.health() == 503
    assert sim.process.returncode is None


def test_duplicate_rank_is_refused(start_sim, processes, worker_argv):
    """A second worker claiming a rank already joined is refused."""
    sim, dist_init = start_rank0(start_sim, 3)
    first = processes.start(worker_argv(1, 3, dist_init), name="rank1")
    first.wait_for_stderr("joined rank 0", 10)
    second = processes.start(worker_argv(1, 3, dist_init), name="rank1-again")
    assert second.wait_exit(10) == 1
    assert "rank 1 already joined" in second.stderr()
    assert sim.health() == 503
    assert first.returncode is None


def test_worker_waits_for_rank0_to_come_up(start_sim, processes, worker_argv):
    """A worker started before rank 0 retries until rank 0 binds, then joins."""
    dist_init = f"{RANK0_HOST}:{free_port(RANK0_HOST)}"
    worker = processes.start(worker_argv(1, 2, dist_init), name="rank1")
    worker.wait_for_stderr("waiting for rank 0", 10)
    sim = start_sim("--nnodes", "2", "--dist-init-addr", dist_init, host=RANK0_HOST, name="rank0")
    sim.wait_ready()
    worker.wait_for_stderr("joined rank 0", 5)


def test_worker_gives_up_after_join_timeout(processes, worker_argv):
    """A worker that cannot reach rank 0 within --join-timeout exits 1 saying so."""
    dist_init = f"{RANK0_HOST}:{free_port(RANK0_HOST)}"
    worker = processes.start(worker_argv(1, 2, dist_init, "--join-timeout", "0.3"), name="rank1")
    assert worker.wait_exit(10) == 1
    assert f"could not reach rank 0 at {dist_init} within 0.3s" in worker.stderr()


class TestLlamaCppPeerLoss:
    """``--on-peer-loss abort-on-request`` imitates llama-server over RPC losing a worker."""

    def test_lost_worker_aborts_the_next_request(self, start_sim, processes, worker_argv):
        """/health stays 200 after the worker dies; the next request gets no response and rank 0 aborts."""
        sim, dist_init = start_rank0(
            start_sim, 2, "--peer-timeout", "0.3", "--on-peer-loss", "abort-on-request"
        )
        worker = processes.start(worker_argv(1, 2, dist_init, "--peer-timeout", "0.3"), name="rank1")
        sim.wait_ready()
        worker.kill_group()
        sim.process.wait_for_stderr("peer lost: rank 1", 5)
        assert sim.health() == 200 and sim.process.returncode is None
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.post(f"{sim.url}/v1/completions", json={"model": "test/model", "prompt": "hi"}, timeout=5)
        assert sim.process.wait_exit(5) == -signal.SIGABRT
        assert "Remote RPC server crashed" in sim.process.stderr()

    def test_hung_worker_hangs_requests_while_health_answers(self, start_sim, processes, worker_argv):
        """A silent (SIGSTOPped) worker: /health stays 200, inference requests hang, nobody exits."""
        sim, dist_init = start_rank0(
            start_sim, 2, "--peer-timeout", "0.3", "--on-peer-loss", "abort-on-request"
        )
        worker = processes.start(worker_argv(1, 2, dist_init, "--peer-timeout", "0.3"), name="rank1")
        sim.wait_ready()
        os.killpg(worker.pid, signal.SIGSTOP)
        try:
            sim.process.wait_for_stderr("peer hung: rank 1", 5)
            assert sim.health() == 200
            with pytest.raises(httpx.TimeoutException):
                httpx.post(
                    f"{sim.url}/v1/completions", json={"model": "test/model", "prompt": "hi"}, timeout=1
                )
            assert sim.process.returncode is None
        finally:
            os.killpg(worker.pid, signal.SIGCONT)
