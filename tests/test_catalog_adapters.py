"""The catalog's LoRA adapters: ``adapters:`` per model, and per profile the LoRA limits."""

from __future__ import annotations

import textwrap

import pytest

from llmgw.catalog import catalog_summary, parse_catalog
from llmgw.engine import Engine
from llmgw.errors import CatalogError
from llmgw.models import Command, LaunchSpec


class _Engine(Engine):
    """A test engine: serves LoRA adapters or not."""

    versions = ("1",)
    multi_node = False

    def __init__(self, name: str, lora: bool, at_start: bool = False) -> None:
        self.name = name
        self.serves_lora = lora
        self.lora_at_start = at_start

    def widest_spec(self) -> LaunchSpec:
        return LaunchSpec(model_source="/m", served_name="m", host="127.0.0.1", port=8000, gpus=(0,))

    def build_command(self, spec: LaunchSpec) -> Command:
        return Command(argv=("serve", spec.model_source))

    def health_path(self) -> str:
        return "/health"


@pytest.fixture(scope="module")
def engines():
    """``lora``, an engine serving adapters, ``plain``, one serving none, and ``startup``, one loading
    them only at start (as llama.cpp does)."""
    return {
        "lora": _Engine("lora", True),
        "plain": _Engine("plain", False),
        "startup": _Engine("startup", True, at_start=True),
    }


HEAD = """
profiles:
  single:
    engine: lora
    max_adapters: 8
    max_adapter_rank: 64
  plain:
    engine: plain
models:
  chat:
    source: /models/chat
    profile: single
    adapters:
      sql: hf://acme/sql-lora@main
      legal: seed:///data/legal-lora
  code:
    source: /models/code
    served_name: coder
    profile: single
"""


def parse(engines, extra: str = "", head: str = HEAD):
    """The catalog ``head`` with ``extra`` (YAML at the top level, merged by hand) appended."""
    return parse_catalog(textwrap.dedent(head) + textwrap.dedent(extra), engines)


def problems(engines, text: str) -> list[str]:
    """The problems of the catalog ``text``."""
    with pytest.raises(CatalogError) as caught:
        parse_catalog(textwrap.dedent(text), engines)
    return list(caught.value.problems)


class TestAdapters:
    """Adapters are served names with sources, on engines that serve them."""

    def test_a_good_catalog_keeps_the_adapters_and_the_profile_limits(self, engines):
        """The adapters are kept by name with their sources; the summary counts them."""
        catalog = parse(engines)
        assert dict(catalog.models["chat"].adapters) == {
            "sql": "hf://acme/sql-lora@main",
            "legal": "seed:///data/legal-lora",
        }
        assert (catalog.profiles["single"].max_adapters, catalog.profiles["single"].max_adapter_rank) == (
            8,
            64,
        )
        assert (
            catalog.profiles["plain"].max_adapters == 4 and catalog.profiles["plain"].max_adapter_rank == 16
        )
        assert (
            catalog_summary(catalog) == "2 models, 2 replicas, 2 adapters, 2 profiles (engines: lora, plain)"
        )

    @pytest.mark.parametrize(
        "before, after, expected",
        [
            pytest.param(
                "sql: hf://acme/sql-lora@main",
                "coder: hf://acme/sql-lora@main",
                "models.chat.adapters.coder: 'coder' is already the served name of models.code",
                id="an adapter named as another model's served name",
            ),
            pytest.param(
                "sql: hf://acme/sql-lora@main",
                "chat: hf://acme/sql-lora@main",
                "models.chat.adapters.chat: 'chat' is already the served name of models.chat",
                id="an adapter named as its own model",
            ),
            pytest.param(
                "sql: hf://acme/sql-lora@main",
                "chat:sql: hf://acme/sql-lora@main",
                "models.chat.adapters.chat:sql: no ':' in an adapter's name",
                id="a ':' is reserved for SERVED:ADAPTER",
            ),
            pytest.param(
                "sql: hf://acme/sql-lora@main",
                "-sql: hf://acme/sql-lora@main",
                "models.chat.adapters.-sql: invalid name; use letters, digits",
                id="an adapter name breaking the name rule",
            ),
            pytest.param(
                "sql: hf://acme/sql-lora@main",
                "sql: hf://acme",
                "models.chat.adapters.sql: expected hf://ORG/NAME",
                id="a malformed hub source",
            ),
            pytest.param(
                "legal: seed:///data/legal-lora",
                "legal: seed://data/legal",
                "models.chat.adapters.legal: expected seed:///ABSOLUTE/PATH",
                id="a seed source without an absolute path",
            ),
            pytest.param(
                "legal: seed:///data/legal-lora",
                "legal: s3://bucket/legal",
                "models.chat.adapters.legal: unknown source scheme s3://",
                id="a source scheme llmgw does not know",
            ),
            pytest.param(
                "legal: seed:///data/legal-lora",
                "legal: [a, b]",
                "models.chat.adapters.legal",
                id="a source that is not a string",
            ),
        ],
    )
    def test_a_bad_adapter_is_named_by_its_path(self, engines, before, after, expected):
        """Each problem is one line starting with the adapter's path."""
        found = problems(engines, HEAD.replace(before, after))
        assert any(line.startswith(expected) for line in found), found

    def test_an_adapter_name_is_unique_across_models(self, engines):
        """Two models with an adapter of the same name: the second names the first."""
        text = HEAD + "    adapters:\n      sql: seed:///data/other-sql\n"
        found = problems(engines, text)
        assert found == [
            "models.code.adapters.sql: 'sql' is already an adapter of models.chat; "
            "an adapter's name is unique across every model"
        ]

    def test_a_served_name_spelled_as_another_models_adapter_is_refused(self, engines):
        """A model served as ``chat:sql`` would take the requests for adapter sql of chat."""
        found = problems(engines, HEAD.replace("served_name: coder", 'served_name: "chat:sql"'))
        assert found == [
            "models.code.served_name: 'chat:sql' is how clients ask for adapter sql of models.chat "
            "(SERVED:ADAPTER); serve this model under another name"
        ]
        parse(engines, head=HEAD.replace("served_name: coder", 'served_name: "chat:other"'))

    def test_adapters_on_an_engine_without_lora_name_model_profile_and_engine(self, engines):
        """A model with adapters whose profile runs an engine serving none is refused, saying which do."""
        found = problems(
            engines, HEAD.replace("profile: single\n    adapters", "profile: plain\n    adapters")
        )
        assert found == [
            "models.chat.adapters: model 'chat' has LoRA adapters but its profile 'plain' runs engine "
            "'plain', which serves none (engines with LoRA: lora, startup)"
        ]

    def test_adapters_on_an_engine_that_loads_them_only_at_start_are_accepted(self, engines):
        """llama.cpp takes its adapters as --lora at start: its profile says so (adapters_at_start, from the
        plugin), and the model keeps its adapters in catalog order (their ids)."""
        head = HEAD.replace("  plain:\n    engine: plain", "  plain:\n    engine: startup")
        head = head.replace("profile: single\n    adapters", "profile: plain\n    adapters")
        head = head.replace("sql: hf://acme/sql-lora@main", "sql: hf://acme/sql-lora@main\n      b: /b.gguf")
        catalog = parse(engines, head=head)
        assert catalog.profiles["plain"].adapters_at_start
        assert not catalog.profiles["single"].adapters_at_start
        assert list(catalog.models["chat"].adapters) == ["sql", "b", "legal"]

    def test_more_adapters_than_max_adapters_on_an_engine_that_loads_them_at_start_are_refused(self, engines):
        """Every adapter is loaded at start: more than the profile's max_adapters is refused, saying what
        to set or which engines load them on demand."""
        head = HEAD.replace("engine: plain", "engine: startup\n    max_adapters: 1")
        head = head.replace("profile: single\n    adapters", "profile: plain\n    adapters")
        head = head.replace("sql: hf://acme/sql-lora@main", "sql: hf://acme/sql-lora@main\n      b: /b.gguf")
        assert problems(engines, head) == [
            "models.chat.adapters: model 'chat' has 3 LoRA adapters but its profile 'plain' keeps at most 1 "
            "loaded (max_adapters), and engine 'startup' loads every adapter of the model at start; set "
            "profiles.plain.max_adapters to at least 3, or serve them on an engine that loads adapters on "
            "demand (lora)"
        ]

    def test_adapters_at_start_is_not_a_catalog_key(self, engines):
        """The engine's plugin says whether it loads adapters at start; the catalog cannot."""
        head = HEAD.replace("engine: plain", "engine: plain\n    adapters_at_start: true")
        (line,) = problems(engines, head)
        assert line.startswith("profiles.plain.adapters_at_start: unknown key (expected one of: engine, ")
        assert "adapters_at_start," not in line

    def test_a_model_without_adapters_may_use_any_engine(self, engines):
        """No adapters: the engine's LoRA support is not asked about."""
        text = HEAD.replace(
            "served_name: coder\n    profile: single", "served_name: coder\n    profile: plain"
        )
        catalog = parse(engines, head=text)
        assert catalog.models["code"].profile == "plain"
        assert catalog.models["code"].adapters == {}

    @pytest.mark.parametrize(
        "line, expected",
        [
            ("max_adapters: 0", "profiles.single.max_adapters: expected an integer >= 1, got 0"),
            ("max_adapters: 257", "profiles.single.max_adapters: expected an integer at most 256"),
            ("max_adapter_rank: 1024", "profiles.single.max_adapter_rank: expected an integer at most 512"),
            ('max_adapters: "8"', "profiles.single.max_adapters: expected an integer"),
        ],
    )
    def test_profile_limits_out_of_range_are_named(self, engines, line, expected):
        """``max_adapters`` and ``max_adapter_rank`` are bounded integers."""
        key = line.split(":")[0]
        current = "max_adapters: 8" if key == "max_adapters" else "max_adapter_rank: 64"
        found = problems(engines, HEAD.replace(current, line))
        assert any(p.startswith(expected) for p in found), found
