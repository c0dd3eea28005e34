"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from llmgw.net.server import Response

__all__ = ["openai_error"]


def openai_error(
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: tuple[tuple[str, str], ...] = (),
) -> Response:
    """A JSON error response in OpenAI's shape.

    ``type`` defaults to ``invalid_request_error`` for 4xx and ``server_error`` for 5xx, as OpenAI's API does.
    """
    kind = type or ("server_error" if status >= 500 else "invalid_request_error")
    error = {"message": message, "type": kind, "param": param, "code": code}
    return Response.json(status, {"error": error}, headers=headers)
