"""Prefix-aware routing: a prompt's beginning keeps going where it went before, within a load bound."""

from __future__ import annotations

from llmgw.gateway.balancer import Balancer
from llmgw.gateway.prefix import prefix_keys, prompt_text
from llmgw.wire import Route

SYSTEM = "You are the support assistant of a large company. " * 30


def balancer(*names: str, load_factor: float = 1.5) -> Balancer:
    balancer = Balancer(routing="prefix", prefix_load_factor=load_factor)
    balancer.update({"m": [Route(name, f"http://10.0.0.{i}:8000") for i, name in enumerate(names, 1)]})
    return balancer


def chat(*contents: str) -> tuple[bytes, ...]:
    roles = ["system", "user", "assistant"]
    messages = [
        {"role": roles[min(i, 1) if i < 2 else 2 - i % 2], "content": c} for i, c in enumerate(contents)
    ]
    return prefix_keys(prompt_text("chat/completions", {"messages": messages}))


class TestPrefixKeys:
    def test_a_longer_conversation_shares_the_keys_of_its_beginning(self):
        first = chat(SYSTEM, "what is my balance?")
        later = chat(SYSTEM, "what is my balance?", "it is 12 euros", "and yesterday?")
        assert later[: len(first) - 1] == first[:-1]
        assert len(later) >= len(first)

    def test_different_beginnings_share_nothing(self):
        assert not set(chat(SYSTEM, "hi")) & set(chat("Another system prompt. " * 60, "hi"))

    def test_short_prompts_get_one_key_and_no_prompt_none(self):
        assert len(chat("hi")) == 1
        assert prefix_keys(prompt_text("embeddings", {"input": "x"})) == ()

    def test_text_content_parts_count_as_the_same_text(self):
        parts = [{"type": "text", "text": SYSTEM}, {"type": "image_url", "image_url": {"url": "x"}}]
        plain = prompt_text("chat/completions", {"messages": [{"role": "system", "content": SYSTEM}]})
        as_parts = prompt_text("chat/completions", {"messages": [{"role": "system", "content": parts}]})
        assert plain == as_parts

    def test_completion_prompts(self):
        assert prompt_text("completions", {"prompt": "abc"}) == "abc"
        assert prompt_text("completions", {"prompt": ["abc", "def"]}) == "abc"


class TestPrefixTable:
    def test_one_prefix_stays_on_one_replica_and_many_spread(self):
        routes = balancer("a", "b", "c", "d")
        keys = chat(SYSTEM, "hello")
        assert len({routes.choose("m", 0, prefix=keys).name for _ in range(20)}) == 1
        spread = {routes.choose("m", 0, prefix=chat(f"tenant {i} " * 50)).name for i in range(60)}
        assert spread == {"a", "b", "c", "d"}

    def test_a_conversation_follows_its_earlier_turns(self):
        routes = balancer("a", "b", "c", "d")
        first = routes.choose("m", 0, prefix=chat(SYSTEM, "q1"))
        for turn in range(2, 8):
            history = [SYSTEM] + [f"q{i} and its answer" for i in range(1, turn + 1)]
            assert routes.choose("m", 0, prefix=chat(*history)) is first

    def test_a_busy_replica_is_passed_over_and_the_prefix_moves(self):
        routes = balancer("a", "b", load_factor=1.5)
        keys = chat(SYSTEM, "hot")
        home = routes.choose("m", 0, prefix=keys)
        other = next(r for r in routes.replicas("m") if r is not home)
        for _ in range(4):
            home.begin()  # 4 in flight, 0 elsewhere: over 1.5x the mean of (4 + 1) / 2
        moved = routes.choose("m", 0, prefix=keys)
        assert moved is other
        assert routes.choose("m", 0, prefix=keys) is other  # the prefix lives there now too

    def test_new_prefixes_go_to_replicas_at_or_under_the_mean_load(self):
        routes = balancer("a", "b", "c")
        a, b, c = routes.replicas("m")
        for replica, load in ((a, 6), (b, 0), (c, 3)):
            for _ in range(load):
                replica.begin()
        chosen = [routes.choose("m", 0, prefix=chat(f"fresh {i} " * 40)) for i in range(20)]
        assert all(replica.in_flight + 1 <= 4 for replica in chosen)  # mean with the new one: 10 / 3

    def test_session_wins_over_prefix(self):
        routes = balancer("a", "b", "c", "d")
        keys = chat(SYSTEM, "hello")
        by_session = {routes.choose("m", 0, session=f"s{i}", prefix=keys).name for i in range(40)}
        assert len(by_session) > 1

    def test_excluded_replicas_are_not_chosen(self):
        routes = balancer("a", "b")
        keys = chat(SYSTEM, "retry me")
        first = routes.choose("m", 0, prefix=keys)
        assert routes.choose("m", 0, prefix=keys, exclude=[first]) is not first
