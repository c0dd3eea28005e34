"""The sources a catalog asks the fleet to hold: each model's weights, and its LoRA adapters'.

An adapter's source is spelled as a model's (``hf://``, ``seed:///``, a path) and
travels as weights do: agents report on it, a seed of it is published, an
``hf://`` one is downloaded once per fleet and copied node to node, every copy
verified by its manifest.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw.models import Catalog
from llmgw.weights._sources import is_distributable

__all__ = ["adapter_sources", "catalog_sources"]


def catalog_sources(catalog: Catalog) -> tuple[str, ...]:
    """Every source of ``catalog``, models' and adapters', sorted, each once.

    Called by the server for the sources agents report on (``SyncReply.check_sources``),
    which is also the list of seeds each agent publishes when it holds one.
    """
    sources = {m.source for m in catalog.models.values()}
    sources.update(s for m in catalog.models.values() for s in m.adapters.values())
    return tuple(sorted(sources))


def adapter_sources(catalog: Catalog, models: Iterable[str]) -> tuple[str, ...]:
    """The distributable sources of the adapters of ``models`` (names in ``catalog``), sorted, each once.

    Called by the server as it answers a node's sync, with the models of the
    shards the node runs: those adapters are staged there ahead of any load
    (``SyncReply.stage_sources``), so a first request for one waits for the
    engine's load only. A plain path is on the node already, or never is.
    """
    out: set[str] = set()
    for name in set(models):
        model = catalog.models.get(name)
        if model is not None:
            out.update(s for s in model.adapters.values() if is_distributable(s))
    return tuple(sorted(out))
