"""The model queue: seats per replica, priority classes, fair share of tokens (VTC), and its 503s."""

from __future__ import annotations

import json

import httpx
import trio

from llmgw.gateway.queue import FairQueue, Overflow, QueueCause, Queues, QueueSettings, _Waiter
from llmgw.net.server import HttpServer, Request, Response
from llmgw.testing.gateway import HeldStream, serve_feed, start_gateway
from llmgw.testing.processes import wait_for
from llmgw.wire import Priority

CRITICAL, STANDARD, BATCH = 0, 1, 2


def served(queue: FairQueue, tokens: dict[str, int]) -> list[str]:
    """Pop every waiter, each served at once and charged ``tokens[tenant]``: the tenants in serving order."""
    order = []
    while (waiter := queue.pop()) is not None:
        queue.started(waiter.tenant, waiter.rank)
        queue.charge(waiter.tenant, tokens.get(waiter.tenant, 100))
        order.append(waiter.tenant)
    return order


class TestFairQueue:
    """The order waiters leave a model's queue in."""

    async def test_classes_go_in_order_critical_standard_batch(self):
        """Whatever the arrival order, every critical request goes before standard, standard before batch."""
        queue = FairQueue()
        for tenant, rank in [("b", BATCH), ("s", STANDARD), ("c", CRITICAL), ("b", BATCH), ("c", CRITICAL)]:
            queue.push(_Waiter(tenant, rank))
        assert served(queue, {}) == ["c", "c", "s", "b", "b"]

    async def test_a_tenant_of_small_requests_is_served_more_often(self):
        """Within a class, shares are in tokens: requests of 10 tokens go ten times as often as 100's."""
        queue = FairQueue()
        for _ in range(30):
            queue.push(_Waiter("big", STANDARD))
            queue.push(_Waiter("small", STANDARD))
        order = served(queue, {"big": 100, "small": 10})[:33]
        assert 2 <= order.count("big") <= 4 and order.count("small") >= 29

    async def test_equal_tenants_alternate(self):
        """Two tenants with the same requests take turns, whoever queued more."""
        queue = FairQueue()
        for _ in range(10):
            queue.push(_Waiter("a", STANDARD))
        for _ in range(3):
            queue.push(_Waiter("b", STANDARD))
        order = served(queue, {})
        assert sorted(order[:2]) == sorted(order[2:4]) == sorted(order[4:6]) == ["a", "b"]

    async def test_an_idle_spell_earns_no_credit(self):
        """A tenant that sent nothing while another was served is lifted when it starts waiting: it does not
        then get every seat until it has caught up."""
        queue = FairQueue()
        for _ in range(50):  # a alone, served a lot
            queue.push(_Waiter("a", STANDARD))
        served(queue, {})
        for _ in range(5):
            queue.push(_Waiter("a", STANDARD))
            queue.push(_Waiter("b", STANDARD))
        order = served(queue, {})
        assert sorted(order[:2]) == sorted(order[2:4]) == ["a", "b"]

    async def test_a_waiter_that_gives_up_leaves_the_queue(self):
        """A removed waiter is never served and no longer counts as waiting."""
        queue = FairQueue()
        first, second = _Waiter("a", BATCH), _Waiter("b", BATCH)
        queue.push(first)
        queue.push(second)
        queue.remove(first)
        assert queue.waiting == 1 and queue.pop() is second and queue.pop() is None


class TestQueues:
    """Seats per replica and waiting for one, on trio's (autojump) clock."""

    def queues(self, replicas: int = 1, **settings) -> Queues:
        settings = {"replica_concurrency": 1, "size": 4, "timeout": 10.0} | settings
        return Queues(QueueSettings(**settings), lambda model: replicas)

    async def test_disabled_without_replica_concurrency(self):
        """The default settings queue nothing."""
        assert not Queues(QueueSettings(), lambda model: 1).enabled

    async def test_a_freed_seat_goes_to_the_higher_class(self, autojump_clock, nursery):
        """One seat taken; batch then critical wait; the seat freed goes to critical, the next to batch."""
        queues = self.queues()
        assert await queues.enter("m", "first", Priority.STANDARD) is None
        order = []

        async def wait(tenant: str, priority: Priority) -> None:
            assert await queues.enter("m", tenant, priority) is None
            order.append(tenant)

        nursery.start_soon(wait, "batch", Priority.BATCH)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait, "critical", Priority.CRITICAL)
        await trio.testing.wait_all_tasks_blocked()
        assert queues.depth()[("m", Priority.BATCH)] == 1 and queues.depth()[("m", Priority.CRITICAL)] == 1
        queues.leave("m", "first", 100)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["critical"]
        queues.leave("m", "critical", 100)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["critical", "batch"] and queues.seated["m"] == 1

    async def test_a_full_queue_and_a_long_wait_overflow(self, autojump_clock, nursery):
        """With the seat taken: past --queue-size a request is turned away at once; a waiting one is turned
        away after --queue-timeout, and its place freed."""
        queues = self.queues(size=1, timeout=5.0)
        assert await queues.enter("m", "a", Priority.STANDARD) is None
        outcome = []
        ended = trio.Event()

        async def wait() -> None:
            outcome.append(await queues.enter("m", "b", Priority.CRITICAL))
            ended.set()

        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        full = await queues.enter("m", "c", Priority.CRITICAL)
        assert full == Overflow(QueueCause.FULL, "m", 1)
        assert full.retry_seconds() == 1 and "(--queue-size 1)" in full.message()
        started = trio.current_time()
        await ended.wait()
        assert outcome == [Overflow(QueueCause.TIMEOUT, "m", 5.0)] and trio.current_time() - started >= 5
        assert outcome[0].retry_seconds() == 2 and "(--queue-timeout 5)" in outcome[0].message()
        assert queues.depth()[("m", Priority.CRITICAL)] == 0

    async def test_a_client_that_leaves_gives_its_place_up(self, autojump_clock, nursery):
        """A waiter cancelled (its client left) is out of the queue; the next seat goes to the one after."""
        queues = self.queues()
        assert await queues.enter("m", "a", Priority.STANDARD) is None
        left = trio.CancelScope()
        order = []

        async def wait(tenant: str) -> None:
            with left if tenant == "gone" else trio.CancelScope():
                await queues.enter("m", tenant, Priority.STANDARD)
                order.append(tenant)

        nursery.start_soon(wait, "gone")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait, "next")
        await trio.testing.wait_all_tasks_blocked()
        left.cancel()
        await trio.testing.wait_all_tasks_blocked()
        queues.leave("m", "a", 10)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["next"] and queues.seated["m"] == 1

    async def test_a_new_replica_brings_seats_to_waiters(self, autojump_clock, nursery):
        """Two waiting on one replica's seat; a second replica in the routes seats one of them at once."""
        replicas = [1]
        queues = Queues(QueueSettings(1, 4, 10.0), lambda model: replicas[0])
        assert await queues.enter("m", "a", Priority.STANDARD) is None
        seated = []

        async def wait(tenant: str) -> None:
            await queues.enter("m", tenant, Priority.STANDARD)
            seated.append(tenant)

        nursery.start_soon(wait, "b")
        nursery.start_soon(wait, "c")
        await trio.testing.wait_all_tasks_blocked()
        replicas[0] = 2
        queues.routes_changed()
        await trio.testing.wait_all_tasks_blocked()
        assert len(seated) == 1 and queues.seated["m"] == 2


class Engine:
    """An engine in-process: streams held until released, JSON answers of 30 tokens at once."""

    def __init__(self) -> None:
        self.held = HeldStream(b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n")

    async def handle(self, request: Request) -> Response:
        if json.loads(request.body).get("stream"):
            return Response.stream(200, self.held())
        usage = {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}
        return Response.json(200, {"object": "text_completion", "choices": [{"text": "a"}], "usage": usage})


KEYS = {"sk-alice-0123456789": "alice", "sk-bob-0123456789": "bob"}
ALICE, BOB = list(KEYS)


async def post(client: httpx.AsyncClient, url: str, key: str) -> httpx.Response:
    body = {"model": "m", "prompt": "hi"}
    return await client.post(f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})


class TestQueueOverHttp:
    """A gateway with --replica-concurrency 1 in front of one replica whose only seat a held stream takes."""

    async def serve(self, nursery, **queue) -> tuple[str, Engine]:
        engine = Engine()
        host, port = await nursery.start(HttpServer(engine.handle).serve, "127.0.0.1", 0)
        with trio.fail_after(10):
            feed = await serve_feed(nursery, keys=KEYS, m=[("m-0", f"http://{host}:{port}")])
            _, url = await start_gateway(nursery, feed.url, queue=QueueSettings(1, **queue))
        return url, engine

    async def test_full_queue_and_timeout_are_503_naming_the_flag(self, nursery):
        """Seat taken, one waiting: the next is 503 queue_full (Retry-After 1); the waiting one is 503
        queue_timeout after --queue-timeout; once the seat is free requests are served again."""
        url, engine = await self.serve(nursery, size=1, timeout=1.0)
        async with httpx.AsyncClient(timeout=10) as client, trio.open_nursery() as inner:
            body = {"model": "m", "prompt": "hi", "stream": True}
            headers = {"authorization": f"Bearer {ALICE}"}
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as stream:
                assert stream.status_code == 200
                waited = []

                async def wait() -> None:
                    waited.append(await post(client, url, BOB))

                inner.start_soon(wait)
                with trio.fail_after(10):
                    await wait_for(lambda: waiting(client, url), "bob to wait")
                full = await post(client, url, ALICE)
                assert full.status_code == 503 and full.headers["retry-after"] == "1"
                error = full.json()["error"]
                assert error["code"] == "queue_full" and error["type"] == "server_error"
                assert error["message"] == (
                    "every replica of model `m` is busy and 1 requests wait for it already "
                    "(--queue-size 1); retry in 1 s."
                )
                with trio.fail_after(10):
                    await wait_for(lambda: waited, "bob's wait to end")
                assert waited[0].status_code == 503 and waited[0].headers["retry-after"] == "1"
                assert waited[0].json()["error"]["code"] == "queue_timeout"
                assert "(--queue-timeout 1)" in waited[0].json()["error"]["message"]
                engine.held.release()
                assert (await stream.aread()).endswith(b"data: [DONE]\n\n")
            assert (await post(client, url, BOB)).status_code == 200
            metrics = (await client.get(f"{url}/metrics")).text
        assert 'llmgw_gateway_queue_overflows_total{cause="queue_full",model="m"} 1.0' in metrics
        assert 'llmgw_gateway_queue_overflows_total{cause="queue_timeout",model="m"} 1.0' in metrics
        assert 'llmgw_gateway_key_requests_total{key="bob",model="m",status="503"} 1.0' in metrics

    async def test_a_waiting_request_is_served_when_the_seat_frees(self, nursery):
        """Bob's request waits behind alice's stream, is answered 200 once it ends, and its wait is in
        llmgw_gateway_queue_seconds by key name."""
        url, engine = await self.serve(nursery, timeout=30.0)
        async with httpx.AsyncClient(timeout=10) as client, trio.open_nursery() as inner:
            body = {"model": "m", "prompt": "hi", "stream": True}
            headers = {"authorization": f"Bearer {ALICE}"}
            waited = []
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as stream:

                async def wait() -> None:
                    waited.append(await post(client, url, BOB))

                inner.start_soon(wait)
                with trio.fail_after(10):
                    await wait_for(lambda: waiting(client, url), "bob to wait")
                assert not waited
                engine.held.release()
                await stream.aread()
            with trio.fail_after(10):
                await wait_for(lambda: waited, "bob's answer")
            assert waited[0].status_code == 200
            metrics = (await client.get(f"{url}/metrics")).text
        assert 'llmgw_gateway_queue_seconds_count{key="bob"} 1.0' in metrics
        assert 'llmgw_gateway_queued_requests{model="m",priority="standard"} 0.0' in metrics


async def waiting(client: httpx.AsyncClient, url: str) -> bool:
    """Whether the gateway's /metrics shows one standard request waiting for model m."""
    metrics = (await client.get(f"{url}/metrics")).text
    return 'llmgw_gateway_queued_requests{model="m",priority="standard"} 1.0' in metrics
