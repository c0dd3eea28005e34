"""Startup, shutdown, fault injection and the command line of llmgw-sim."""

from __future__ import annotations

import json
import signal
import subprocess

import httpx
import pytest

from llmgw.engine import parse_argparse_flags
from llmgw.testing.processes import wait_until

COMPLETION = {"model": "test/model", "prompt": "hello"}


def refuses_connections(sim) -> bool:
    try:
        httpx.get(f"{sim.url}/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False


class TestStartup:
    """Readiness and refusals at startup."""

    def test_health_is_503_while_loading(self, start_sim):
        """/health answers 503 during --startup-delay, then 200."""
        # long enough that the three requests below land inside it on a loaded machine
        sim = start_sim("--startup-delay", "3")
        wait_until(lambda: sim.health() == 503, 10, "/health to answer 503", sim.process)
        health = httpx.get(f"{sim.url}/health", timeout=5)
        loading = {
            "error": {"message": "Loading model", "type": "unavailable_error", "param": None, "code": 503}
        }
        assert health.json() == loading, "llama-server's shape"
        response = httpx.post(f"{sim.url}/v1/completions", json=COMPLETION, timeout=5)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "unavailable_error"
        sim.wait_ready()
        assert httpx.get(f"{sim.url}/health", timeout=5).json() == {"status": "ok"}
        sim.process.wait_for_stderr("ready: serving test/model", 5)

    @pytest.mark.parametrize("model", ["/nonexistent/weights", "./not-here"])
    def test_missing_local_model_exits_1(self, start_sim, model):
        """A --model that looks like a path but does not exist ends the process with code 1."""
        sim = start_sim("--model", model)
        assert sim.process.wait_exit(10) == 1
        assert f"model path {model} does not exist" in sim.process.stderr()

    def test_port_in_use_exits_1(self, start_sim):
        """A port already taken ends the second process with code 1 and says which port."""
        first = start_sim()
        first.wait_ready()
        second = start_sim("--port", str(first.port), name="second")
        assert second.process.wait_exit(10) == 1
        assert f"cannot serve HTTP on 127.0.0.1:{first.port}" in second.process.stderr()

    def test_dist_init_addr_required_for_several_nodes(self, sim_program):
        """--nnodes 2 without --dist-init-addr is a usage error."""
        result = subprocess.run(
            [sim_program, "--model", "m", "--nnodes", "2"], capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 2
        assert "--dist-init-addr is required when --nnodes > 1" in result.stderr

    def test_help_documents_every_flag(self, sim_program):
        """--help documents every flag in real-engine style."""
        result = subprocess.run([sim_program, "--help"], capture_output=True, text=True, timeout=30)
        flags = parse_argparse_flags(result.stdout)
        assert {
            "--model",
            "--served-model-name",
            "--host",
            "--port",
            "--nnodes",
            "--node-rank",
            "--dist-init-addr",
            "--max-model-len",
            "--time-to-first-token",
            "--tokens-per-second",
            "--startup-delay",
            "--peer-timeout",
            "--join-timeout",
            "--shutdown-grace",
            "--hang-after-requests",
            "--exit-after-requests",
            "--disable-log-requests",
            "--version",
        } <= flags


class TestShutdown:
    """SIGTERM and SIGINT."""

    def test_sigterm_lets_a_streamed_request_finish(self, start_sim):
        """After SIGTERM new connections are refused, the stream in flight completes, and it exits 0."""
        sim = start_sim("--tokens-per-second", "20", "--shutdown-grace", "10")
        sim.wait_ready()
        body = {**COMPLETION, "max_tokens": 10, "stream": True}
        with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=10) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            sim.process.signal(signal.SIGTERM)
            wait_until(lambda: refuses_connections(sim), 5, "the sim to stop accepting", sim.process)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] is not None
        assert sim.process.wait_exit(10) == 0
        assert "received SIGTERM" in sim.process.stderr()

    def test_sigint_when_idle_exits_0(self, start_sim):
        """SIGINT with nothing in flight ends the process with code 0."""
        sim = start_sim()
        sim.wait_ready()
        sim.process.signal(signal.SIGINT)
        assert sim.process.wait_exit(10) == 0

    def test_grace_period_ends_a_stuck_request(self, start_sim):
        """A request still running when --shutdown-grace ends is cut, and the process exits."""
        sim = start_sim("--hang-after-requests", "0", "--shutdown-grace", "0.2")
        sim.wait_ready()
        with httpx.Client(timeout=10) as client:
            with pytest.raises(httpx.TimeoutException):
                client.post(f"{sim.url}/v1/completions", json=COMPLETION, timeout=0.3)
            sim.process.signal(signal.SIGTERM)
            assert sim.process.wait_exit(10) == 0


class TestFaultInjection:
    """--hang-after-requests and --exit-after-requests."""

    def test_hang_after_requests(self, start_sim):
        """After N requests /health still answers 200 but a completion never answers."""
        sim = start_sim("--hang-after-requests", "1")
        sim.wait_ready()
        assert httpx.post(f"{sim.url}/v1/completions", json=COMPLETION, timeout=5).status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{sim.url}/v1/completions", json=COMPLETION, timeout=0.5)
        assert sim.health() == 200
        assert sim.process.returncode is None

    def test_exit_after_requests(self, start_sim):
        """The process answers N requests in full, then exits 1."""
        sim = start_sim("--exit-after-requests", "2")
        sim.wait_ready()
        for _ in range(2):
            response = httpx.post(f"{sim.url}/v1/completions", json=COMPLETION, timeout=5)
            assert response.json()["choices"][0]["text"]
        assert sim.process.wait_exit(10) == 1
        assert "exiting after 2 requests" in sim.process.stderr()
