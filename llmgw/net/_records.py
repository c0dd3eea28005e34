"""The server's request and response records (import them from :mod:`llmgw.net.server`)."""

from __future__ import annotations

import json as jsonlib
from collections.abc import AsyncIterable, Callable
from typing import Any
from urllib.parse import parse_qsl

import attrs

__all__ = ["Headers", "InvalidJSON", "Request", "Response"]

Headers = tuple[tuple[str, str], ...]


class InvalidJSON(ValueError):
    """The request body is not valid JSON; the message says where it broke."""


def _headers(value: Any) -> Headers:
    return tuple((str(name).lower(), str(val)) for name, val in value)


@attrs.frozen
class Request:
    """One HTTP request, read whole."""

    method: str
    #: path and query, as sent: ``/v1/models?x=1``
    target: str
    #: (lowercase name, value) pairs in the order received
    headers: Headers = attrs.field(default=(), converter=_headers)
    body: bytes = b""
    #: the client certificate (``SSLSocket.getpeercert()`` shape) on TLS
    #: connections that presented one; None otherwise
    peer_cert: dict[str, Any] | None = None
    #: the same certificate in DER (``getpeercert(binary_form=True)``): the
    #: dict form lacks extensions, such as llmgw's role policy
    peer_cert_der: bytes | None = None
    #: the client's (host, port)
    client: tuple[str, int] | None = None

    @property
    def path(self) -> str:
        """The target without its query string."""
        return self.target.partition("?")[0]

    @property
    def query(self) -> dict[str, str]:
        """The query string's parameters; the last value wins for repeated names."""
        return dict(parse_qsl(self.target.partition("?")[2]))

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or None if absent."""
        name = name.lower()
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def json(self) -> Any:
        """The body parsed as JSON.

        :raises InvalidJSON: when the body is not UTF-8 JSON.
        """
        try:
            return jsonlib.loads(self.body)
        except (ValueError, RecursionError) as exc:  # also bad UTF-8, too deep, an int over 4,300 digits
            raise InvalidJSON(f"request body is not valid JSON: {exc}") from None


@attrs.frozen
class Response:
    """What a handler returns.

    ``body`` is ``bytes`` (sent with ``Content-Length``) or an async iterable of
    ``bytes`` (sent chunked, each item as soon as it is produced; if the client
    goes away the iteration is cancelled and the iterator's ``aclose()``
    called). ``after`` is called once the exchange is over, whether the
    response was sent in full or not.
    """

    status: int
    headers: Headers = attrs.field(default=(), converter=_headers)
    body: bytes | AsyncIterable[bytes] = b""
    after: Callable[[], object] | None = None

    @classmethod
    def json(
        cls, status: int, obj: Any, *, headers: Headers = (), after: Callable[[], object] | None = None
    ) -> Response:
        """A response whose body is ``obj`` encoded as compact JSON."""
        body = jsonlib.dumps(obj, separators=(",", ":")).encode()
        return cls(status, (("content-type", "application/json"), *headers), body, after)

    @classmethod
    def text(
        cls,
        status: int,
        text: str,
        *,
        content_type: str = "text/plain; charset=utf-8",
        headers: Headers = (),
        after: Callable[[], object] | None = None,
    ) -> Response:
        """A response whose body is ``text`` encoded as UTF-8."""
        return cls(status, (("content-type", content_type), *headers), text.encode(), after)

    @classmethod
    def stream(
        cls,
        status: int,
        chunks: AsyncIterable[bytes],
        *,
        content_type: str = "text/event-stream",
        headers: Headers = (),
        after: Callable[[], object] | None = None,
    ) -> Response:
        """A response streamed chunk by chunk from ``chunks``."""
        headers = (("content-type", content_type), ("cache-control", "no-cache"), *headers)
        return cls(status, headers, chunks, after)
