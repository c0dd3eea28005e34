"""Log lines as text or JSON (llmgw.logs): what a log shipper reading stderr gets."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest
from click.testing import CliRunner

from llmgw.logs import configure_logging


@pytest.fixture
def restore_logging():
    """Leave the root logger and excepthook as they were (the tests configure them)."""
    root = logging.getLogger()
    handlers, level, hook = list(root.handlers), root.level, sys.excepthook
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    sys.excepthook = hook
    logging.captureWarnings(False)


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_line_has_time_level_logger_message_and_extra_fields(restore_logging):
    """One JSON object per record: UTC time, level, logger, message, pid, and each `extra=` field."""
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    logging.getLogger("llmgw.gateway").info(
        "answered %s", "chat-0", extra={"replica": "chat-0", "status": 200, "ttft": 0.25}
    )
    (line,) = _lines(out)
    assert line["time"].endswith("Z") and "T" in line["time"]
    assert {k: line[k] for k in ("level", "logger", "message", "replica", "status", "ttft")} == {
        "level": "info",
        "logger": "llmgw.gateway",
        "message": "answered chat-0",
        "replica": "chat-0",
        "status": 200,
        "ttft": 0.25,
    }
    assert isinstance(line["pid"], int)


def test_json_keeps_a_traceback_and_a_multiline_message_on_one_line(restore_logging):
    """A message with newlines and an exception's traceback stay inside one line of JSON."""
    out = io.StringIO()
    configure_logging("json", "debug", stream=out)
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        logging.getLogger("llmgw.server").exception("reconcile failed:\n%s", "two lines")
    assert len(out.getvalue().splitlines()) == 1
    (line,) = _lines(out)
    assert line["message"] == "reconcile failed:\ntwo lines"
    assert "ValueError: bad\nvalue" in line["exception"]


def test_level_and_reconfiguring(restore_logging):
    """Below the level nothing is written; configuring again replaces the handler (no line twice)."""
    first, second = io.StringIO(), io.StringIO()
    configure_logging("text", "warning", stream=first)
    configure_logging("text", "warning", stream=second)
    log = logging.getLogger("llmgw.agent")
    log.info("not shown")
    log.warning("shown once")
    assert first.getvalue() == ""
    assert second.getvalue().endswith(" llmgw.agent WARNING shown once\n")


def test_http_libraries_are_quiet_unless_debug(restore_logging):
    """httpx's line per request shows only at debug."""
    out = io.StringIO()
    configure_logging("text", "info", stream=out)
    logging.getLogger("httpx").info("HTTP Request: GET https://x")
    assert out.getvalue() == ""
    configure_logging("text", "debug", stream=out)
    logging.getLogger("httpx").info("HTTP Request: GET https://x")
    assert "HTTP Request" in out.getvalue()


def test_uncaught_exception_is_a_json_line(tmp_path):
    """In json, a crash nothing caught is logged as one JSON line (critical, with the traceback)."""
    code = "from llmgw.logs import configure_logging; configure_logging('json'); raise RuntimeError('boom')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    (line,) = [json.loads(text) for text in done.stderr.splitlines()]
    assert line["level"] == "critical" and "RuntimeError: boom" in line["exception"]


def test_bad_log_level_names_the_flag_and_the_choices():
    """`--log-level loud` is refused before anything starts, naming the flag and the choices."""
    from llmgw.cli import cli

    result = CliRunner().invoke(cli, ["gateway", "--server", "https://h:7443", "--log-level", "loud"])
    assert result.exit_code == 2
    assert "--log-level" in result.output and "'loud' is not one of 'debug', 'info'" in result.output


def test_sim_logs_json_lines_with_its_rank(tmp_path):
    """`llmgw-sim --log-format json` writes only JSON lines, each with its rank."""
    from llmgw.dev.cluster import program

    argv = [program("llmgw-sim"), "--model", "m", "--port", "0", "--log-format", "json"]
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True) as sim:
        try:
            lines = [json.loads(sim.stderr.readline()) for _ in range(3)]
        finally:
            sim.terminate()
            sim.wait(30)
        lines += [json.loads(text) for text in sim.stderr.read().splitlines()]
    assert lines[-1]["message"] == "exiting with code 0: shutdown complete"
    assert all(line["rank"] == 0 and line["logger"] == "llmgw_engine_sim" for line in lines)
    assert any(line["message"].startswith("ready: serving m") for line in lines)


def test_a_fatal_error_of_a_json_logging_process_is_a_json_line(test_pki, tmp_path):
    """`llmgw server --log-format json` on a taken port ends with a JSON line (level error), not text."""
    from llmgw.dev.cluster import program
    from llmgw.testing.processes import taken_port

    with taken_port() as port:
        tls = test_pki.server
        argv = [program("llmgw"), "server", "--state-dir", str(tmp_path / "state"), "--log-format", "json"]
        argv += ["--listen", f"127.0.0.1:{port}", "--cert", str(tls.cert_path), "--key", str(tls.key_path)]
        argv += ["--ca", str(test_pki.ca.cert_path)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    last = [json.loads(line) for line in done.stderr.splitlines()][-1]
    assert (last["level"], last["message"]) == (
        "error",
        f"cannot listen on 127.0.0.1:{port}: Address already in use",
    )
