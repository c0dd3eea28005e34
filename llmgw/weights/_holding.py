"""Who holds a distributable source: a node whose complete copy has the fleet's manifest's digest.

The fleet's manifest of a source is the first complete one a node sent (see
:mod:`llmgw.server.http.weights`). A node reporting its seed folder with other
files is no holder of it: the scheduler does not count it as holding the
files, peers do not fetch from it, and ``ctl models`` names it as differing.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from llmgw.models import NodeFacts
from llmgw.weights._manifest import Manifest

__all__ = ["agreeing_facts", "differing_files", "differs", "holds"]


def holds(facts: NodeFacts, source: str, manifest: Manifest | None) -> bool:
    """Whether the node of ``facts`` holds ``source``; called for ``ctl models`` and each schedule.

    Before any manifest is stored, what the agent reported (its folder is
    there, with files); after, only a complete copy (or seed) with the
    manifest's digest: a seed folder the agent has not hashed yet is no
    holder until it has (its files may differ, or be partial).
    """
    if manifest is None:
        return source in facts.model_sources
    return any(c.source == source and c.complete and c.digest == manifest.digest for c in facts.model_copies)


def differs(facts: NodeFacts, source: str, manifest: Manifest | None) -> bool:
    """Whether the node of ``facts`` has a seed folder of ``source`` with other files than ``manifest``."""
    return manifest is not None and any(
        c.source == source and c.seed and c.digest != manifest.digest for c in facts.model_copies
    )


def agreeing_facts(facts: NodeFacts, manifests: Mapping[str, Manifest]) -> NodeFacts:
    """``facts`` as the scheduler should read them: sources the node does not hold as the fleet does left out.

    A distributable source with a stored manifest stays in ``model_sources``
    only when the node :func:`holds` it; seeds with other files are dropped
    from ``model_copies``. Called for each node at each schedule.
    """
    sources = tuple(s for s in facts.model_sources if holds(facts, s, manifests.get(s)))
    copies = tuple(
        c for c in facts.model_copies
        if not (c.seed and c.source in manifests and c.digest != manifests[c.source].digest)
    )  # fmt: skip
    if len(sources) == len(facts.model_sources) and len(copies) == len(facts.model_copies):
        return facts
    return attrs.evolve(facts, model_sources=sources, model_copies=copies)


def differing_files(fleet: Manifest, other: Manifest) -> list[str]:
    """Each path whose file in ``other`` is not the one of ``fleet``, with why; sorted by path."""
    mine = {f.path: f for f in other.files}
    out = []
    for path in sorted({f.path for f in fleet.files} | mine.keys()):
        want, have = fleet.file(path), mine.get(path)
        if have is None:
            out.append(f"{path} (missing)")
        elif want is None:
            out.append(f"{path} (not in the manifest)")
        elif (want.size, want.sha256) != (have.size, have.sha256):
            out.append(f"{path} (other content)")
    return out
