"""How the server's handlers answer: JSON records, JSON errors, and refusals raised from deep inside."""

from __future__ import annotations

from typing import Any

from llmgw.errors import CatalogError
from llmgw.net.server import Response
from llmgw.wire import ErrorDetail, ErrorReply, to_json

__all__ = ["Refused", "InvalidCatalog", "error", "answer", "query_int"]


class Refused(Exception):
    """A handler's refusal: answered as a JSON error with ``status`` and ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class InvalidCatalog(Exception):
    """A catalog that does not parse: answered as a 400 ``invalid_catalog`` listing its problems."""

    def __init__(self, error: CatalogError) -> None:
        super().__init__(str(error))
        self.error = error


def error(
    status: int, message: str, *, kind: str | None = None, problems: list[str] | None = None
) -> Response:
    """A JSON error answer (:class:`llmgw.wire.ErrorReply`); ``kind`` defaults by ``status``."""
    kinds = {400: "invalid_request", 401: "unauthenticated", 403: "forbidden", 404: "not_found"}
    detail = ErrorDetail(
        message, kind or kinds.get(status, "error"), None if problems is None else tuple(problems)
    )
    return answer(ErrorReply(detail), status)


def answer(record: Any, status: int = 200) -> Response:
    """A record of :mod:`llmgw.wire` as the JSON answer."""
    return Response.json(status, to_json(record))


def query_int(text: str, name: str) -> int:
    """The query parameter ``name`` as an integer sqlite can hold, or a 400 naming it."""
    try:
        value = int(text)
    except ValueError:
        raise Refused(400, f"query parameter {name}: expected an integer, got {text!r}") from None
    if not 0 <= value <= MAX_QUERY_INT:
        raise Refused(400, f"query parameter {name}: expected an integer from 0 to {MAX_QUERY_INT}")
    return value


#: the largest integer sqlite stores (a signed 64-bit integer)
MAX_QUERY_INT = 2**63 - 1
