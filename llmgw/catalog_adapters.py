"""LoRA adapters in a catalog: their names, their sources, and the engines that serve them.

Called by :func:`llmgw.catalog.parse_catalog` once every model is structured.
An adapter's name is a served name: clients send it as ``model`` (or
``SERVED:ADAPTER``), so it follows the rule of every other name, is unique
across every model's served name and every other adapter, and has no ``:``.
Its source is checked as a model's ``source`` is
(:func:`llmgw.weights.check_source`): adapters travel as weights do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from llmgw.engine import Engine
from llmgw.models import Model, Profile
from llmgw.weights import check_source

__all__ = [
    "BAD_NAME",
    "NAME",
    "check_adapters",
    "check_lora_engine",
    "not_catalog_keys",
    "with_adapters_at_start",
]

#: the rule for every name in a catalog: profiles, models, adapters
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,62}$")
BAD_NAME = "invalid name; use letters, digits, '.', '_' and '-', at most 63 characters"


def check_adapters(models: Mapping[str, Model], served: Mapping[str, str]) -> list[str]:
    """Each adapter's name (a served name: unique among models' served names and other adapters, no ':',
    which ``SERVED:ADAPTER`` reserves) and its source, and no model served as another's ``SERVED:ADAPTER``;
    one line per problem.

    :param served: every model's served name -> the model's key.
    """
    problems: list[str] = []
    adapters: dict[str, str] = {}  # adapter name -> the model it is an adapter of
    for name, model in models.items():
        for adapter, source in model.adapters.items():
            where = f"models.{name}.adapters.{adapter}"
            if ":" in adapter:
                problems.append(
                    f"{where}: no ':' in an adapter's name (clients may ask for SERVED:ADAPTER, "
                    f"so {adapter!r} would be ambiguous)"
                )
            elif not NAME.match(adapter):
                problems.append(f"{where}: {BAD_NAME}")
            if adapter in served:
                problems.append(
                    f"{where}: {adapter!r} is already the served name of models.{served[adapter]}; "
                    "an adapter is asked for by its name, as a model is"
                )
            elif adapter in adapters:
                problems.append(
                    f"{where}: {adapter!r} is already an adapter of models.{adapters[adapter]}; "
                    "an adapter's name is unique across every model"
                )
            else:
                adapters[adapter] = name
            source_problem = check_source(source) if isinstance(source, str) else "expected a string"
            if source_problem is not None:
                problems.append(f"{where}: {source_problem}")
    for served_name, key in served.items():  # a served name spelled as another model's SERVED:ADAPTER
        base, colon, adapter = served_name.rpartition(":")
        owner = served.get(base)
        if colon and owner is not None and adapter in models[owner].adapters:
            problems.append(
                f"models.{key}.served_name: {served_name!r} is how clients ask for adapter {adapter} of "
                f"models.{owner} (SERVED:ADAPTER); serve this model under another name"
            )
    return problems


def check_lora_engine(
    where: str, model: Model, profile: Profile | None, engines: Mapping[str, Engine]
) -> list[str]:
    """A model with ``adapters:`` whose profile's engine serves no LoRA adapters, or loads them only at start
    (llama.cpp) and would start with more than the profile's ``max_adapters`` (an unknown engine is
    reported on its profile, or left to the server)."""
    engine = engines.get(profile.engine) if profile is not None else None
    if profile is None or engine is None:
        return []
    key = where.split(".", 1)[1]
    if engine.serves_lora and engine.lora_at_start:
        if len(model.adapters) <= profile.max_adapters:
            return []
        runtime = sorted(e for e, p in engines.items() if p.serves_lora and not p.lora_at_start)
        return [
            f"{where}.adapters: model {key!r} has {len(model.adapters)} LoRA adapters but its profile "
            f"{model.profile!r} keeps at most {profile.max_adapters} loaded (max_adapters), and engine "
            f"{profile.engine!r} loads every adapter of the model at start; set "
            f"profiles.{model.profile}.max_adapters to at least {len(model.adapters)}, or serve them on an "
            f"engine that loads adapters on demand ({', '.join(runtime) or 'none installed'})"
        ]
    if engine.serves_lora:
        return []
    lora = sorted(e for e, plugin in engines.items() if plugin.serves_lora)
    return [
        f"{where}.adapters: model {key!r} has LoRA adapters but its profile "
        f"{model.profile!r} runs engine {profile.engine!r}, which serves none (engines with LoRA: "
        f"{', '.join(lora) or 'none installed'})"
    ]


def with_adapters_at_start(profiles: dict[str, Profile], engines: Mapping[str, Engine]) -> dict[str, Profile]:
    """Each profile with ``adapters_at_start`` as its engine's plugin says (:attr:`Engine.lora_at_start`:
    llama.cpp loads adapters only at start). Called by :func:`llmgw.catalog.parse_catalog` once the catalog
    is valid; a profile whose engine no plugin here provides keeps False (a catalog checked before it is
    sent: the server parses it again)."""
    out = {}
    for name, profile in profiles.items():
        engine = engines.get(profile.engine)
        at_start = engine is not None and engine.serves_lora and engine.lora_at_start
        out[name] = attrs.evolve(profile, adapters_at_start=at_start) if at_start else profile
    return out


def not_catalog_keys(data: Mapping[str, Any], kinds: Mapping[str, type]) -> list[str]:
    """One ``unknown key`` line per entry's key that names a field llmgw fills itself
    (``metadata={"catalog_key": False}``, such as a profile's ``adapters_at_start``).

    Called by :func:`llmgw.catalog.parse_catalog` on the raw YAML ``data``; ``kinds`` maps each section to
    the record type of its entries.
    """
    problems = []
    for section, kind in kinds.items():
        raw = data.get(section)
        derived = [a.name for a in attrs.fields(kind) if not a.metadata.get("catalog_key", True)]
        if not isinstance(raw, Mapping) or not derived:
            continue
        allowed = ", ".join(a.name for a in attrs.fields(kind) if a.name not in derived)
        for name, entry in raw.items():
            if isinstance(entry, Mapping):
                problems.extend(
                    f"{section}.{name}.{key}: unknown key (expected one of: {allowed})"
                    for key in derived
                    if key in entry
                )
    return problems
