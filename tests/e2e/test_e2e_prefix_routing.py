"""Prefix-aware routing through a real gateway: each conversation's turns land on one replica of three."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from llmgw.testing.catalogs import chat_catalog
from llmgw.testing.load import routed_cluster

pytestmark = pytest.mark.timeout(240)

#: conversations, each a few turns long; 8 over 3 replicas all on one by chance: 3 / 3**8, under 0.1 %
CONVERSATIONS, TURNS = 8, 4


def test_a_conversations_turns_land_on_the_replica_that_holds_its_beginning(tmp_path: Path):
    """Eight conversations of four turns (each turn resends the ones before) through a gateway routing by
    prefix (its default): every turn of one conversation is answered by the same replica, and the
    conversations are spread over more than one replica."""
    catalog = chat_catalog(replicas=3)
    with routed_cluster(tmp_path, catalog, nodes=3) as cluster, httpx.Client(timeout=30) as http:
        where: dict[int, list[str]] = {}
        for number in range(CONVERSATIONS):
            system = f"You are the assistant of conversation {number}. " + f"Rule {number}: be brief. " * 40
            messages = [{"role": "system", "content": system}]
            for turn in range(TURNS):
                messages.append({"role": "user", "content": f"Question {turn} of conversation {number}?"})
                body = {"model": "chat", "messages": messages, "max_tokens": 8}
                answer = http.post(f"{cluster.gateway_url}/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                where.setdefault(number, []).append(answer.headers["x-llmgw-replica"])
                said = answer.json()["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": said})
    scattered = {number: replicas for number, replicas in where.items() if len(set(replicas)) > 1}
    assert not scattered, f"turns of one conversation went to different replicas: {scattered}"
    assert len({replicas[0] for replicas in where.values()}) > 1, f"all conversations on one replica: {where}"
