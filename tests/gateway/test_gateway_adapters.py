"""Which adapter a request names, the body each engine gets for it, and a held request's answers."""

from __future__ import annotations

import json

import trio
import trio.testing

from llmgw.gateway.adapters import AdapterDemand, adapter_body, base_body, request_body, resolve
from llmgw.gateway.balancer import Balancer
from llmgw.wire import AdapterCause, AdapterFailure, AdapterRoutes, Route, RouteTable

TABLE = RouteTable(
    revision=2,
    models=["chat", "code"],
    adapters={"sql": AdapterRoutes("chat", {"chat-0": {"model": "sql"}}), "py": AdapterRoutes("code")},
)


class TestResolve:
    """An adapter is named alone or under its base; nothing else names one."""

    def test_alone_and_under_its_base(self):
        """`sql` and `chat:sql` are chat's adapter sql."""
        assert resolve(TABLE, "sql") == ("chat", "sql")
        assert resolve(TABLE, "chat:sql") == ("chat", "sql")

    def test_under_another_base_or_unknown_is_none(self):
        """`code:sql` (sql is chat's), `chat:nope` and `nope` name no adapter."""
        assert resolve(TABLE, "code:sql") is None
        assert resolve(TABLE, "chat:nope") is None
        assert resolve(TABLE, "nope") is None


class TestBody:
    """The request body carries the engine's fields for the adapter."""

    def test_unchanged_when_the_client_named_the_adapter_as_the_engine_wants(self):
        """`model: sql` to an engine that wants `model: sql`: the very bytes go."""
        body = b'{"model":"sql","prompt":"x"}'
        assert adapter_body(body, "sql", {"model": "sql"}, "sql") is body

    def test_base_colon_adapter_becomes_the_engine_fields(self):
        """`chat:sql` is sent as `model: sql`; other engines' fields are set too."""
        body = json.dumps({"model": "chat:sql", "prompt": "x"}).encode()
        assert json.loads(adapter_body(body, "chat:sql", None, "sql")) == {"model": "sql", "prompt": "x"}
        sent = json.loads(adapter_body(body, "chat:sql", {"model": "chat", "lora_path": "sql"}, "sql"))
        assert sent == {"model": "chat", "lora_path": "sql", "prompt": "x"}


class TestBaseBody:
    """A base-model request carries its replica's base-model fields (llama.cpp: every adapter at scale 0)."""

    ZERO = {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]}

    def test_unchanged_without_fields(self):
        """A replica that wants none gets the very bytes."""
        body = b'{"model":"tiny","prompt":"x"}'
        assert base_body(body, None) is body
        assert base_body(body, {}) is body
        assert request_body(body, None, None, "tiny") is body

    def test_fields_replace_the_clients(self):
        """The replica's fields are set, replacing a client's own ``lora``."""
        body = json.dumps({"model": "tiny", "prompt": "x", "lora": [{"id": 0, "scale": 1.0}]}).encode()
        assert json.loads(request_body(body, self.ZERO, None, "tiny")) == {
            "model": "tiny",
            "prompt": "x",
            **self.ZERO,
        }

    def test_an_adapter_request_gets_the_adapter_fields(self):
        """With an adapter, the adapter's fields go, not the base model's."""
        body = json.dumps({"model": "sql", "prompt": "x"}).encode()
        fields = {"lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]}
        sent = json.loads(request_body(body, fields, "sql", "sql"))
        assert sent == {"model": "sql", "prompt": "x", **fields}

    def test_the_balancer_keeps_each_replicas_base_fields_from_the_routes_feed(self):
        """The routes feed's base_fields are looked up per replica; a replica not listed has none."""
        balancer = Balancer()
        table = RouteTable(
            revision=1,
            routes={"tiny": (Route("tiny-0", "http://127.0.0.1:1"), Route("tiny-1", "http://127.0.0.1:2"))},
            base_fields={"tiny-0": self.ZERO},
        )
        balancer.update(table.routes)
        balancer.update_adapters(table.adapters, table.base_fields)
        assert balancer.base_fields("tiny-0") == self.ZERO
        assert balancer.base_fields("tiny-1") is None


async def test_a_held_request_is_answered_with_the_failure_that_came_after_it():
    """A failure already in the routes when the hold began is not this request's; a new one answers it
    with the adapter, its model and the cause; the report is asked for at once."""
    reported = []
    demand = AdapterDemand(30, 4, lambda: reported.append(1))
    old = AdapterFailure(AdapterCause.REFUSED, "old", 1)
    demand.routes_changed(
        RouteTable(revision=1, models=["chat"], adapters={"sql": AdapterRoutes("chat", {}, old)})
    )
    result = []

    async def held() -> None:
        result.append(await demand.hold("chat", "sql", lambda: False))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(held)
        await trio.testing.wait_all_tasks_blocked()
        assert reported and demand.held[("chat", "sql")] == 1
        new = AdapterFailure(AdapterCause.STAGING, "no such file", 2)
        demand.routes_changed(
            RouteTable(revision=2, models=["chat"], adapters={"sql": AdapterRoutes("chat", {}, new)})
        )
    [(why, failure)] = result
    assert failure == new
    assert "`sql`" in why and "`chat`" in why and "(staging): no such file" in why
    [activity] = demand.activity()
    assert (activity.adapter, activity.misses, activity.held) == ("sql", 1, 0)
