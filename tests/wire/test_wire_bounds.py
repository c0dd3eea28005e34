"""Refusing a hostile wire document costs what refusing a small one does, and says so in a few lines."""

from __future__ import annotations

import time

import pytest

from llmgw.net._records import InvalidJSON, parse_json
from llmgw.wire import SyncRequest, WireError, from_json, shown

#: CPU seconds, far above what these take (a fraction of a second); refusing one took minutes before
WITHIN = 5.0


def sync(**fields):
    """A SyncRequest's JSON with ``fields`` changed."""
    base = {"node_id": "n", "address": "a", "facts": {"node_id": "n", "agent_version": ""}}
    return {**base, "port_range": [2000, 3000], **fields}


def test_a_list_of_bad_items_names_ten_and_stops():
    """200,000 bad sources: the error names ten of them, in one short text, at once."""
    started = time.process_time()
    with pytest.raises(WireError) as refused:
        from_json(sync(checked_sources=[[1, 2, 3, 4, 5]] * 200_000), SyncRequest)
    assert time.process_time() - started < WITHIN
    message = str(refused.value)
    assert message.count("expected a string, got [1, 2, 3, 4, ...]") == 10
    assert "checked_sources[9]" in message and "checked_sources[10]" not in message
    assert len(message) < 2000


@pytest.mark.parametrize(
    "value, expected",
    [
        ("y" * 10_000, "'" + "y" * 27 + "..." + "y" * 28 + "'"),
        ({str(i): i for i in range(1_000_000)}, "{'0': 0, '1': 1, '2': 2, '3': 3, ...}"),
        ([[[["deep"]]]], "[[[[...]]]]"),
    ],
    ids=["long-string", "million-keys", "deep"],
)
def test_values_are_quoted_short(value, expected):
    """An error quotes at most 60 characters of a value, read from a few items only."""
    assert shown(value) == expected


def test_a_body_of_millions_of_lists_parses_at_once():
    """Two million empty lists (4 MB, the server's limit) parse within seconds, not a minute."""
    body = b'{"x": [' + b",".join([b"[]"] * 2_000_000) + b"]}"
    started = time.process_time()
    assert len(parse_json(body)["x"]) == 2_000_000
    assert time.process_time() - started < WITHIN


@pytest.mark.parametrize("pairs, innermost, refused", [(31, "[1]", False), (32, "1", True)])
def test_depth_is_counted_through_objects_and_strings(pairs, innermost, refused):
    """Brackets in strings do not count; objects and arrays alternating count one level each (64 pass)."""
    # the outer object, then `pairs` times an object holding an array: 1 + 2 * pairs (+ 1 for "[1]")
    body = ('{"a": "[[[[{{{{", "b": ' + '{"c": [' * pairs + innermost + "]}" * pairs + "}").encode()
    if refused:
        with pytest.raises(InvalidJSON, match="deeper than 64 levels"):
            parse_json(body)
    else:
        assert parse_json(body)["a"] == "[[[[{{{{"
