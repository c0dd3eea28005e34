"""``llmgw dev``: llmgw on this machine, with simulated engines and no GPU.

Today it starts one replica of the sim engine through the engine plugin (the
command the agent would build), waits until it is ready, sends it one chat
completion, and serves until interrupted. The control plane, the node
agents and the gateway join it as they are built.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from llmgw.errors import LlmgwError
from llmgw.models import LaunchSpec
from llmgw.plugins import get_plugin_manager

__all__ = ["dev"]

#: how long the sim engine may take to answer 200 on its health path
READY_TIMEOUT = 30.0
#: how long the sim engine has to exit after SIGTERM before SIGKILL
STOP_GRACE = 10.0


class EngineNotReady(LlmgwError):
    """The engine did not become ready in time, or exited while starting."""


def _get(host: str, port: int, path: str) -> int:
    conn = http.client.HTTPConnection(host, port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def _chat(host: str, port: int, model: str) -> dict:
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Say hello to llmgw."}], "max_tokens": 12}
    )
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = json.loads(response.read())
        if response.status != 200:
            raise LlmgwError(f"the sim engine answered {response.status}: {data}")
        return data
    finally:
        conn.close()


def _wait_ready(process: subprocess.Popen, host: str, port: int, path: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EngineNotReady(
                f"the sim engine exited with code {process.returncode} while starting; "
                f"its log ({log}) ends with:\n{_tail(log)}"
            )
        try:
            if _get(host, port, path) == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise EngineNotReady(
        f"the sim engine did not answer 200 on http://{host}:{port}{path} within {READY_TIMEOUT:.0f} s; "
        f"its log ({log}) ends with:\n{_tail(log)}"
    )


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the engine's process group, SIGKILL it after a grace period."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the replica serves on.")
@click.option("--port", default=8080, show_default=True, type=int, help="Port the replica serves on.")
@click.option("--model", "served_name", default="llama-sim", show_default=True, help="Served model name.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".llmgw-dev"),
    show_default=True,
    help="Where logs are written.",
)
@click.option("--once", is_flag=True, help="Exit after the first request instead of serving.")
def dev(host: str, port: int, served_name: str, state_dir: Path, once: bool) -> None:
    """Run llmgw locally on simulated engines: no GPU needed."""
    engine = get_plugin_manager().engine("sim")
    spec = LaunchSpec(
        model_source=served_name,
        served_name=served_name,
        host=host,
        port=port,
        executables={"llmgw-sim": _program("llmgw-sim")},
    )
    command = engine.build_command(spec)
    state_dir.mkdir(parents=True, exist_ok=True)
    log = state_dir / "sim-engine.log"
    click.echo(f"starting a sim replica of {served_name!r}: {' '.join(command.argv)}")
    with log.open("ab") as out:
        process = subprocess.Popen(
            command.argv,
            env={**os.environ, **command.env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        _wait_ready(process, host, port, engine.health_path, log)
        answer = _chat(host, port, served_name)
        text = answer["choices"][0]["message"]["content"]
        click.echo(f"ready: http://{host}:{port}/v1 serves {served_name!r}; it answered: {text!r}")
        body = json.dumps({"model": served_name, "messages": [{"role": "user", "content": "hi"}]})
        click.echo(
            f"try: curl -s http://{host}:{port}/v1/chat/completions "
            f"-H 'Content-Type: application/json' -d '{body}'"
        )
        click.echo(f"engine log: {log}; the control plane and gateway are not part of llmgw dev yet")
        if once:
            return
        click.echo("serving; press Ctrl-C to stop")
        _serve_until_interrupted(process, log)
    finally:
        _stop(process)


def _serve_until_interrupted(process: subprocess.Popen, log: Path) -> None:
    stop = {"signal": None}

    def handler(signum: int, frame: object) -> None:
        stop["signal"] = signum

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        while stop["signal"] is None:
            try:
                code = process.wait(0.5)
            except subprocess.TimeoutExpired:
                continue
            raise LlmgwError(
                f"the sim engine exited with code {code}; its log ({log}) ends with:\n{_tail(log)}"
            )
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    click.echo("stopping")


def _program(name: str) -> str:
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise LlmgwError(f"{name} is not installed; pip install llmgw-engine-sim")
    return found
