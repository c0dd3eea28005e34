"""Reasons an operator can act on: why a replica has no place, why a node is never chosen."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llmgw.models import Catalog, Model, Profile
from llmgw.scheduler._disk import Need, format_bytes, needed_bytes
from llmgw.scheduler._records import NodeView
from llmgw.scheduler._state import NodeState
from llmgw.weights import is_distributable

__all__ = ["explain_unplaced", "node_warnings"]

#: How many node ids a reason names before it says "and N more".
SHOWN = 5


def explain_unplaced(
    nodes: Sequence[NodeState],
    profile: Profile,
    source: str,
    avoid: frozenset[str] = frozenset(),
    weights: tuple[str, int | None, float] | None = None,
    needs: tuple[Need, ...] = (),
    entry: Model | None = None,
) -> str:
    """Say why no set of ``nodes`` can take one replica of ``profile`` now.

    Called once per model that has a replica left without a place, with the
    run's node states at that moment. Every node is counted under the first
    thing that rules it out; nodes that would fit are counted per fabric for a
    multi-node profile, so the closest miss shows. ``weights`` is (model,
    size of its copy in bytes or None, headroom): a node that cannot take the
    copy is named with its free bytes and the bytes it could evict. ``needs``
    (:func:`~llmgw.scheduler._disk.needs_of`): the weights and the LoRA adapters'
    sources the replica takes, checked together when given. ``entry``: the model's
    catalog entry, whose files on a node's own disk (:meth:`NodeState.lacks`) are checked when given.

    :returns: one line, e.g. ``needs 2 nodes with 8 free GPUs on one fabric;
        fabric ib-a has 1 such node (node-1), fabric ib-b has 0; 3 nodes lack
        engine vllm: node-4, node-5, node-6``.
    """
    wanted, gpus, memory = profile.nodes, profile.gpus_per_node, profile.min_gpu_memory_mib
    ports = 1 if wanted == 1 else 2
    with_memory = f" with at least {memory} MiB" if memory else ""
    free_gpus = f" with {gpus} free GPU{_s(gpus)}{with_memory}" if gpus else ""
    if wanted == 1:
        head = f"needs 1 node{free_gpus}"
    else:
        head = f"needs {wanted} nodes{free_gpus} on one fabric"
    if not nodes:
        return f"{head}; no node has registered"

    model, size, headroom = weights if weights is not None else ("", None, 0.0)
    ruled_out: dict[tuple[str, str], list[str]] = {}
    busy: list[tuple[int, str]] = []
    by_fabric: dict[str, list[str]] = {name: [] for node in nodes for name in node.fabrics}
    islands: list[str] = []

    def rule_out(singular: str, plural: str, label: str) -> None:
        ruled_out.setdefault((singular, plural), []).append(label)

    for node in nodes:
        if node.id in avoid:
            rule_out("already runs the replica being moved", "already run the replica being moved", node.id)
        elif node.state != "ready":
            rule_out(f"is {node.state}", f"are {node.state}", node.id)
        elif profile.engine not in node.engines:
            rule_out(f"lacks engine {profile.engine}", f"lack engine {profile.engine}", node.id)
        elif (missing := _lacks(node, entry, profile, source)) is not None:
            rule_out(f"lacks {missing}", f"lack {missing}", node.id)
        elif len(node.gpus_with(memory)) < gpus:
            problem = f"; {node.view.facts.problems[0]}" if node.view.facts.problems else ""
            rule_out(
                f"has fewer than {gpus} GPUs{with_memory}",
                f"have fewer than {gpus} GPUs{with_memory}",
                f"{node.id} ({len(node.gpus_with(memory))}{problem})",
            )
        elif len(node.free_gpus(memory)) < gpus:
            busy.append((len(node.free_gpus(memory)), node.id))
        elif node.free_ports < ports:
            rule_out(
                "has no free port left in its range",
                "have no free port left in their range",
                f"{node.id} ({node.low}-{node.high})",
            )
        elif not (node.disk.fits_all(needs, headroom) if needs else node.disk.fits(source, size, headroom)):
            adapters = needed_bytes(needs[1:])
            lora = f" and {format_bytes(adapters)} of LoRA adapters" if adapters else ""
            what = f"{model}'s {format_bytes(size or 0)} of weights{lora} (+{headroom:.0%} headroom)"
            unused = node.disk.unused_bytes
            evictable = f", {format_bytes(unused)} in unused copies" if unused else ""
            if node.disk.reserved:
                evictable += f", {format_bytes(node.disk.reserved)} promised to copies under way"
            rule_out(
                f"has no disk room for {what}",
                f"have no disk room for {what}",
                f"{node.id} ({format_bytes(node.disk.free or 0)} free{evictable})",
            )
        elif node.fabrics:
            for name in node.fabrics:
                by_fabric[name].append(node.id)
        else:
            islands.append(node.id)

    parts = [head]
    if wanted > 1:
        if by_fabric:
            parts.append(
                ", ".join(
                    f"fabric {name} has {len(ids)}{' such node' + _s(len(ids)) if ids else ''}"
                    + (f" ({_names(ids)})" if ids else "")
                    for name, ids in sorted(by_fabric.items())
                )
            )
        else:
            parts.append("no node is on a fabric")
        if islands:
            islands_part = _count(len(islands), "is an island", "are islands")
            parts.append(f"{islands_part} (no fabric): {_names(islands)}")
    if busy:
        busy.sort(key=lambda item: (-item[0], item[1]))
        labels = [f"{node_id} ({free} free)" for free, node_id in busy]
        parts.append(
            f"{_count(len(busy), f'has fewer than {gpus} free GPUs', f'have fewer than {gpus} free GPUs')}"
            f"{with_memory}: {_names(labels)}"
        )
    for (singular, plural), labels in ruled_out.items():
        parts.append(f"{_count(len(labels), singular, plural)}: {_names(labels)}")
    return "; ".join(parts)


def node_warnings(node: NodeView, catalog: Catalog) -> tuple[str, ...]:
    """Say what keeps ``node`` from running models of ``catalog``, for ``ctl nodes``.

    Called by the server when it lists nodes. Missing model sources are named
    only for models whose engine the node has, so a node built for one engine
    is not flagged for every other model.

    :returns: the node's discovery problems, then one line per missing engine
        (``engine vllm not installed (models a, b)``) and per missing model
        source; empty when nothing is missing.
    """
    facts = node.facts
    engine_users: dict[str, list[str]] = {}
    source_users: dict[str, list[str]] = {}
    adapter_users: dict[str, list[str]] = {}
    for name, model in sorted(catalog.models.items()):
        profile = catalog.profiles.get(model.profile)
        if profile is None or model.replicas == 0:
            continue
        if profile.engine not in facts.engines:
            engine_users.setdefault(profile.engine, []).append(name)
        elif model.source not in facts.model_sources and not is_distributable(model.source):
            source_users.setdefault(model.source, []).append(name)
        elif profile.adapters_at_start:  # its engine loads adapters at start: they must be here too
            for adapter in model.adapters.values():
                if adapter not in facts.model_sources and not is_distributable(adapter):
                    adapter_users.setdefault(adapter, []).append(name)
    lines = list(facts.problems)
    for engine, users in sorted(engine_users.items()):
        lines.append(f"engine {engine} not installed (model{_s(len(users))} {', '.join(users)})")
    for source, users in sorted(source_users.items()):
        lines.append(f"model source {source} missing (model{_s(len(users))} {', '.join(users)})")
    for source, users in sorted(adapter_users.items()):
        lines.append(
            f"LoRA adapter {source} missing (model{_s(len(users))} {', '.join(users)}, whose engine loads "
            "its adapters at start)"
        )
    return tuple(lines)


def _lacks(node: NodeState, model: Model | None, profile: Profile, source: str) -> str | None:
    """What ``node`` lacks of a replica's files on its own disk (:meth:`NodeState.lacks`), from ``source``
    alone when the model is not given."""
    if model is not None:
        return node.lacks(model, profile)
    return None if source in node.sources or is_distributable(source) else f"model source {source}"


def _names(labels: Iterable[str]) -> str:
    labels = list(labels)
    shown = ", ".join(labels[:SHOWN])
    if len(labels) > SHOWN:
        return f"{shown} and {len(labels) - SHOWN} more"
    return shown


def _count(count: int, singular: str, plural: str) -> str:
    return f"1 node {singular}" if count == 1 else f"{count} nodes {plural}"


def _s(count: int) -> str:
    return "" if count == 1 else "s"
