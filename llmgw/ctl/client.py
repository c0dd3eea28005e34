"""The admin API's client: where ``ctl`` finds the server and its credentials, and the calls.

Credentials come from flags, environment variables, or a config directory
(``$LLMGW_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/llmgw``, else
``~/.config/llmgw``) holding ``ca.pem``, ``admin.pem``, ``admin.key`` and
``config.toml`` with ``server = "https://HOST:PORT"``. ``llmgw dev`` writes
that directory, so ``llmgw ctl nodes`` works with no flags.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path
from typing import Any, TypeVar, overload
from urllib.parse import quote

import attrs
import httpx

from llmgw.ctl.diagnose import check_server_urls, not_the_admin_api, unreachable
from llmgw.errors import LlmgwError
from llmgw.serverlist import (
    STALE_OK_HEADER,
    STANDBY_HEADER,
    STORE_HEADER,
    STORE_UNREACHABLE,
    ServerList,
    leader_hint,
)
from llmgw.wire import WireError, error_message, from_json, to_json

T = TypeVar("T")

__all__ = ["AdminClient", "ClientConfig", "CtlError", "config_dir", "segment", "write_client_config"]


class CtlError(LlmgwError):
    """The admin API could not be reached, or refused the request (``status``: its HTTP status if it did)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def config_dir() -> Path:
    """Where ``ctl`` looks for its credentials by default."""
    if os.environ.get("LLMGW_CONFIG_DIR"):
        return Path(os.environ["LLMGW_CONFIG_DIR"])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "llmgw"


@attrs.frozen
class _ConfigFile:
    """``config.toml`` in the config directory (other keys are left to other tools)."""

    server: str | None = None


@attrs.frozen
class ClientConfig:
    """How to reach the admin API: the server's URL and an admin certificate."""

    server: str
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def resolve(
        cls, server: str | None, ca: Path | None, cert: Path | None, key: Path | None, directory: Path | None
    ) -> ClientConfig:
        """Flags first, then the config directory; says what is missing and where it looked."""
        directory = directory or config_dir()
        given = server is not None
        if server is None:
            config_file = directory / "config.toml"
            if config_file.exists():
                try:
                    server = from_json(tomllib.loads(config_file.read_text()), _ConfigFile).server
                except tomllib.TOMLDecodeError as exc:
                    raise CtlError(f"{config_file}: not valid TOML: {exc}") from None
                except WireError:
                    raise CtlError(
                        f"{config_file}: server: expected a string like https://host:7443"
                    ) from None
        if server is None:
            raise CtlError(
                f"no server given: pass --server https://HOST:7443, set LLMGW_SERVER, or write "
                f'server = "https://HOST:7443" in {directory / "config.toml"} (llmgw dev does this)'
            )
        try:
            check_server_urls(server, "--server" if given else f"{directory / 'config.toml'}: server")
        except ValueError as exc:
            raise CtlError(str(exc)) from None
        paths = {
            "--ca": ca or directory / "ca.pem",
            "--cert": cert or directory / "admin.pem",
            "--key": key or directory / "admin.key",
        }
        given_paths = {"--ca": ca, "--cert": cert, "--key": key}
        for flag, path in paths.items():
            if given_paths[flag] is not None and not path.exists():
                raise CtlError(f"{flag} {path}: no such file")
            if not path.exists():
                raise CtlError(
                    f"{flag} {path} does not exist; issue an admin certificate with "
                    f"`llmgw ca issue-admin NAME --ca-dir CA --out {directory}` or pass {flag}"
                )
        return cls(server.rstrip("/"), paths["--ca"], paths["--cert"], paths["--key"])


def write_client_config(
    directory: Path, server: str, ca: Path, cert: Path, key: Path, *, header: str = ""
) -> None:
    """Write a config directory ``ctl`` finds by default (used by ``llmgw dev``).

    ``header`` goes at the top of ``config.toml`` (a comment saying who wrote it).
    """
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for source, name in ((ca, "ca.pem"), (cert, "admin.pem")):
        (directory / name).write_bytes(source.read_bytes())
    target = directory / "admin.key"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.read_bytes())
    (directory / "config.toml").write_text(f'{header}server = "{server}"\n')


def segment(text: str) -> str:
    """``text`` percent-encoded as one path segment of the admin API (the server decodes it once).

    Every name a command puts in a path (a node, an API key) goes through this, so
    a name holding ``/``, ``%`` or a control character reaches the server intact.
    """
    return quote(text, safe="")


class AdminClient:
    """A synchronous client of the admin API with an admin certificate."""

    def __init__(self, config: ClientConfig) -> None:
        from llmgw.pki import client_ssl_context

        self.config = config
        context = client_ssl_context(config.cert, config.key, config.ca)
        #: the servers (``config.server`` may list several, comma-separated): requests go to the leader
        self.servers = ServerList([u.strip().rstrip("/") for u in config.server.split(",") if u.strip()])
        self._http = httpx.Client(verify=context, timeout=30)
        #: whether the note that a standby answered was printed (once per client)
        self._noted_standby = False

    @classmethod
    def for_command(cls, ctx: Any) -> AdminClient:
        """The client a ``ctl`` command uses: the ``ctl`` group's connection options (a click context's)."""
        options = ctx.find_root().meta.get("ctl_options", {})
        return cls(ClientConfig.resolve(**options))

    def close(self) -> None:
        """Close the client's connections."""
        self._http.close()

    @overload
    def request(self, method: str, path: str, reply: type[T], *, body: Any = None, **kwargs: Any) -> T: ...

    @overload
    def request(
        self, method: str, path: str, reply: None = None, *, body: Any = None, **kwargs: Any
    ) -> Any: ...

    def request(
        self, method: str, path: str, reply: type[T] | None = None, *, body: Any = None, **kwargs: Any
    ) -> T | Any:
        """Call the admin API, sending ``body`` (a :mod:`llmgw.wire` record) if given.

        :returns: the answer as a ``reply`` record (the JSON body when ``reply`` is None).
        :raises CtlError: the server cannot be reached, refused (with its message), or
            answered something that is not a ``reply``.
        """
        if body is not None:
            kwargs["json"] = to_json(body)
        response, data = self._send(method, path, kwargs)
        if response.status_code >= 400:
            raise CtlError(_error_message(data, response), response.status_code)
        if data is None:
            raise CtlError(f"{method} {path}: the server's answer is not JSON")
        if reply is None:
            return data
        try:
            return from_json(data, reply)
        except WireError as exc:
            raise CtlError(f"{method} {path}: {exc} (is the server another llmgw version?)") from None

    def _send(self, method: str, path: str, kwargs: dict[str, Any]) -> tuple[httpx.Response, Any]:
        """The answer of the first server that leads: skips one that cannot be connected to, or a standby.

        When no server leads because the store is unreachable, a read (``GET``) is asked once more of
        each server, accepting the state it last loaded (:data:`STALE_OK_HEADER`); else the error says
        the store is unreachable.
        """
        tried: list[str] = []
        store_down = False
        failures = 0
        for _ in range(len(self.servers) + 1):
            server = self.servers.current
            try:
                response = self._http.request(method, server + path, **kwargs)
            except httpx.InvalidURL as exc:
                raise CtlError(f"{method} {path!r}: not a URL path: {exc}") from None
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # not sent: another server may answer
                tried.append(unreachable(server, exc))
                self.servers.failed(server)
                failures += 1
                if failures >= len(self.servers):
                    break
                continue
            except httpx.HTTPError as exc:
                raise CtlError(unreachable(server, exc)) from None
            data = _json(response)
            wrong = not_the_admin_api(server, response.status_code, data, response.text)
            if wrong is not None:
                raise CtlError(wrong, response.status_code)
            standby, leader = leader_hint(response.status_code, response.headers, data)
            if not standby:
                self._note_standby(server, response)
                return response, data
            store_down |= response.headers.get(STORE_HEADER) == STORE_UNREACHABLE
            tried.append(f"{server}: {_error_message(data, response)}")
            self.servers.not_leader(server, leader)
        if len(self.servers) == 1 and failures:
            raise CtlError(tried[0])
        if store_down and method == "GET":
            stale = self._stale_read(path, kwargs)
            if stale is not None:
                return stale
        if store_down:
            raise CtlError("the store is unreachable, so no server leads: " + "; ".join(dict.fromkeys(tried)))
        raise CtlError("no server answered as the leader: " + "; ".join(dict.fromkeys(tried)))

    def _stale_read(self, path: str, kwargs: dict[str, Any]) -> tuple[httpx.Response, Any] | None:
        """The first answer of a server from the state it last loaded (the store unreachable); None: none."""
        headers = {**kwargs.get("headers", {}), STALE_OK_HEADER: "1"}
        for server in self.servers.urls:
            try:
                response = self._http.request("GET", server + path, **{**kwargs, "headers": headers})
            except httpx.HTTPError:
                continue
            if response.status_code < 500:
                self._note_standby(server, response)
                return response, _json(response)
        return None

    def _note_standby(self, server: str, response: httpx.Response) -> None:
        """Say on stderr, once, that a standby answered from the store (its ``x-llmgw-standby`` header)."""
        view = response.headers.get(STANDBY_HEADER)
        if view is not None and not self._noted_standby:
            self._noted_standby = True
            if response.headers.get(STORE_HEADER) == STORE_UNREACHABLE:
                said = "the store is unreachable, so no server leads: this is the state"
                print(f"note: {said} {server} last loaded ({view}); it may be out of date", file=sys.stderr)
                return
            print(
                f"note: {server} is a standby; this is the state the leader last stored ({view}); "
                "shards' live state (PIDs, logs) only the leader knows",
                file=sys.stderr,
            )


def _json(response: httpx.Response) -> Any:
    """The answer's JSON; None when it is not JSON."""
    try:
        return response.json()
    except ValueError:
        return None


def _error_message(data: Any, response: httpx.Response) -> str:
    """The message of the server's :class:`~llmgw.wire.ErrorReply`, or what there is of one."""
    return error_message(data) or response.text.strip() or f"the server answered {response.status_code}"
