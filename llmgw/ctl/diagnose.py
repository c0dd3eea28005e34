"""What ``ctl`` says when the server URL it was given is not the admin API, or cannot be reached.

The admin API is ``llmgw server``'s: HTTPS with mutual TLS, port 7443 by
default. The usual mistakes are the gateway's URL (``http://HOST:8080``, the
OpenAI API), a plain-HTTP URL, a URL without its port, and a CA or admin
certificate of another cluster; each gets a message that says which and what to give instead.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from llmgw.serverlist import parse_servers

__all__ = ["ADMIN_HINT", "check_server_urls", "not_the_admin_api", "unreachable"]

#: what the admin API's URL looks like
ADMIN_HINT = "the admin API is llmgw server's, https with mutual TLS on port 7443 by default"
_GATEWAY_PORT = 8080


def _gateway_note(url: str) -> str:
    try:
        port = urlsplit(url).port
    except ValueError:
        port = None
    if port != _GATEWAY_PORT:
        return ""
    return f"; :{_GATEWAY_PORT} is the gateway's OpenAI API, not the admin API"


def check_server_urls(text: str, where: str) -> tuple[str, ...]:
    """The URLs of a ``ctl`` server value, or ``ValueError`` saying what the admin API's URL is.

    ``where`` names where the value came from (``--server/LLMGW_SERVER``, a config file's key).
    """
    for part in (p.strip() for p in text.split(",") if p.strip()):
        parts = urlsplit(part)
        if parts.scheme == "http":
            https = "https://" + part.removeprefix("http://")
            port = parts.port if _has_port(part) else None
            suggestion = https if port not in (None, _GATEWAY_PORT) else f"https://{parts.hostname}:7443"
            raise ValueError(
                f"{where} {part!r}: {ADMIN_HINT}, not plain http{_gateway_note(part)}; try {suggestion}"
            )
    try:
        return parse_servers(text, where)
    except ValueError as exc:
        raise ValueError(f"{exc}{_gateway_note(text)}") from None


def _has_port(url: str) -> bool:
    try:
        return urlsplit(url).port is not None
    except ValueError:
        return False


def unreachable(server: str, error: BaseException) -> str:
    """Why ``server`` could not be talked to, in words an operator can act on (``error``: httpx's)."""
    text = str(error)
    if any(
        sign in text for sign in ("WRONG_VERSION_NUMBER", "record layer failure", "packet length too long")
    ):
        return (
            f"{server} does not answer in TLS: it is not the admin API; {ADMIN_HINT}{_gateway_note(server)}"
        )
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            f"{server}: its certificate is not signed by the CA given (--ca): another cluster's server, "
            f"or another cluster's ca.pem? ({text})"
        )
    if "CERTIFICATE_REQUIRED" in text.upper() or "BAD_CERTIFICATE" in text.upper() or "UNKNOWN_CA" in text:
        return (
            f"{server} refused the admin certificate (--cert): is it issued by this cluster's CA "
            f"(`llmgw ca issue-admin`)? ({text})"
        )
    if "Connection refused" in text:
        return (
            f"nothing listens at {server} (connection refused): is llmgw server running there? ({ADMIN_HINT})"
        )
    return f"cannot reach the server at {server}: {text}"


def not_the_admin_api(server: str, status: int, data: object, body: str) -> str | None:
    """A message when an answer shows ``server`` is not llmgw's admin API (None: it is, or may be)."""
    message = ""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        message = str(data["error"].get("message", ""))
    if status == 404 and message.startswith("Invalid URL ("):
        return f"{server} is llmgw's gateway (the OpenAI API), not the admin API; {ADMIN_HINT}"
    if status >= 400 and data is None:
        first = body.strip().splitlines()[0][:80] if body.strip() else "an empty body"
        return f"{server} answered {status} with {first!r}, not JSON: it is not the admin API; {ADMIN_HINT}"
    return None
