"""How a request becomes the text the sim generates after: a chat's messages rendered (with a final
assistant message left open when asked), a completion's prompts, an embedding's inputs."""

from __future__ import annotations

from typing import Any

import attrs

from llmgw_engine_sim.errors import ApiError
from llmgw_engine_sim.generate import count_tokens

__all__ = ["ChatPrompt", "chat_prompt", "prompt_texts"]


@attrs.frozen
class ChatPrompt:
    """A chat request's messages as the sim reads them."""

    #: the messages rendered up to the answer (``role: text`` lines, then ``assistant: ``)
    prompt: str
    #: the words of every message's text (the usage's prompt tokens)
    prompt_tokens: int
    #: the answer's text already given: a final assistant message continued (else empty)
    answer: str


def chat_prompt(body: dict) -> ChatPrompt:
    """Render a chat request's ``messages``; called for every ``POST /v1/chat/completions``.

    With ``continue_final_message`` (and ``add_generation_prompt: false``) the final assistant message is
    left open: its text is the answer's start. :raises ApiError: 400 for messages the API refuses.
    """
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "Missing required parameter: 'messages'.", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    prompt_parts, prompt_tokens, content = [], 0, ""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
        content = _content_text(message.get("content"), f"messages[{i}].content")
        prompt_parts.append(f"{message['role']}: {content}")
        prompt_tokens += count_tokens(content)
    prompt = "\n".join(prompt_parts)
    answer = ""
    if _continues_final_message(body, messages):
        # the final assistant message is left open: its text is the answer's start
        answer = content
        prompt = prompt.removesuffix(content)
    elif body.get("add_generation_prompt", True):
        prompt += "\nassistant: "
    return ChatPrompt(prompt, prompt_tokens, answer)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _continues_final_message(body: dict, messages: list) -> bool:
    """Whether the request asks to continue its final (assistant) message, as vLLM's and SGLang's
    ``continue_final_message`` with ``add_generation_prompt: false``; 400 for what vLLM refuses."""
    continues = body.get("continue_final_message", False)
    generation_prompt = body.get("add_generation_prompt", True)
    for name, value in (("continue_final_message", continues), ("add_generation_prompt", generation_prompt)):
        if not isinstance(value, bool):
            raise ApiError(400, f"'{name}' must be a boolean", param=name)
    if not continues:
        return False
    if generation_prompt:
        raise ApiError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    if messages[-1].get("role") != "assistant":
        raise ApiError(
            400, "`continue_final_message` needs the final message to be the assistant's", param="messages"
        )
    return True


def _content_text(content: Any, param: str) -> str:
    """The text of a chat message's content: a string, a list of parts, or null."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
        ]
        return " ".join(texts)
    raise ApiError(400, f"'{param}' must be a string or an array of content parts", param=param)


def prompt_texts(value: Any, param: str = "prompt") -> list[str]:
    """A prompt or embedding input as a list of texts; token-id lists become their ids as words."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(_is_int(item) for item in value):
            return [" ".join(map(str, value))]
        if all(isinstance(item, str) for item in value):
            return list(value)
        if all(isinstance(item, list) and all(_is_int(t) for t in item) for item in value):
            return [" ".join(map(str, item)) for item in value]
    raise ApiError(400, f"'{param}' must be a string, an array of strings or of token ids", param=param)
