"""Which sources a catalog asks the fleet to hold: models' and adapters' (staged where their base runs)."""

from __future__ import annotations

from llmgw.models import Catalog, Model, Profile
from llmgw.weights import adapter_sources, catalog_sources

CATALOG = Catalog(
    profiles={"one": Profile(engine="sim")},
    models={
        "chat": Model(
            source="hf://acme/chat@main",
            profile="one",
            adapters={"sql": "hf://acme/sql@main", "legal": "seed:///data/legal", "local": "/loras/local"},
        ),
        "code": Model(source="/models/code", profile="one", adapters={"py": "hf://acme/sql@main"}),
        "plain": Model(source="seed:///data/plain", profile="one"),
    },
)


class TestCatalogSources:
    """Agents report on, and publish seeds of, every source: models' and adapters', each once."""

    def test_every_source_once(self):
        """Model sources and adapter sources, sorted; one source used twice is listed once."""
        assert catalog_sources(CATALOG) == (
            "/loras/local",
            "/models/code",
            "hf://acme/chat@main",
            "hf://acme/sql@main",
            "seed:///data/legal",
            "seed:///data/plain",
        )


class TestAdapterSources:
    """A node running a model is asked to stage its distributable adapters."""

    def test_the_distributable_adapters_of_the_models_run(self):
        """A plain path is never copied; a model without adapters or unknown adds nothing."""
        assert adapter_sources(CATALOG, ["chat", "chat", "plain", "gone"]) == (
            "hf://acme/sql@main",
            "seed:///data/legal",
        )
        assert adapter_sources(CATALOG, ["code"]) == ("hf://acme/sql@main",)
        assert adapter_sources(CATALOG, []) == ()
