"""``llmgw dev``: the README's first command."""

from __future__ import annotations

import socket
import subprocess

from llmgw.testing.processes import free_port


def test_dev_once_starts_a_replica_and_gets_an_answer(llmgw_exe, clean_env, tmp_path):
    """`llmgw dev --once` starts a sim replica, gets a chat completion from it, and leaves nothing running."""
    port = free_port()
    result = subprocess.run(
        [llmgw_exe, "dev", "--once", "--port", str(port), "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=clean_env,
        timeout=90,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ready: http://127.0.0.1:{port}/v1 serves 'llama-sim'; it answered:" in result.stdout
    assert (tmp_path / "sim-engine.log").exists()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0, (
            "the sim engine still listens after llmgw dev exited"
        )
