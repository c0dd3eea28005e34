"""The control plane's servers a client knows (``--server URL,URL,...``) and the one it talks to now.

Agents, gateways and ``ctl`` take a comma-separated list. They talk to one
server at a time; when it cannot be reached they move to the next, and when
it answers 503 ``not_leader`` (a standby, see :mod:`llmgw.server.ha.lease`) they
move to the leader it names in the ``x-llmgw-leader`` header, else to the next.
A standby answers reads itself (the admin API's, the routes feed) from the
store, marking them with the ``x-llmgw-standby`` header. A standby that
cannot reach the store says so (``x-llmgw-store: unreachable``); it answers
an admin read from the state it last loaded only when asked
(``x-llmgw-stale-ok: 1``, as ``ctl`` does once no server could answer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import httpx

__all__ = [
    "LEADER_HEADER",
    "NOT_LEADER",
    "STALE_OK_HEADER",
    "STANDBY_HEADER",
    "STORE_HEADER",
    "STORE_UNREACHABLE",
    "NotLeaderAnswer",
    "ServerList",
    "leader_hint",
    "parse_servers",
    "raise_for_standby",
    "send_to_leader",
]

#: the header a standby names the leader's URL in
LEADER_HEADER = "x-llmgw-leader"
#: the error type of a standby's answer
NOT_LEADER = "not_leader"
#: the header on a standby's read (from the store, as the leader last wrote it): which revision, how
#: fresh, and the leader (``revision 8, checked 0.4 s ago, leader https://a:7443``)
STANDBY_HEADER = "x-llmgw-standby"
#: the header on a standby's refusal when it cannot reach the store (value :data:`STORE_UNREACHABLE`)
STORE_HEADER = "x-llmgw-store"
STORE_UNREACHABLE = "unreachable"
#: a client's request header (value ``1``): a standby that cannot reach the store may answer this read
#: from the state it last loaded (its :data:`STANDBY_HEADER` says how old), instead of refusing it
STALE_OK_HEADER = "x-llmgw-stale-ok"


def parse_servers(text: str, flag: str = "--server", schemes: Sequence[str] = ("https",)) -> tuple[str, ...]:
    """The URLs of a ``--server`` value: ``https://HOST:PORT``, comma-separated, duplicates dropped.

    :raises ValueError: naming ``flag``, the bad URL and what was expected.
    """
    urls: list[str] = []
    for part in text.split(","):
        url = part.strip().rstrip("/")
        if not url:
            continue
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in schemes or not parts.hostname or port is None or parts.path:
            raise ValueError(
                f"{flag} {url!r}: expected https://HOST:PORT (several: comma-separated), "
                "e.g. https://llmgw-1.example.net:7443,https://llmgw-2.example.net:7443"
            )
        if url not in urls:
            urls.append(url)
    if not urls:
        raise ValueError(f"{flag}: expected https://HOST:PORT (several: comma-separated), got {text!r}")
    return tuple(urls)


def leader_hint(status: int, headers: Mapping[str, str] | Any, body: Any) -> tuple[bool, str | None]:
    """Whether an answer is a standby's ``not_leader``, and the leader's URL it names (None: none leads yet).

    ``headers`` is anything with a case-insensitive ``get`` (httpx's) or a mapping with lower-case keys;
    ``body`` the answer's parsed JSON.
    """
    if status != 503 or not isinstance(body, dict):
        return False, None
    error = body.get("error")
    if not isinstance(error, dict) or error.get("type") != NOT_LEADER:
        return False, None
    leader = headers.get(LEADER_HEADER)
    return True, (leader.rstrip("/") if leader else None)


class NotLeaderAnswer(Exception):
    """A server answered that it is a standby; ``leader``: the leader it named (None: none leads yet)."""

    def __init__(self, server: str, leader: str | None) -> None:
        super().__init__(f"{server} is a standby (the leader: {leader or 'none yet'})")
        self.server = server
        self.leader = leader


def raise_for_standby(server: str, status: int, headers: Any, read_json: Any) -> None:
    """Raise :class:`NotLeaderAnswer` when ``server``'s answer is a standby's.

    ``read_json`` returns the answer's parsed JSON (raising ValueError when it is not JSON).
    """
    if status != 503:
        return
    try:
        body = read_json()
    except ValueError:
        return
    standby, leader = leader_hint(status, headers, body)
    if standby:
        raise NotLeaderAnswer(server, leader)


class ServerList:
    """The servers a client knows, and which one it uses (:attr:`current`); not thread-safe."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("a server list needs at least one URL")
        self.urls = tuple(urls)
        self._index = 0
        #: a leader a standby named that is not in :attr:`urls`
        self._named: str | None = None

    @classmethod
    def parse(cls, text: str, flag: str = "--server", schemes: Sequence[str] = ("https",)) -> ServerList:
        """A list from a ``--server`` value (see :func:`parse_servers`)."""
        return cls(parse_servers(text, flag, schemes))

    @property
    def current(self) -> str:
        """The server to talk to now."""
        return self._named or self.urls[self._index]

    def failed(self, url: str) -> str:
        """``url`` could not be reached (or no server leads): move on to the next server; return it."""
        if url == self.current:
            if self._named is not None:
                self._named = None
            else:
                self._index = (self._index + 1) % len(self.urls)
        return self.current

    def not_leader(self, url: str, leader: str | None) -> str:
        """``url`` answered that it is a standby naming ``leader``: move to it (else the next); return it."""
        if leader is None or leader == url:
            return self.failed(url)
        if leader in self.urls:
            self._index, self._named = self.urls.index(leader), None
        else:
            self._named = leader
        return self.current

    def __len__(self) -> int:
        return len(self.urls)

    def __str__(self) -> str:
        return ",".join(self.urls)


async def send_to_leader(
    client: httpx.AsyncClient, servers: ServerList, method: str, path: str, **kwargs: Any
) -> httpx.Response:
    """Send one request to the leader among ``servers``: to the current one, moving on when it cannot be
    reached or is a standby (to the leader it names); at most one try per server, and one more.

    For a client's occasional calls (an agent's farewell, its weights calls); the answer of the last
    server tried, whatever its status.

    :raises httpx.HTTPError: the last error, when the last server tried could not be reached.
    """
    import httpx

    error: httpx.HTTPError | None = None
    response: httpx.Response | None = None
    for _ in range(len(servers) + 1):
        server = servers.current
        try:
            response = await client.request(method, server + path, **kwargs)
        except httpx.HTTPError as exc:
            error, response = exc, None
            servers.failed(server)
            continue
        try:
            body = response.json()
        except ValueError:
            body = None
        standby, leader = leader_hint(response.status_code, response.headers, body)
        if not standby:
            return response
        servers.not_leader(server, leader)
    if response is not None:
        return response
    assert error is not None
    raise error
