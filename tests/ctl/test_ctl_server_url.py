"""A `ctl --server` that is not the admin API says so, and what the admin API's URL is."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from llmgw.ctl.cli import ctl
from llmgw.ctl.diagnose import not_the_admin_api
from llmgw.dev.cluster import program
from llmgw.testing.processes import free_port, running, wait_until


def run(test_pki, server: str, *args: str):
    issued = test_pki.client("admin", "ops")
    options = ["--server", server, "--ca", str(test_pki.ca.cert_path)]
    options += ["--cert", str(issued.cert_path), "--key", str(issued.key_path)]
    return CliRunner().invoke(ctl, [*options, *args, "nodes"])


def test_the_gateway_url_is_named_as_the_gateway(test_pki):
    """`--server http://HOST:8080` (the README's gateway) says the admin API is https on :7443, not :8080."""
    result = run(test_pki, "http://127.0.0.1:8080")
    assert result.exit_code == 1
    assert result.output == (
        "error: --server 'http://127.0.0.1:8080': the admin API is llmgw server's, https with mutual TLS on "
        "port 7443 by default, not plain http; :8080 is the gateway's OpenAI API, not the admin API; "
        "try https://127.0.0.1:7443\n"
    )


@pytest.mark.parametrize("url", ["127.0.0.1:7443", "https://127.0.0.1", "https://127.0.0.1:7443/v1"])
def test_a_malformed_url_shows_the_expected_form(test_pki, url):
    """No scheme, no port, or a path: the message shows https://HOST:PORT."""
    result = run(test_pki, url)
    assert result.exit_code == 1
    assert result.output.startswith(f"error: --server {url!r}: expected https://HOST:PORT")


def test_the_config_file_is_named_when_its_url_is_wrong(test_pki, tmp_path):
    """A wrong `server` in config.toml is named with the file."""
    issued = test_pki.client("admin", "ops")
    (tmp_path / "config.toml").write_text('server = "http://gw.example.net:8080"\n')
    for name, path in (("ca.pem", test_pki.ca.cert_path), ("admin.pem", issued.cert_path)):
        (tmp_path / name).write_bytes(path.read_bytes())
    (tmp_path / "admin.key").write_bytes(issued.key_path.read_bytes())
    result = CliRunner().invoke(ctl, ["--config-dir", str(tmp_path), "nodes"])
    assert result.output.startswith(f"error: {tmp_path / 'config.toml'}: server 'http://gw.example.net:8080'")
    assert "try https://gw.example.net:7443" in result.output


def test_nothing_listening_is_said_plainly(test_pki):
    """A refused connection names the URL and says llmgw server serves the admin API on :7443."""
    port = free_port()
    result = run(test_pki, f"https://127.0.0.1:{port}")
    expected = f"error: nothing listens at https://127.0.0.1:{port} (connection refused)"
    assert result.output.startswith(expected)
    assert "7443" in result.output


@pytest.mark.timeout(60)
def test_https_to_the_gateway_says_it_is_not_the_admin_api(test_pki):
    """A real gateway's port with https: not TLS, so not the admin API (rather than an SSL error)."""
    port = free_port()
    argv = [program("llmgw"), "gateway", "--server", f"https://127.0.0.1:{free_port()}"]
    argv += ["--ca", str(test_pki.ca.cert_path), "--no-keys", "--listen", f"127.0.0.1:{port}"]
    with running(argv, name="gateway") as gateway:
        wait_until(lambda: "llmgw gateway on" in gateway.stderr(), 30, "the gateway to listen", gateway)
        result = run(test_pki, f"https://127.0.0.1:{port}")
    assert result.output.startswith(
        f"error: https://127.0.0.1:{port} does not answer in TLS: it is not the admin API; "
    ), result.output


def test_answers_that_are_not_the_admin_api():
    """The gateway's OpenAI 404 and an HTML page are recognised; the admin API's own 404 is not."""
    gateway = {"error": {"message": "Invalid URL (GET /v1/admin/nodes)", "type": "invalid_request_error"}}
    assert "is llmgw's gateway" in not_the_admin_api("https://h:443", 404, gateway, "")
    html = not_the_admin_api("https://h:443", 404, None, "<!DOCTYPE html>\n<html>")
    assert html.startswith("https://h:443 answered 404 with '<!DOCTYPE html>', not JSON")
    own = {"error": {"type": "not_found", "message": "no node 'node-9' (nodes: node-1)"}}
    assert not_the_admin_api("https://h:7443", 404, own, "") is None


def test_a_missing_credential_file_given_by_flag_is_named_alone(tmp_path):
    """`--ca /nope` says that file is missing, not how to fill the default config directory."""
    result = CliRunner().invoke(ctl, ["--server", "https://h:7443", "--ca", str(tmp_path / "nope"), "nodes"])
    assert result.output == f"error: --ca {tmp_path / 'nope'}: no such file\n"
