"""What the server shows of LoRA adapters: the routes feed's entries, each node's desired adapters, the
LoRA part of a launch, and ``ctl adapters``."""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.engine import Engine
from llmgw.models import LoraSpec, Model, Profile
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import ReplicaRecord, ReplicaState
from llmgw.wire import (
    AdapterList,
    AdapterRoutes,
    AdapterState,
    AdapterStatus,
    DesiredAdapters,
    ObservedAdapter,
)

__all__ = ["adapter_routes", "base_request_fields", "desired_adapters", "lora_spec", "adapter_list"]


def lora_spec(model: Model, profile: Profile) -> LoraSpec | None:
    """The LoRA part of a shard's launch: the profile's slots and rank when the model has adapters, else
    None; on an engine that loads adapters only at start (``profile.adapters_at_start``), every adapter of
    the model with its source, in catalog order (the agent stages each one and gives the engine its path).
    Called for each desired shard the server builds."""
    if not model.adapters:
        return None
    at_start = tuple(model.adapters.items()) if profile.adapters_at_start else ()
    return LoraSpec(max_loaded=profile.max_adapters, max_rank=profile.max_adapter_rank, at_start=at_start)


def base_request_fields(
    state: ClusterState, record: ReplicaRecord, engines: Mapping[str, Engine] | None
) -> dict[str, object]:
    """The fields a gateway sets in a base-model request to ready replica ``record`` so that none of its
    adapters answers it (:meth:`llmgw.engine.Engine.lora_base_request_fields`: llama.cpp's adapters at
    scale 0); empty for a model without adapters or an engine that needs none. Called for each ready
    replica as the routes feed is built."""
    launch = state.launch_of(record)
    engine = (engines or {}).get(launch.profile.engine) if launch is not None else None
    if launch is None or engine is None or not launch.model.adapters:
        return {}
    served = launch.model.served_name or record.placement.model
    return dict(engine.lora_base_request_fields(served, tuple(launch.model.adapters)))


def adapter_routes(state: ClusterState, engines: Mapping[str, Engine] | None) -> dict[str, AdapterRoutes]:
    """Adapter name -> its base model's served name, the ready replicas that have it loaded (with the
    request fields their engine wants), and its last failure. Called for every routes feed answer."""
    book = state.adapters
    loaded_on: dict[tuple[str, str], dict[str, dict]] = {}
    for replica, names in book.routed.items():
        record = state.replicas.get(replica)
        if record is None or record.state != ReplicaState.READY:
            continue
        launch = state.launch_of(record)
        if launch is None:
            continue
        served = launch.model.served_name or record.placement.model
        engine = (engines or {}).get(launch.profile.engine)
        known = tuple(launch.model.adapters)
        for name in names:
            fields = (
                engine.lora_request_fields(name, served, known) if engine is not None else {"model": name}
            )
            loaded_on.setdefault((record.placement.model, name), {})[replica] = dict(fields)
    out: dict[str, AdapterRoutes] = {}
    for model_name, model in sorted(state.catalog.models.items()):
        served = state.catalog.served_name(model_name)
        for name in model.adapters:
            use = book.uses.get((model_name, name))
            failure = use.failure if use is not None else None
            out[name] = AdapterRoutes(served, loaded_on.get((model_name, name), {}), failure)
    return out


def desired_adapters(state: ClusterState, node_id: str) -> tuple[DesiredAdapters, ...]:
    """The adapters each replica whose rank 0 runs on ``node_id`` should keep loaded; called for each sync
    answer. A replica that should hold none is not listed: its agent unloads what it holds."""
    out = []
    for replica, (attempt, adapters) in sorted(state.adapters.desired.items()):
        record = state.replicas.get(replica)
        if record is None or record.attempt != attempt or record.placement.rank0.node_id != node_id:
            continue
        out.append(DesiredAdapters(replica, attempt, dict(adapters)))
    return tuple(out)


def adapter_list(state: ClusterState, model: str | None = None) -> AdapterList:
    """``GET /v1/admin/adapters[?model=M]``: every adapter of the catalog (of model ``M``, by catalog or
    served name), where it is loaded or loading, its use and its last failure."""
    book = state.adapters
    entries = []
    for model_name, catalog_model in sorted(state.catalog.models.items()):
        served = state.catalog.served_name(model_name)
        if model is not None and model not in (model_name, served):
            continue
        for name, source in sorted(catalog_model.adapters.items()):
            loaded = sorted(r for r, names in book.routed.items() if name in names)
            loading = sorted(
                r
                for r, (_attempt, held) in book.desired.items()
                if name in held and r not in loaded and _not_failed(book.observed.get(r, {}).get(name))
            )
            use = book.uses.get((model_name, name))
            entries.append(
                AdapterStatus(
                    model=served,
                    adapter=name,
                    source=source,
                    loaded=tuple(loaded),
                    loading=tuple(loading),
                    hits=use.hits if use else 0,
                    misses=use.misses if use else 0,
                    loads=use.loads if use else 0,
                    failures=use.failures if use else 0,
                    last_use=use.last_use if use else None,
                    failure=use.failure if use else None,
                )
            )
    return AdapterList(tuple(entries))


def _not_failed(seen: ObservedAdapter | None) -> bool:
    return seen is None or seen.state != AdapterState.FAILED
