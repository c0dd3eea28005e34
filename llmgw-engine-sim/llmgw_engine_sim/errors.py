"""The sim's errors, answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from llmgw.net.server import Response

__all__ = ["ApiError", "unavailable"]


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        kind: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def response(self) -> Response:
        """The JSON error response for this error."""
        kind = self.kind or ("server_error" if self.status >= 500 else "invalid_request_error")
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return Response.json(self.status, {"error": error})


def unavailable(message: str) -> ApiError:
    """llama-server's answer while it loads.

    503 ``{"error": {"message", "type": "unavailable_error", "code": 503}}``.
    """
    return ApiError(503, message, code=503, kind="unavailable_error")
