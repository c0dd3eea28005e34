"""What `ctl diff` and `ctl apply` say a catalog changes: from two catalogs and the replicas that exist."""

from __future__ import annotations

from llmgw.models import Catalog, Model, Profile, Sidecar
from llmgw.server.catalog_diff import catalog_diff


def catalog(**models: Model) -> Catalog:
    profiles = {"one": Profile(engine="sim"), "two": Profile(engine="sim", nodes=2, args=("--x", "1"))}
    return Catalog(profiles=profiles, models=models)


class TestCatalogDiff:
    """catalog_diff: one change per model or profile, with replicas to place, stop, and left outdated."""

    def test_same_catalog_has_no_change(self):
        """Applying the catalog in force again changes nothing."""
        same = catalog(a=Model(source="/a", profile="one"))
        assert catalog_diff(same, same, {"a": 1}, revision=3).changes == ()

    def test_added_model_places_its_replicas(self):
        """A new model is `added` with every replica to place."""
        diff = catalog_diff(catalog(), catalog(a=Model(source="/a", profile="one", replicas=3)), {})
        [change] = diff.changes
        assert (change.section, change.name, change.change, change.add, change.stop) == (
            "model",
            "a",
            "added",
            3,
            0,
        )

    def test_removed_model_stops_the_replicas_that_exist(self):
        """A removed model stops the replicas that exist, whatever the old catalog asked for."""
        old = catalog(a=Model(source="/a", profile="one", replicas=3))
        diff = catalog_diff(old, catalog(), {"a": 2}, revision=7)
        assert diff.removed_models == ("a",)
        assert diff.changes[0].stop == 2 and diff.revision == 7

    def test_scaling_names_the_field_and_the_replicas(self):
        """replicas 2 -> 4 with 2 running: two to place, none outdated (the command is the same)."""
        old = catalog(a=Model(source="/a", profile="one", replicas=2))
        new = catalog(a=Model(source="/a", profile="one", replicas=4))
        [change] = catalog_diff(old, new, {"a": 2}).changes
        assert change.fields == ("replicas: 2 -> 4",)
        assert (change.add, change.stop, change.outdated) == (2, 0, 0)

    def test_scaling_down_stops_the_surplus(self):
        """replicas 3 -> 1 with 3 running: two to stop."""
        old = catalog(a=Model(source="/a", profile="one", replicas=3))
        new = catalog(a=Model(source="/a", profile="one", replicas=1))
        assert catalog_diff(old, new, {"a": 3}).changes[0].stop == 2

    def test_a_new_source_leaves_running_replicas_outdated(self):
        """A changed source changes the command: the running replicas are outdated."""
        old = catalog(a=Model(source="/a", profile="one", replicas=2))
        new = catalog(a=Model(source="/a2", profile="one", replicas=2))
        [change] = catalog_diff(old, new, {"a": 2}).changes
        assert change.fields == ("source: /a -> /a2",) and change.outdated == 2

    def test_profile_args_show_under_every_model_using_it(self):
        """Changed profile args are listed for the profile and for each model on it, as outdated."""
        old = catalog(b=Model(source="/b", profile="two"))
        changed = Catalog(
            profiles={**old.profiles, "two": Profile(engine="sim", nodes=2, args=("--x", "2"))},
            models=old.models,
        )
        model, profile = catalog_diff(old, changed, {"b": 1}).changes
        assert model.fields == ("profile two: args: [--x, 1] -> [--x, 2]",) and model.outdated == 1
        assert (profile.section, profile.name, profile.fields) == (
            "profile",
            "two",
            ("args: [--x, 1] -> [--x, 2]",),
        )

    def test_timings_do_not_outdate_replicas(self):
        """A new ready_timeout or stop_grace is a change, but no replica's command changes."""
        old = catalog(a=Model(source="/a", profile="one"))
        new = Catalog(
            profiles={**old.profiles, "one": Profile(engine="sim", stop_grace=5)}, models=old.models
        )
        model = catalog_diff(old, new, {"a": 1}).changes[0]
        assert model.fields == ("profile one: stop_grace: (default) -> 5",) and model.outdated == 0

    def test_long_values_are_shown_whole(self):
        """A sidecar list is shown as fields, whole however long (a flag added at the end is seen)."""
        old = catalog(a=Model(source="/a", profile="one"))
        sidecar = Sidecar(name="proxy", argv=("x" * 100,))
        new = Catalog(
            profiles={**old.profiles, "one": Profile(engine="sim", sidecars=(sidecar,))}, models=old.models
        )
        [line] = catalog_diff(old, new, {"a": 1}).changes[0].fields
        assert line.startswith("profile one: sidecars: [] -> [{name: proxy, argv: [" + "x" * 100 + "]")


def lora_catalog(adapters: dict[str, str], max_adapters: int = 4, **others: Model) -> Catalog:
    """One model ``chat`` on profile ``lora`` with ``adapters``, and ``others`` on it too."""
    profiles = {"lora": Profile(engine="sim", max_adapters=max_adapters)}
    models = {"chat": Model(source="/chat", profile="lora", replicas=2, adapters=adapters), **others}
    return Catalog(profiles=profiles, models=models)


class TestAdapterDiff:
    """Adapters are loaded on running engines: adding one restarts nothing; the LoRA limits do."""

    def test_adding_and_removing_adapters_restarts_no_replica(self):
        """Adapters added and removed are listed one per line, and no replica is outdated."""
        old = lora_catalog({"sql": "hf://acme/sql@main", "old": "seed:///data/old"})
        new = lora_catalog({"sql": "hf://acme/sql@main", "legal": "hf://acme/legal@v2"})
        [change] = catalog_diff(old, new, {"chat": 2}).changes
        assert change.fields == (
            "adapters.legal: (none) -> hf://acme/legal@v2",
            "adapters.old: seed:///data/old -> (none)",
        )
        assert (change.add, change.stop, change.outdated) == (0, 0, 0)

    def test_a_changed_adapter_source_restarts_no_replica(self):
        """A new source for an adapter is fetched and loaded again, on the running replicas."""
        old = lora_catalog({"sql": "hf://acme/sql@v1"})
        [change] = catalog_diff(old, lora_catalog({"sql": "hf://acme/sql@v2"}), {"chat": 2}).changes
        assert change.fields == ("adapters.sql: hf://acme/sql@v1 -> hf://acme/sql@v2",)
        assert change.outdated == 0

    def test_the_first_adapter_enables_lora_so_replicas_restart(self):
        """A model gaining its first adapter runs its engine with LoRA flags: its replicas are outdated."""
        new = lora_catalog({"sql": "hf://acme/sql@main"})
        [change] = catalog_diff(lora_catalog({}), new, {"chat": 2}).changes
        assert change.outdated == 2

    def test_max_adapters_restarts_the_replicas_of_models_with_adapters_only(self):
        """``max_adapters`` is an engine flag: a model with adapters is outdated, one without is not."""
        plain = Model(source="/plain", profile="lora")
        old = lora_catalog({"sql": "hf://acme/sql@main"}, max_adapters=4, plain=plain)
        new = lora_catalog({"sql": "hf://acme/sql@main"}, max_adapters=8, plain=plain)
        chat, plain_change, profile = catalog_diff(old, new, {"chat": 2, "plain": 1}).changes
        assert chat.name == "chat" and chat.outdated == 2
        assert chat.fields == ("profile lora: max_adapters: 4 -> 8",)
        assert plain_change.name == "plain" and plain_change.outdated == 0
        assert profile.fields == ("max_adapters: 4 -> 8",)


def at_start_catalog(adapters: dict[str, str]) -> Catalog:
    """``chat`` (2 replicas) on an engine that loads adapters only at start (llama.cpp), with ``adapters``."""
    profiles = {"lora": Profile(engine="llamacpp", gpus_per_node=0, adapters_at_start=True)}
    chat = Model(source="/chat", profile="lora", replicas=2, adapters=adapters)
    return Catalog(profiles=profiles, models={"chat": chat})


class TestAdaptersAtStartDiff:
    """On an engine that loads adapters only at start, which adapters and their sources are its command."""

    def test_adding_an_adapter_restarts_the_replicas(self):
        """A new adapter is a new ``--lora``: the replicas are outdated."""
        old = at_start_catalog({"sql": "/a/sql.gguf"})
        new = at_start_catalog({"sql": "/a/sql.gguf", "law": "/a/law.gguf"})
        [change] = catalog_diff(old, new, {"chat": 2}).changes
        assert change.fields == ("adapters.law: (none) -> /a/law.gguf",) and change.outdated == 2

    def test_a_changed_source_restarts_the_replicas(self):
        """A new source for an adapter is a new file to start with."""
        old = at_start_catalog({"sql": "/a/sql.gguf"})
        [change] = catalog_diff(old, at_start_catalog({"sql": "/b/sql.gguf"}), {"chat": 2}).changes
        assert change.outdated == 2

    def test_reordered_adapters_restart_nothing(self):
        """Their order numbers them, but a running replica keeps its own launch's numbering (and the routes
        feed gives its request fields from it): nothing to restart."""
        old = at_start_catalog({"sql": "/a/sql.gguf", "law": "/a/law.gguf"})
        new = at_start_catalog({"law": "/a/law.gguf", "sql": "/a/sql.gguf"})
        assert catalog_diff(old, new, {"chat": 2}).changes == ()
