"""Staging with no shard of its own: sources asked for ahead, and adapter copies held while loaded."""

from __future__ import annotations

import types

import trio
import trio.testing

from llmgw.agent.eviction import weights_in_use
from llmgw.agent.prestage import AT_ONCE, PreStager


def agent_with(prestage: PreStager) -> types.SimpleNamespace:
    """An agent with no shard, only ``prestage`` (what :func:`weights_in_use` reads)."""
    return types.SimpleNamespace(prestage=prestage, supervisors={})


class TestHold:
    """An adapter held by a replica is in use (never evicted) until every holder released it."""

    async def test_a_held_adapter_is_in_use_until_each_holder_released_it(self, nursery):
        """Two replicas hold one adapter: in use until both released it; the path is what staging gave."""
        staged: list[str] = []

        async def stage(source, progress):
            staged.append(source)
            return f"/models/{source[-3:]}"

        prestage = PreStager(nursery, stage)
        assert await prestage.hold("hf://acme/sql", "r1", print) == "/models/sql"
        assert await prestage.hold("hf://acme/sql", "r2", print) == "/models/sql"
        assert staged == ["hf://acme/sql", "hf://acme/sql"], "each load stages (and so marks the copy used)"
        assert weights_in_use(agent_with(prestage))[0] == {"hf://acme/sql"}
        prestage.release("hf://acme/sql", "r1")
        assert weights_in_use(agent_with(prestage))[0] == {"hf://acme/sql"}
        prestage.release_all("r2")
        assert weights_in_use(agent_with(prestage))[0] == set()
        prestage.release("hf://acme/sql", "r2")  # releasing what is not held does nothing

    async def test_a_copy_being_made_is_held_and_a_cancelled_hold_holds_nothing(self, nursery):
        """While the copy is fetched it is in use; the load cancelled, it is not."""
        started = trio.Event()

        async def stage(source, progress):
            started.set()
            await trio.sleep_forever()

        prestage = PreStager(nursery, stage)
        scope = trio.CancelScope()

        async def load() -> None:
            with scope:
                await prestage.hold("hf://acme/sql", "r1", print)

        nursery.start_soon(load)
        await started.wait()
        assert prestage.sources == {"hf://acme/sql"}
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert prestage.sources == frozenset()


class TestAhead:
    """Sources the server asks for are staged a few at a time, and stop being in use when no longer asked."""

    async def test_at_most_a_few_sources_stage_at_once(self, nursery):
        """Ten adapters asked for: AT_ONCE copies run, the rest wait their turn; all end staged."""
        running, most = [0], [0]
        gate = trio.Event()

        async def stage(source, progress):
            running[0] += 1
            most[0] = max(most[0], running[0])
            await gate.wait()
            running[0] -= 1
            return source

        prestage = PreStager(nursery, stage)
        sources = tuple(f"hf://acme/a{i}" for i in range(10))
        prestage.update(sources)
        await trio.testing.wait_all_tasks_blocked()
        assert running[0] == AT_ONCE and prestage.sources == set(sources)
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert prestage.done == set(sources) and most[0] == AT_ONCE
        prestage.update(())
        assert prestage.sources == frozenset()
