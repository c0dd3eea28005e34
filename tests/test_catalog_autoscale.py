"""The catalog's autoscaled models: ``replicas:`` as a mapping, ``priority`` and ``idle_after``."""

from __future__ import annotations

import textwrap

import pytest

from llmgw.catalog import parse_catalog
from llmgw.engine import Engine, LoadMetrics
from llmgw.errors import CatalogError
from llmgw.models import Autoscale, Command, LaunchSpec, ScaleTarget

HEAD = """
profiles:
  single:
    engine: sim
models:
  chat:
    source: /models/chat
    profile: single
"""


@pytest.fixture(scope="module")
def engines():
    """The sim engine, as its plugin registers it."""
    from llmgw_engine_sim import SimEngine

    return {"sim": SimEngine()}


def parse(engines, model_lines: str):
    """The catalog of one model ``chat`` with ``model_lines`` added to its entry."""
    text = HEAD + textwrap.indent(textwrap.dedent(model_lines), "    ")
    return parse_catalog(text, engines)


def problems(engines, model_lines: str) -> list[str]:
    """The problems ``parse`` raises for ``model_lines``."""
    with pytest.raises(CatalogError) as caught:
        parse(engines, model_lines)
    return caught.value.problems


class TestIntegerReplicas:
    """A catalog written before autoscaling reads exactly as before."""

    def test_integer_is_a_fixed_count(self, engines):
        """`replicas: 3` is three replicas, no autoscaling, priority 0."""
        model = parse(engines, "replicas: 3").models["chat"]
        assert (model.replicas, model.autoscale, model.priority, model.idle_after) == (3, None, 0, None)

    def test_autoscale_is_not_a_key(self, engines):
        """The record's `autoscale` is filled from `replicas:`; written as a key it is unknown."""
        found = problems(engines, "autoscale: {min: 1, max: 2}")
        assert found == [
            "models.chat.autoscale: unknown key (expected one of: source, profile, replicas, served_name, "
            "rollout, priority, idle_after, adapters)"
        ]


class TestMappingReplicas:
    """`replicas: {min, max, target, ...}` makes an autoscaled model."""

    def test_mapping_is_read(self, engines):
        """Every key is read; the model's fixed count is its `min`."""
        model = parse(
            engines,
            """
            priority: 7
            replicas:
              min: 1
              max: 4
              target: {waiting_per_replica: 4, kv_cache_usage: 0.8}
              scale_down_after: 30
              cooldown: 5
              max_step: 1
            """,
        ).models["chat"]
        assert model.replicas == 1
        assert model.priority == 7
        assert model.autoscale == Autoscale(
            min=1, max=4, target=ScaleTarget(4, 0.8), scale_down_after=30, cooldown=5, max_step=1
        )

    def test_zero_min_with_idle_after_is_read(self, engines):
        """`min: 0` with `idle_after`: the model may sleep at zero replicas (its fixed count is 0)."""
        model = parse(
            engines, "idle_after: 300\nreplicas: {min: 0, max: 2, target: {waiting_per_replica: 4}}"
        )
        chat = model.models["chat"]
        assert (chat.replicas, chat.autoscale.min, chat.idle_after) == (0, 0, 300)

    def test_defaults(self, engines):
        """Without windows given: 60 s to scale down, 10 s of cooldown, 2 replicas per step."""
        auto = parse(engines, "replicas: {min: 2, max: 2}").models["chat"].autoscale
        assert (auto.scale_down_after, auto.cooldown, auto.max_step, auto.target.signals()) == (60, 10, 2, {})

    @pytest.mark.parametrize(
        ("lines", "expected"),
        [
            (
                "replicas: {min: 3, max: 2, target: {waiting_per_replica: 1}}",
                "models.chat.replicas.min: 3 is above max (2)",
            ),
            ("replicas: {min: -1, max: 2}", "models.chat.replicas.min: expected an integer >= 0, got -1"),
            ("replicas: {min: 1}", "models.chat.replicas.max: required, missing"),
            (
                "replicas: {min: 1, max: 2, target: {ttft_p99: 1}}",
                "models.chat.replicas.target.ttft_p99: unknown key (expected one of: waiting_per_replica, "
                "kv_cache_usage, ttft_p95)",
            ),
            (
                "replicas: {min: 1, max: 2}",
                "models.chat.replicas.target: expected at least one of waiting_per_replica, kv_cache_usage, "
                "ttft_p95 when min (1) and max (2) differ: nothing would say when to scale",
            ),
            (
                "replicas: {min: 1, max: 2, target: {kv_cache_usage: 1.5}}",
                "models.chat.replicas.target.kv_cache_usage: expected a share above 0 and at most 1, got 1.5",
            ),
            (
                "replicas: {min: 1, max: 2, target: {waiting_per_replica: 0}}",
                "models.chat.replicas.target.waiting_per_replica: expected a number above 0, got 0",
            ),
            (
                "replicas: {min: 1, max: 2, target: {ttft_p95: 0}}",
                "models.chat.replicas.target.ttft_p95: expected a number of seconds above 0 to 600, got 0",
            ),
            (
                "replicas: {min: 1, max: 2, target: [4]}",
                "models.chat.replicas.target: expected a mapping with the keys waiting_per_replica, "
                "kv_cache_usage, ttft_p95",
            ),
            (
                "replicas: {min: 1, max: 2, max_step: 0, target: {waiting_per_replica: 1}}",
                "models.chat.replicas.max_step: expected an integer >= 1, got 0",
            ),
            (
                "replicas: {min: 1, max: 2, cooldown: -1, target: {waiting_per_replica: 1}}",
                "models.chat.replicas.cooldown: expected a number of seconds from 0 to 3600, got -1",
            ),
            (
                "replicas: {min: 0, max: 2, target: {waiting_per_replica: 1}}",
                "models.chat.idle_after: required when replicas.min is 0 (seconds without a request after "
                "which the model goes to zero replicas)",
            ),
            (
                "idle_after: 60\nreplicas: {min: 0, max: 0}",
                "models.chat.replicas.max: expected an integer >= 1, got 0",
            ),
            (
                "replicas: {min: 1, max: 2, mx_step: 1, target: {waiting_per_replica: 1}}",
                "models.chat.replicas.mx_step: unknown key (expected one of: min, max, target, "
                "scale_down_after, cooldown, max_step)",
            ),
            ("priority: -1", "models.chat.priority: expected an integer >= 0, got -1"),
            (
                "idle_after: 60",
                "models.chat.idle_after: only for a model whose replicas.min is 0 (it says when such a model "
                "goes to zero replicas)",
            ),
            (
                "idle_after: 0\nreplicas: {min: 1, max: 1}",
                "models.chat.idle_after: expected a number of seconds above 0 to 86400, got 0",
            ),
        ],
        ids=[
            "min-above-max", "negative", "no-max", "unknown-target", "no-target", "share", "zero-target",
            "zero-ttft", "target-list", "max-step", "cooldown", "zero-min-no-idle", "zero-max", "typo",
            "priority", "idle-without-zero", "idle-zero",
        ],
    )  # fmt: skip
    def test_nonsense_is_named(self, engines, lines, expected):
        """Each mistake is one problem naming its field."""
        assert problems(engines, lines) == [expected]


class _Quiet(Engine):
    """An engine whose plugin names no load gauges (as llama.cpp's)."""

    name = "quiet"
    checked_versions = ("1",)
    programs = ("quiet",)

    def build_command(self, spec: LaunchSpec) -> Command:
        return Command(argv=["quiet", "--port", str(spec.port)])

    def widest_spec(self) -> LaunchSpec:
        return LaunchSpec(model_source="/m", served_name="m", host="h", port=1)


class _NoCache(_Quiet):
    """An engine that reports its queue but not its KV cache."""

    name = "nocache"
    load_metrics = LoadMetrics(waiting=("q",))


class TestTargetsTheEngineReports:
    """A target the model's engine has no gauge for is refused, naming the engine."""

    @staticmethod
    def parse_on(engine: Engine, target: str):
        text = (
            f"profiles:\n  p:\n    engine: {engine.name}\nmodels:\n  chat:\n    source: /m\n    profile: p\n"
            f"    replicas: {{min: 1, max: 2, target: {target}}}\n"
        )
        return parse_catalog(text, {engine.name: engine})

    def test_an_engine_without_load_gauges_cannot_be_autoscaled(self):
        """No gauges at all: the target is refused, and the fix is said."""
        with pytest.raises(CatalogError) as caught:
            self.parse_on(_Quiet(), "{waiting_per_replica: 2}")
        assert caught.value.problems == [
            "models.chat.replicas.target: engine 'quiet' reports no load gauges (its plugin names none), "
            "so nothing could be measured against a target; give replicas as a number"
        ]

    def test_kv_cache_target_needs_a_kv_cache_gauge(self):
        """The queue is reported, the KV cache is not: only the KV-cache target is refused."""
        assert self.parse_on(_NoCache(), "{waiting_per_replica: 2}").models["chat"].autoscale is not None
        with pytest.raises(CatalogError) as caught:
            self.parse_on(_NoCache(), "{kv_cache_usage: 0.8}")
        assert caught.value.problems == [
            "models.chat.replicas.target.kv_cache_usage: engine 'nocache' reports no KV-cache usage"
        ]

    def test_a_time_to_first_token_target_needs_no_engine_gauge(self):
        """`ttft_p95` is measured by the gateways: an engine without load gauges may autoscale on it."""
        auto = self.parse_on(_Quiet(), "{ttft_p95: 0.5}").models["chat"].autoscale
        assert auto.target.signals() == {"ttft_p95": 0.5}
