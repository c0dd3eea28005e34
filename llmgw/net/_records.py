"""The server's request and response records (import them from :mod:`llmgw.net.server`)."""

from __future__ import annotations

import gc
import json as jsonlib
import re
from collections.abc import AsyncIterable, Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any
from urllib.parse import parse_qsl

import attrs

__all__ = ["Headers", "InvalidJSON", "Request", "Response", "parse_json", "MAX_JSON_DEPTH", "MAX_JSON_NUMBER"]

Headers = tuple[tuple[str, str], ...]


class InvalidJSON(ValueError):
    """The request body is not valid JSON, or breaks a bound; the message says where or which."""


#: JSON request bodies may nest arrays and objects this deep
MAX_JSON_DEPTH = 64
#: the longest number literal a JSON request body may hold, in characters
MAX_JSON_NUMBER = 100


def _number(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if len(text) > MAX_JSON_NUMBER:
            raise InvalidJSON(
                f"request body holds a number of {len(text)} characters; "
                f"at most {MAX_JSON_NUMBER} are accepted"
            )
        return kind(text)

    return parse


def _constant(name: str) -> Any:
    raise InvalidJSON(f"request body holds {name}, which is not JSON")


_DECODER = jsonlib.JSONDecoder(parse_int=_number(int), parse_float=_number(float), parse_constant=_constant)
_TOO_DEEP = f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: every byte but brackets and braces (deleted), and braces as brackets: nesting is all that is left
_NOT_NESTING = bytes(b for b in range(256) if b not in b"[]{}")
_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
#: a body larger than this is parsed with the cyclic garbage collector paused (see :func:`parse_json`)
_LARGE = 1024 * 1024


def _too_deep(body: bytes) -> bool:
    """Whether valid JSON ``body`` nests arrays and objects over :data:`MAX_JSON_DEPTH` deep.

    Read from the bytes, not the parsed value: strings dropped, brackets kept, then one innermost
    level removed per pass (``bytes.replace`` does not look again at what it joined). A body of millions of
    empty lists costs milliseconds, where walking its parsed value cost a minute.
    """
    nesting = _STRING.sub(b"", body).translate(_AS_BRACKETS, _NOT_NESTING)
    for _ in range(MAX_JSON_DEPTH):
        if not nesting:
            return False
        nesting = nesting.replace(b"[]", b"")
    return bool(nesting)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building millions of lists otherwise runs it again and again
    over every one built so far (9 s instead of 0.8 s for 4 million empty lists)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def parse_json(body: bytes) -> Any:
    """``body`` parsed as UTF-8 JSON within llmgw's bounds (depth, number length, no NaN).

    :raises InvalidJSON: naming what is wrong.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJSON(f"request body is not UTF-8: {exc}") from None
    try:
        with _collector_paused() if len(body) > _LARGE else nullcontext():
            value = _DECODER.decode(text.removeprefix("\ufeff"))
    except RecursionError:
        raise InvalidJSON(_TOO_DEEP) from None
    except InvalidJSON:
        raise
    except ValueError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    # nesting is only possible past the bound with that many brackets: counting them is cheap
    if (
        isinstance(value, dict | list)
        and body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH
        and _too_deep(body)
    ):
        raise InvalidJSON(_TOO_DEEP)
    return value


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
        """The body parsed as JSON (:func:`parse_json`: bounded depth and numbers).

        :raises InvalidJSON: when the body is not UTF-8 JSON or breaks a bound, saying which.
        """
        return parse_json(self.body)


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
