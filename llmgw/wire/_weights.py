"""The documents of model copies: agents ask the server for a manifest and who holds it."""

from __future__ import annotations

import attrs

from llmgw.models import bounded
from llmgw.weights import Manifest

__all__ = [
    "PeerHolder",
    "WeightsEvent",
    "WeightsInfo",
    "HubClaim",
    "HubLease",
    "StagingProgress",
    "CopyProgress",
    "ModelStatus",
    "ModelList",
]


@attrs.frozen
class PeerHolder:
    """A node with (some of) a copy: where its agent serves model files."""

    node: str
    address: str
    port: int
    #: every file verified there; a partial copy serves only the files it verified
    complete: bool = False


@attrs.frozen
class WeightsInfo:
    """``GET /v1/agent/weights?source=S``: the source's manifest (None until a holder made it) and holders."""

    source: str
    manifest: Manifest | None = None
    holders: tuple[PeerHolder, ...] = attrs.field(converter=tuple, default=())


@attrs.frozen
class WeightsEvent:
    """``POST /v1/agent/weights/events``: something an operator should see about a copy (a bad file)."""

    source: str = attrs.field(validator=bounded())
    message: str = attrs.field(validator=bounded())


@attrs.frozen
class HubClaim:
    """``POST /v1/agent/weights/hub``: a node asks to be (or stay) the node downloading ``source``."""

    source: str = attrs.field(validator=bounded())
    #: how its download goes (a Hub error while it backs off), shown to the nodes waiting for it
    status: str = attrs.field(default="", validator=bounded())


@attrs.frozen
class HubLease:
    """The answer: which node downloads ``source`` from the Hub (one per fleet), and how it goes."""

    source: str
    node: str
    #: whether the asking node is that node
    granted: bool = False
    status: str = ""


@attrs.frozen
class StagingProgress:
    """How far a copy of weights got: reported per staging shard, summed per replica for ``ctl replicas``."""

    bytes_present: int
    bytes_total: int
    #: bytes per second over the copy so far (0: not measured yet)
    rate: float = 0.0

    @property
    def percent(self) -> int:
        """Whole percent of the bytes present (100 for an empty model)."""
        return 100 * self.bytes_present // self.bytes_total if self.bytes_total else 100

    @property
    def eta(self) -> float | None:
        """Seconds left at the current rate; None while the rate is not known."""
        if self.rate <= 0:
            return None
        return max(0, self.bytes_total - self.bytes_present) / self.rate


@attrs.frozen
class CopyProgress:
    """A copy of a model being made on a node (``ctl models``' copies in progress)."""

    node: str
    bytes_present: int
    bytes_total: int


@attrs.frozen
class ModelStatus:
    """One catalog model's weights, or one of its LoRA adapters', for ``ctl models``: where they come from,
    how big, who holds them."""

    name: str
    source: str
    #: the revision the source is pinned to (a hub commit), when it has one
    revision: str | None = None
    #: bytes of a complete copy and its manifest digest; None until a holder made the manifest
    size: int | None = None
    digest: str | None = None
    #: nodes with a complete, verified copy (or the seed, or the path for a plain source)
    holders: tuple[str, ...] = attrs.field(converter=tuple, default=())
    copying: tuple[CopyProgress, ...] = attrs.field(converter=tuple, default=())
    #: nodes whose seed folder holds other files than the manifest: no holders of it
    differing: tuple[str, ...] = attrs.field(converter=tuple, default=())
    #: whether llmgw copies it between nodes (seed:// and the like); False: it must be on the node already
    distributable: bool = False
    #: for a LoRA adapter (``name`` is the adapter's), the model it is an adapter of; None for a model.
    #: An adapter's entry follows its model's
    adapter_of: str | None = None


@attrs.frozen
class ModelList:
    """``GET /v1/admin/models``: every catalog model's weights."""

    models: tuple[ModelStatus, ...] = attrs.field(converter=tuple, default=())
