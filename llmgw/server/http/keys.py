"""The admin API's API keys: list, create (the secret shown once), change limits, revoke, their usage
this period; the routes feed hands them out.

Mixed into :class:`llmgw.server.http.api.ServerApp`, which routes ``/v1/admin/keys*`` to it.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from llmgw.net.server import Request, Response
from llmgw.pki import Identity
from llmgw.server.http.replies import Refused, answer
from llmgw.server.persist.cluster import (
    add_api_key,
    key_usage_by_model,
    load_api_keys,
    revoke_api_key,
    set_api_key_limits,
)
from llmgw.server.persist.sqlite import Store
from llmgw.server.reconciler import Reconciler
from llmgw.server.state.allowances import Lender
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import KeyRecord
from llmgw.tenancy.periods import period_bounds
from llmgw.wire import (
    ApiKey,
    BudgetPeriod,
    CreatedKey,
    CreateKey,
    KeyLimits,
    KeyList,
    KeyUsage,
    ModelUsage,
    RevokedKey,
    UpdateKey,
    UsageList,
    from_json,
)

__all__ = ["KEY_NAME_RULE", "KeysEndpoints", "active_keys"]

#: what an API key name may be; ``ctl keys create --help`` says the same
KEY_NAME_RULE = "1-63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit"
_KEY_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


def active_keys(keys: dict[str, KeyRecord]) -> tuple[dict[str, str], dict[str, KeyLimits]]:
    """What the routes feed hands gateways: (sha256 -> name, name -> limits) of the keys not revoked.

    Only keys with limits are in the second mapping. Called for every routes answer (leader and standby).
    """
    live = {name: record for name, record in keys.items() if record.revoked_at is None}
    hashes = {record.digest: name for name, record in live.items()}
    limits = {name: record.limits for name, record in live.items() if not record.limits.is_default()}
    return hashes, limits


class KeysEndpoints:
    """Handlers for ``/v1/admin/keys*``, and the keys in memory the routes feed reads."""

    cluster: ClusterState
    store: Store
    clock: Callable[[], float]
    reconciler: Reconciler
    _lock: trio.Lock
    #: API key name -> its record
    keys: dict[str, KeyRecord]
    read_only: bool
    _usage_lock: trio.Lock
    #: the fleet's buckets of the rate-limited keys
    lender: Lender
    #: write the usage the gateways reported (:class:`llmgw.server.http.routes.RoutesEndpoints`)
    flush_usage: Callable[[float], Awaitable[None]]

    async def load_keys(self) -> None:
        """Read the API keys from the store; called once, when this server begins to lead.

        The fleet's buckets of these keys start empty now
        (:meth:`~llmgw.server.state.allowances.Lender.carry`): a leader before this one may have lent what
        they held.
        """
        self.keys = await self.store.run(load_api_keys)
        self.lender.carry(self.keys, self.clock())

    async def _list_keys(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        keys = tuple(
            ApiKey(name, record.created_at, record.revoked_at, record.limits)
            for name, record in sorted(self.keys.items())
        )
        return answer(KeyList(keys))

    async def _create_key(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        created = from_json(request.json(), CreateKey)
        name, limits = created.name, created.limits
        if not _KEY_NAME.fullmatch(name):
            raise Refused(400, f"name: expected {KEY_NAME_RULE}, got {name!r}")
        secret = "llmgw-" + secrets.token_urlsafe(32)
        digest = hashlib.sha256(secret.encode()).hexdigest()
        now = self.clock()
        async with self._lock:
            if name in self.keys:
                state = "revoked" if self.keys[name].revoked_at is not None else "in use"
                raise Refused(409, f"an API key named {name!r} exists ({state}); choose another name")
            await self.store.write(lambda conn: add_api_key(conn, name, digest, now, identity.name, limits))
            self.keys[name] = KeyRecord(digest, now, None, limits)
            self._routes_changed()
        return answer(CreatedKey(name, secret, limits), 201)

    async def _update_key(self, request: Request, identity: Identity, params: dict[str, str]) -> Response:
        """``PATCH /v1/admin/keys/NAME``: change some limits; a bad value changes nothing (400 naming it)."""
        name = params["name"]
        update = from_json(request.json(), UpdateKey)
        now = self.clock()
        async with self._lock:
            record = self._known(name)
            if record.revoked_at is not None:
                raise Refused(409, f"API key {name!r} is revoked; its limits can no longer change")
            try:
                limits = update.applied(record.limits)
            except ValueError as exc:
                raise Refused(400, str(exc)) from None
            if limits != record.limits:
                await self.store.write(
                    lambda conn: set_api_key_limits(conn, name, limits, now, identity.name)
                )
                self.keys[name] = attrs.evolve(record, limits=limits)
                self._routes_changed()
        return answer(ApiKey(name, record.created_at, record.revoked_at, limits))

    async def _revoke_key(self, request: Request, identity: Identity, params: dict[str, str]) -> Response:
        name = params["name"]
        now = self.clock()
        async with self._lock:
            record = self._known(name)
            if record.revoked_at is None:
                await self.store.write(lambda conn: revoke_api_key(conn, name, now, identity.name))
                self.keys[name] = attrs.evolve(record, revoked_at=now)
                self._routes_changed()
        return answer(RevokedKey(name, self.keys[name].revoked_at))

    async def _keys_usage(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        """``GET /v1/admin/keys/usage[?name=NAME]``: each key's use this period (its budget's UTC day or
        month; a day without budget) against its limits, per model, from the store after the leader wrote
        what the gateways reported."""
        name = request.query.get("name")
        names = [name] if name else sorted(self.keys)
        if name:
            self._known(name)
        now = self.clock()
        if not self.read_only:
            async with self._usage_lock:
                await self.flush_usage(now)
        limits = {n: self.keys[n].limits for n in names}

        def read(conn: Any) -> list[KeyUsage]:
            found = []
            for n, wanted in limits.items():
                period = wanted.budget_period if wanted.budget is not None else BudgetPeriod.DAY
                since, resets_at = period_bounds(period, now)
                models = tuple(ModelUsage(*row) for row in key_usage_by_model(conn, n, since))
                tokens = sum(m.prompt_tokens + m.completion_tokens for m in models)
                found.append(KeyUsage(n, wanted, period, since, resets_at, tokens, models))
            return found

        return answer(UsageList(tuple(await self.store.run(read))))

    def _known(self, name: str) -> KeyRecord:
        if name not in self.keys:
            known = ", ".join(sorted(self.keys)) or "none"
            raise Refused(404, f"no API key named {name!r} (keys: {known})")
        return self.keys[name]

    def _routes_changed(self) -> None:
        self.cluster.routes_revision += 1
        self.reconciler.routes_changed()
