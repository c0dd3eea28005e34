"""Chat completion requests as tests and benchmarks send them: one user message, streamed or not.

::

    body = chat_body("chat", "hi", 40, stream=True, usage=True)
    httpx.post(f"{gateway}/v1/chat/completions", json=body)
"""

from __future__ import annotations

__all__ = ["chat_body"]


def chat_body(
    model: str, content: str, max_tokens: int, *, stream: bool = False, usage: bool = False, **fields: object
) -> dict:
    """The JSON body of ``POST /v1/chat/completions`` asking ``model`` to answer ``content``.

    :param stream: whether the answer comes as server-sent events.
    :param usage: whether a stream ends with the usage (``stream_options.include_usage``).
    :param fields: any other field of the request as the API spells it (``ignore_eos=True``).
    :returns: the body, a new dict each call.
    """
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body | fields
