"""The documents of model copies: agents ask the server for a manifest and who holds it."""

from __future__ import annotations

import attrs

from llmgw.models import bounded
from llmgw.weights import Manifest

__all__ = ["HubClaim", "HubLease", "PeerHolder", "WeightsEvent", "WeightsInfo"]


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
