"""The agent before an engine that loads LoRA adapters only at start: each adapter staged and its path on
the node put in the launch spec before the engine starts; a missing adapter keeps the engine from starting
and says which."""

from __future__ import annotations

import attrs
import pytest
import trio

from llmgw.agent.lora import adapter_file, stage_at_start
from llmgw.agent.supervisor import ShardSupervisor
from llmgw.models import Command, LaunchSpec, LoraSpec
from llmgw.testing.agent import ScriptEngine, agent_config, desired, kill_group, wait_state, write_scripts
from llmgw.testing.processes import free_port


def spec_with(*adapters: tuple[str, str]) -> LaunchSpec:
    """A launch spec whose engine starts with ``adapters`` (name, source)."""
    return LaunchSpec(
        model_source="/m", served_name="m", host="127.0.0.1", port=1, lora=LoraSpec(4, at_start=adapters)
    )


class TestStageAtStart:
    """:func:`stage_at_start`: sources to paths on this node, in order."""

    async def test_paths_on_the_node_are_kept_and_staged_sources_become_their_only_file(self, tmp_path):
        """A local file stays; a seed staged to a directory holding one GGUF file becomes that file (its
        bookkeeping aside); a staged directory of several files stays a directory; the order is kept."""
        local = tmp_path / "chat.gguf"
        local.write_bytes(b"GGUF")
        one = tmp_path / "staged-one"
        one.mkdir()
        (one / "sql.gguf").write_bytes(b"GGUF")
        (one / ".llmgw-manifest").write_text("{}")
        many = tmp_path / "staged-many"
        many.mkdir()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (many / name).write_text("x")
        staged = {"seed:///sql": str(one), "hf://acme/peft": str(many)}
        lines: list[str] = []

        async def stage(source, progress):
            progress("fetching 50%")
            return staged[source]

        spec = spec_with(("sql", "seed:///sql"), ("chat", str(local)), ("peft", "hf://acme/peft"))
        out = await stage_at_start(spec, stage, lambda detail, staged=None: lines.append(detail))
        assert isinstance(out, LaunchSpec)
        paths = (("sql", str(one / "sql.gguf")), ("chat", str(local)), ("peft", str(many)))
        assert out.lora.at_start == paths
        assert lines == ["LoRA adapter sql: fetching 50%", "LoRA adapter peft: fetching 50%"]
        assert attrs.evolve(out, lora=spec.lora) == spec, "nothing else changes"

    async def test_a_missing_adapter_is_a_problem_naming_it(self, tmp_path):
        """A path that is not on this node: the problem names the adapter and the path."""
        out = await stage_at_start(spec_with(("law", str(tmp_path / "nope.gguf"))), None, lambda *a: None)
        missing = tmp_path / "nope.gguf"
        assert out == (
            f"LoRA adapter law: nothing at {missing} on this node (its engine loads adapters at start)"
        )

    async def test_a_distributable_source_without_staging_is_a_problem(self):
        """An agent that stages nothing cannot start an engine with a seed or Hub adapter."""
        out = await stage_at_start(spec_with(("sql", "seed:///sql")), None, lambda *a: None)
        assert out == "LoRA adapter sql: seed:///sql is not a path on this node, and this agent stages none"

    async def test_a_spec_without_adapters_at_start_is_unchanged(self):
        """No LoRA, or adapters loaded at run time: the very spec."""
        spec = spec_with()
        assert await stage_at_start(spec, None, lambda *a: None) is spec

    async def test_a_workers_spec_is_unchanged(self):
        """A worker (rank 1 of 2) loads no adapter: nothing is staged or checked for it."""
        spec = attrs.evolve(spec_with(("sql", "/nowhere/sql.gguf")), rank=1, nnodes=2, dist_init_addr="h:1")
        assert await stage_at_start(spec, None, lambda *a: None) is spec

    def test_adapter_file_of_nothing_is_none(self, tmp_path):
        """Nothing at the path: None."""
        assert adapter_file(str(tmp_path / "none")) is None


class AtStartScript(ScriptEngine):
    """The fake engine as an engine that loads adapters at start: their paths go in its environment."""

    serves_lora = True
    lora_at_start = True

    def build_command(self, spec: LaunchSpec) -> Command:
        command = super().build_command(spec)
        paths = ",".join(path for _, path in spec.lora.at_start) if spec.lora is not None else ""
        return attrs.evolve(command, env={**command.env, "LORA": paths})


@pytest.fixture
async def run_shard(nursery, tmp_path):
    """Start a shard of :class:`AtStartScript` with given adapters; its process groups end with the test."""
    groups: list[int] = []
    engine_script, _ = write_scripts(tmp_path / "scripts")

    def start(*adapters: tuple[str, str]) -> list:
        shard = desired("script", free_port("127.0.0.1"))
        shard = attrs.evolve(shard, spec=attrs.evolve(shard.spec, lora=LoraSpec(4, at_start=adapters)))
        states: list = []
        supervisor = ShardSupervisor(
            shard,
            AtStartScript(engine_script),
            agent_config(tmp_path),
            states.append,
            on_spawn=lambda child: groups.append(child.pgid),
        )
        nursery.start_soon(supervisor.run)
        return states

    try:
        yield start
    finally:
        for pgid in groups:
            kill_group(pgid)


class TestSupervisor:
    """A shard of an engine loading adapters at start."""

    async def test_the_engine_starts_with_each_adapters_path(self, run_shard, tmp_path):
        """The command is built from the adapters' paths on the node, in order."""
        first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
        first.write_bytes(b"GGUF")
        second.write_bytes(b"GGUF")
        states = run_shard(("a", str(first)), ("b", str(second)))
        with trio.fail_after(15):
            ready = await wait_state(states, {"ready", "exited", "unhealthy"})
        assert ready.state == "ready", ready
        assert ready.env["LORA"] == f"{first},{second}"

    async def test_a_missing_adapter_keeps_the_engine_from_starting(self, run_shard, tmp_path):
        """An adapter not on the node: the shard exits before its engine starts, saying which adapter."""
        states = run_shard(("a", str(tmp_path / "missing.gguf")))
        with trio.fail_after(15):
            exited = await wait_state(states, {"ready", "exited", "unhealthy"})
        assert exited.state == "exited" and exited.pid is None
        assert exited.detail.startswith("LoRA adapter a: nothing at ")
