"""``llmgw server`` picks its store from --state-dir or --store, and says what is wrong with either."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from llmgw.server.cli import server_command
from llmgw.server.persist.postgres import open_pg_store
from llmgw.server.persist.sqlite import StoreError

TLS = ["--cert", "c.pem", "--key", "k.pem", "--ca", "ca.pem"]


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], "give either --state-dir (sqlite) or --store postgresql://"),
        (["--state-dir", "s", "--store", "postgresql://u@db/x"], "(not both)"),
        (["--store", "postgresql://u:pw@db/x"], "Invalid value for --store: the URL holds a password"),
        (["--store", "sqlite:///x"], "Invalid value for --store: expected postgresql://USER@HOST[:PORT]/DB"),
    ],
)
def test_store_flags_are_checked_before_anything_starts(args, expected):
    """Neither or both stores, a password in the URL, or another scheme: exit 2 naming the flag."""
    result = CliRunner().invoke(server_command, [*args, *TLS])
    assert result.exit_code == 2
    assert expected in result.output


def test_store_url_may_come_from_the_environment():
    """LLMGW_STORE stands for --store (so the URL need not be on the command line either)."""
    result = CliRunner().invoke(server_command, TLS, env={"LLMGW_STORE": "postgresql://u:pw@db/x"})
    assert result.exit_code == 2 and "the URL holds a password" in result.output


@pytest.mark.parametrize("content", ["", "\nsecret\n"])
def test_empty_password_file_is_refused(tmp_path, content):
    """A password file whose first line is empty is refused, naming the flag and what it must hold."""
    path = tmp_path / "pw"
    path.write_text(content)
    with pytest.raises(StoreError, match="--store-password-file: .* is empty; expected the password"):
        open_pg_store("postgresql://u@127.0.0.1/x", path)
