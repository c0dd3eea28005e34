"""The admin API's API keys: list, create (the secret shown once), revoke; the routes feed hands them out.

Mixed into :class:`llmgw.server.http.api.ServerApp`, which routes ``/v1/admin/keys*`` to it.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable

import trio

from llmgw.net.server import Request, Response
from llmgw.pki import Identity
from llmgw.server.http.replies import Refused, answer
from llmgw.server.persist.cluster import add_api_key, load_api_keys, revoke_api_key
from llmgw.server.persist.sqlite import Store
from llmgw.server.reconciler import Reconciler
from llmgw.server.state.cluster import ClusterState
from llmgw.wire import ApiKey, CreatedKey, CreateKey, KeyList, RevokedKey, from_json

__all__ = ["KEY_NAME_RULE", "KeysEndpoints"]

#: what an API key name may be; ``ctl keys create --help`` says the same
KEY_NAME_RULE = "1-63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit"
_KEY_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


class KeysEndpoints:
    """Handlers for ``/v1/admin/keys*``, and the keys in memory the routes feed reads."""

    cluster: ClusterState
    store: Store
    clock: Callable[[], float]
    reconciler: Reconciler
    _lock: trio.Lock
    #: API key name -> (sha256 hex of the secret, created at, revoked at or None)
    keys: dict[str, tuple[str, float, float | None]]

    async def load_keys(self) -> None:
        """Read the API keys from the store; called once at start."""
        self.keys = await self.store.run(load_api_keys)

    async def _list_keys(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        keys = tuple(
            ApiKey(name, created, revoked) for name, (_, created, revoked) in sorted(self.keys.items())
        )
        return answer(KeyList(keys))

    async def _create_key(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        name = from_json(request.json(), CreateKey).name
        if not _KEY_NAME.fullmatch(name):
            raise Refused(400, f"name: expected {KEY_NAME_RULE}, got {name!r}")
        secret = "llmgw-" + secrets.token_urlsafe(32)
        digest = hashlib.sha256(secret.encode()).hexdigest()
        now = self.clock()
        async with self._lock:
            if name in self.keys:
                state = "revoked" if self.keys[name][2] is not None else "in use"
                raise Refused(409, f"an API key named {name!r} exists ({state}); choose another name")
            await self.store.write(lambda conn: add_api_key(conn, name, digest, now, identity.name))
            self.keys[name] = (digest, now, None)
            self._routes_changed()
        return answer(CreatedKey(name, secret), 201)

    async def _revoke_key(self, request: Request, identity: Identity, params: dict[str, str]) -> Response:
        name = params["name"]
        now = self.clock()
        async with self._lock:
            if name not in self.keys:
                known = ", ".join(sorted(self.keys)) or "none"
                raise Refused(404, f"no API key named {name!r} (keys: {known})")
            digest, created, revoked = self.keys[name]
            if revoked is None:
                await self.store.write(lambda conn: revoke_api_key(conn, name, now, identity.name))
                self.keys[name] = (digest, created, now)
                self._routes_changed()
        return answer(RevokedKey(name, self.keys[name][2]))

    def _routes_changed(self) -> None:
        self.cluster.routes_revision += 1
        self.reconciler.routes_changed()
