"""A standby's refusal: it names a leader only while that lease runs, never itself, and names a store it
cannot reach."""

from __future__ import annotations

import json
import time

from llmgw.server.ha.lease import LeaderInfo, Lease, not_leader_reply


def unconnected(address: str) -> Lease:
    """A lease object that never connects (only its view of the row is used here)."""

    def connect():
        raise AssertionError("not connected in this test")

    return Lease(connect, address, 6.0)


def message(reply) -> str:
    return json.loads(reply.body)["error"]["message"]


def test_a_server_that_stepped_down_does_not_name_itself_as_the_leader():
    """The lease it last held (its own) is not a leader to send clients to, however recent."""
    lease = unconnected("https://a:7443")
    lease.seen = LeaderInfo(lease.holder, lease.address, 1, 0.0, 6.0)
    reply = not_leader_reply(lease)
    assert reply.status == 503 and dict(reply.headers).get("x-llmgw-leader") is None
    assert "no server leads right now" in message(reply)


def test_a_lease_read_long_ago_is_aged_by_the_time_since():
    """A lease read with 6 s left, 7 s ago, has run out: no leader is named."""
    lease = unconnected("https://b:7443")
    lease.seen = LeaderInfo("https://a:7443#1", "https://a:7443", 1, 0.0, 6.0, read_at=time.monotonic() - 7)
    assert dict(not_leader_reply(lease).headers).get("x-llmgw-leader") is None
    lease.seen = LeaderInfo("https://a:7443#1", "https://a:7443", 1, 0.0, 6.0)
    assert dict(not_leader_reply(lease).headers)["x-llmgw-leader"] == "https://a:7443"


def test_a_standby_that_cannot_reach_the_store_says_so():
    """The refusal names the store's error and carries x-llmgw-store: unreachable."""
    lease = unconnected("https://b:7443")
    lease.unreachable = "postgresql://llmgw@db/llmgw: cannot connect to PostgreSQL: connection refused"
    reply = not_leader_reply(lease)
    headers = dict(reply.headers)
    assert headers["x-llmgw-store"] == "unreachable" and "x-llmgw-leader" not in headers
    assert message(reply) == (
        "this server is a standby and cannot reach the store (postgresql://llmgw@db/llmgw: cannot connect "
        "to PostgreSQL: connection refused); it knows no leader"
    )
    assert json.loads(reply.body)["error"]["type"] == "not_leader"
