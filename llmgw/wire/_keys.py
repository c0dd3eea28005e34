"""The admin API's API-key documents: ``/v1/admin/keys``.

Re-exported by :mod:`llmgw.wire`; read and written through its one converter.
"""

from __future__ import annotations

import attrs

from llmgw.models import bounded

__all__ = ["ApiKey", "KeyList", "CreateKey", "CreatedKey", "RevokedKey"]


@attrs.frozen
class ApiKey:
    """An API key as listed: its name and dates (the secret is never stored)."""

    name: str
    created_at: float
    revoked_at: float | None = None


@attrs.frozen
class KeyList:
    """``GET /v1/admin/keys``."""

    keys: tuple[ApiKey, ...] = ()


@attrs.frozen
class CreateKey:
    """``POST /v1/admin/keys``."""

    name: str = attrs.field(validator=bounded(text=253))


@attrs.frozen
class CreatedKey:
    """The answer to :class:`CreateKey`: the secret, shown this once."""

    name: str
    secret: str


@attrs.frozen
class RevokedKey:
    """The answer to ``DELETE /v1/admin/keys/NAME``."""

    name: str
    revoked_at: float | None
