"""The admin API's API-key documents: ``/v1/admin/keys``, and the limits a key carries.

Re-exported by :mod:`llmgw.wire`; read and written through its one converter.
A key's :class:`KeyLimits` travel to the gateways in the routes feed
(:class:`llmgw.wire.RouteTable`), which enforce them (:mod:`llmgw.gateway.admission`).
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from llmgw.models import bounded
from llmgw.wire._hooks import shown

__all__ = [
    "LIMIT_FIELDS", "MAX_LIMIT", "Priority", "BudgetPeriod", "KeyLimits", "ApiKey", "KeyList", "CreateKey",
    "CreatedKey", "UpdateKey", "RevokedKey", "structure_choice", "ModelUsage", "KeyUsage", "UsageList",
]  # fmt: skip

#: the largest rpm, tpm or concurrency a key may be given (more is a typo, not a limit)
MAX_LIMIT = 10**12
#: the limits :attr:`UpdateKey.unlimited` may lift, by field name (``ctl keys update --rpm unlimited``)
LIMIT_FIELDS = ("rpm", "tpm", "concurrency", "models", "budget")


class Priority(enum.StrEnum):
    """A key's priority class: which requests go first when a model's replicas are busy."""

    CRITICAL = "critical"
    STANDARD = "standard"
    BATCH = "batch"


class BudgetPeriod(enum.StrEnum):
    """The period a key's token budget is counted over: a UTC calendar day or month."""

    DAY = "day"
    MONTH = "month"


def _count(_: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and not 1 <= value <= MAX_LIMIT:
        raise ValueError(f"{attribute.name}: expected a positive integer (at most {MAX_LIMIT}), got {value}")


def _models(_: Any, attribute: attrs.Attribute, value: tuple[str, ...] | None) -> None:
    if value is None:
        return
    if not value:
        raise ValueError(f"{attribute.name}: expected at least one model name (or no limit on models)")
    for name in value:
        if not name or len(name) > 253 or not name.isprintable() or "," in name:
            expected = "expected model names of 1-253 printable characters, without ','"
            raise ValueError(f"{attribute.name}: {expected}, got {name!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"{attribute.name}: a model is named twice in {list(value)}")


def structure_choice(value: Any, kind: type[enum.StrEnum]) -> Any:
    """The converter's hook for a key's enums (:class:`Priority`, :class:`BudgetPeriod`): an error listing
    the choices for anything else."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(p.value for p in kind)
        raise ValueError(f"expected one of {choices}, got {shown(value)}") from None


@attrs.frozen
class KeyLimits:
    """What one API key may do; every limit None means unlimited (the default: keys made before limits).

    Rates are per minute, counted by each gateway from the requests it admits and the tokens the
    engines' ``usage`` reports (prompt + completion).
    """

    #: requests per minute
    rpm: int | None = attrs.field(default=None, validator=_count)
    #: prompt + completion tokens per minute
    tpm: int | None = attrs.field(default=None, validator=_count)
    #: requests in flight at once
    concurrency: int | None = attrs.field(default=None, validator=_count)
    #: the served model names it may use; None: every model
    models: tuple[str, ...] | None = attrs.field(
        default=None, converter=lambda m: None if m is None else tuple(m), validator=[bounded(), _models]
    )
    priority: Priority = Priority.STANDARD
    #: prompt + completion tokens per :attr:`budget_period`, for the whole fleet
    budget: int | None = attrs.field(default=None, validator=_count)
    #: the period the budget is counted over (UTC)
    budget_period: BudgetPeriod = BudgetPeriod.DAY

    def is_default(self) -> bool:
        """Whether the key is unlimited with the standard priority (as every key made before limits)."""
        return self == _DEFAULT

    def summary(self) -> str:
        """One line for people: ``rpm 3, tpm -, concurrency -, models a,b, priority batch``."""
        models = ",".join(self.models) if self.models is not None else "*"
        parts = [
            f"rpm {_shown(self.rpm)}",
            f"tpm {_shown(self.tpm)}",
            f"concurrency {_shown(self.concurrency)}",
            f"budget {self.budget_shown()}",
        ]
        return ", ".join([*parts, f"models {models}", f"priority {self.priority}"])

    def budget_shown(self) -> str:
        """The budget for people: ``1000000/day``, or ``-`` without one."""
        return "-" if self.budget is None else f"{self.budget}/{self.budget_period}"


_DEFAULT = KeyLimits()


def _shown(value: int | None) -> str:
    return "-" if value is None else str(value)


@attrs.frozen
class ApiKey:
    """An API key as listed: its name, dates and limits (the secret is never stored)."""

    name: str
    created_at: float
    revoked_at: float | None = None
    limits: KeyLimits = KeyLimits()


@attrs.frozen
class KeyList:
    """``GET /v1/admin/keys``."""

    keys: tuple[ApiKey, ...] = ()


@attrs.frozen
class CreateKey:
    """``POST /v1/admin/keys``."""

    name: str = attrs.field(validator=bounded(text=253))
    limits: KeyLimits = KeyLimits()


@attrs.frozen
class CreatedKey:
    """The answer to :class:`CreateKey`: the secret, shown this once."""

    name: str
    secret: str
    limits: KeyLimits = KeyLimits()


def _lifted(_: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    for name in value:
        if name not in LIMIT_FIELDS:
            raise ValueError(f"{attribute.name}: expected some of {', '.join(LIMIT_FIELDS)}, got {name!r}")


@attrs.frozen
class UpdateKey:
    """``PATCH /v1/admin/keys/NAME``: the limits to change; a field left None stays as it is.

    A limit named in :attr:`unlimited` is lifted; naming it there and giving it a value is refused.
    """

    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None
    models: tuple[str, ...] | None = None
    priority: Priority | None = None
    budget: int | None = None
    budget_period: BudgetPeriod | None = None
    #: limits to lift (some of :data:`LIMIT_FIELDS`)
    unlimited: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_lifted)

    def applied(self, limits: KeyLimits) -> KeyLimits:
        """``limits`` with this update made; called by the server before it stores anything.

        :raises ValueError: naming the field: a bad value, or a limit both given and lifted.
        """
        changes: dict[str, Any] = {name: None for name in self.unlimited}
        for name in (*LIMIT_FIELDS, "priority", "budget_period"):
            value = getattr(self, name)
            if value is None:
                continue
            if name in changes:
                raise ValueError(f"{name}: given a value and lifted (unlimited) at once; choose one")
            changes[name] = value
        return attrs.evolve(limits, **changes)


@attrs.frozen
class RevokedKey:
    """The answer to ``DELETE /v1/admin/keys/NAME``."""

    name: str
    revoked_at: float | None


@attrs.frozen
class ModelUsage:
    """One key's use of one model in a period: requests and tokens (from the engines' ``usage``)."""

    model: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@attrs.frozen
class KeyUsage:
    """One key's use this period (its budget's period; a day for a key without budget), against its limits."""

    name: str
    limits: KeyLimits
    period: BudgetPeriod
    #: UTC day the period began (``2026-12-01``) and when it ends (UNIX time): the budget resets then
    since: str
    resets_at: float
    #: prompt + completion tokens of every model this period
    tokens: int = 0
    models: tuple[ModelUsage, ...] = ()


@attrs.frozen
class UsageList:
    """``GET /v1/admin/keys/usage[?name=NAME]``: each key's use this period."""

    keys: tuple[KeyUsage, ...] = ()
