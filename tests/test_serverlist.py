"""Clients that know several servers: parsing --server lists and moving between servers."""

from __future__ import annotations

import pytest

from llmgw.serverlist import ServerList, leader_hint, parse_servers

A, B, C = "https://a:7443", "https://b:7443", "https://c:7443"


def test_a_list_is_comma_separated_trimmed_and_without_duplicates():
    """`--server "https://a:7443/, https://b:7443,https://a:7443"` is two servers, in order."""
    assert parse_servers(f"{A}/, {B},{A}") == (A, B)


@pytest.mark.parametrize("text", ["", " , ", "https://a", "a:7443", "https://a:7443/api", "http://a:80"])
def test_bad_lists_name_the_flag_and_the_expected_form(text):
    """An empty list, a URL without port, scheme or with a path is refused naming --server and the form."""
    with pytest.raises(ValueError, match=r"--server.*expected https://HOST:PORT"):
        parse_servers(text)


def test_unreachable_server_moves_to_the_next_round_robin():
    """A failed server passes the turn to the next one, and after the last back to the first."""
    servers = ServerList((A, B, C))
    assert servers.failed(A) == B
    assert servers.failed(B) == C
    assert servers.failed(C) == A
    assert servers.failed(B) == A, "a failure of a server not in use moves nothing"


def test_standby_sends_the_client_to_the_leader_it_names():
    """A standby's named leader is used next, also one not in the list, until it fails."""
    servers = ServerList((A, B))
    assert servers.not_leader(A, B) == B
    assert servers.not_leader(B, C) == C
    assert servers.failed(C) == B
    assert servers.not_leader(B, None) == A, "no leader named yet: the next server"


def test_leader_hint_reads_a_standby_answer_only():
    """Only a 503 of type not_leader is a standby's answer; its header names the leader."""
    body = {"error": {"type": "not_leader", "message": "..."}}
    assert leader_hint(503, {"x-llmgw-leader": B + "/"}, body) == (True, B)
    assert leader_hint(503, {}, body) == (True, None)
    assert leader_hint(503, {}, {"error": {"type": "starting"}}) == (False, None)
    assert leader_hint(500, {"x-llmgw-leader": B}, body) == (False, None)


def test_raise_for_standby_only_on_a_standby_answer():
    """Only a 503 not_leader raises, naming the leader; other answers and non-JSON bodies pass."""
    from llmgw.serverlist import NotLeaderAnswer, raise_for_standby

    body = {"error": {"type": "not_leader", "message": "..."}}
    with pytest.raises(NotLeaderAnswer) as caught:
        raise_for_standby(A, 503, {"x-llmgw-leader": B}, lambda: body)
    assert caught.value.leader == B and str(caught.value) == f"{A} is a standby (the leader: {B})"

    def not_json():
        raise ValueError("not JSON")

    raise_for_standby(A, 503, {}, not_json)
    raise_for_standby(A, 200, {"x-llmgw-leader": B}, lambda: body)
