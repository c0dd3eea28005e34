"""Continuing an answer from its first words: the sim gives token for token the unbroken answer."""

from __future__ import annotations

import httpx
import pytest
from llmgw_engine_sim.generate import generate

MODEL = "sim-model"


@pytest.fixture(scope="module")
def sim(start_module_sim, tmp_path_factory):
    """One ready sim, shared by the module's tests."""
    sim = start_module_sim("--model", str(tmp_path_factory.mktemp("weights")), "--served-model-name", MODEL)
    sim.wait_ready()
    return sim


def post(sim, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{sim.url}{path}", json={"model": MODEL, **body}, timeout=10)


class TestGenerate:
    """The generation function itself."""

    @pytest.mark.parametrize("cut", [0, 1, 7, 39])
    def test_a_chat_answer_continued_gives_the_rest(self, cut):
        """Generating after the first ``cut`` words of a chat answer gives the remaining words."""
        whole = generate("user: hi\nassistant: ", 40, answer="", ignore_eos=True)
        rest = generate(
            "user: hi\nassistant: ", 40 - cut, answer="".join(whole.tokens[:cut]), ignore_eos=True
        )
        assert whole.tokens[:cut] + rest.tokens == whole.tokens
        assert rest.finish_reason == whole.finish_reason == "length"

    def test_a_chat_answer_stops_at_the_same_word_when_continued(self):
        """A chat answer that stops by itself stops at the same word when continued from any point."""
        whole = generate("user: story\nassistant: ", 200, answer="")
        assert whole.finish_reason == "stop" and 4 <= len(whole.tokens) <= 63
        for cut in range(len(whole.tokens)):
            rest = generate("user: story\nassistant: ", 200, answer="".join(whole.tokens[:cut]))
            assert whole.tokens[:cut] + rest.tokens == whole.tokens and rest.finish_reason == "stop"

    def test_a_completion_continued_stops_at_the_same_word(self):
        """A completion that stops by itself stops at the same word with its text appended to the prompt."""
        prompt = next(f"p {i}" for i in range(200) if generate(f"p {i}", 200).finish_reason == "stop")
        whole = generate(prompt, 200)
        for cut in range(len(whole.tokens)):
            rest = generate(prompt + "".join(whole.tokens[:cut]), 200)
            assert whole.tokens[:cut] + rest.tokens == whole.tokens and rest.finish_reason == "stop"


class TestContinueFinalMessage:
    """``continue_final_message`` over HTTP, as vLLM takes it."""

    def test_chat_continued_equals_the_unbroken_answer(self, sim):
        """The first words as an assistant message, continued, give the rest; usage counts them as prompt."""
        messages = [{"role": "user", "content": "tell me about fleets"}]
        whole = post(
            sim, "/v1/chat/completions", {"messages": messages, "max_tokens": 30, "ignore_eos": True}
        )
        text = whole.json()["choices"][0]["message"]["content"]
        words = text.split(" ")
        begun = " ".join(words[:12])
        body = {
            "messages": [*messages, {"role": "assistant", "content": begun}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 18,
            "ignore_eos": True,
        }
        rest = post(sim, "/v1/chat/completions", body).json()
        assert begun + rest["choices"][0]["message"]["content"] == text
        assert rest["choices"][0]["finish_reason"] == "length"
        assert rest["usage"]["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"] + 12
        assert rest["usage"]["completion_tokens"] == 18

    def test_completion_continued_equals_the_unbroken_answer(self, sim):
        """A completion's prompt with its text so far appended gives the rest of the text."""
        whole = post(sim, "/v1/completions", {"prompt": "once upon", "max_tokens": 20, "ignore_eos": True})
        text = whole.json()["choices"][0]["text"]
        cut = text.split(" ")
        begun = " ".join(cut[:6])
        rest = post(
            sim, "/v1/completions", {"prompt": "once upon" + begun, "max_tokens": 15, "ignore_eos": True}
        )
        assert begun + rest.json()["choices"][0]["text"] == text

    def test_both_flags_are_refused(self, sim):
        """``continue_final_message`` with ``add_generation_prompt`` is a 400, as in vLLM."""
        body = {
            "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
            "continue_final_message": True,
        }
        response = post(sim, "/v1/chat/completions", body)
        assert response.status_code == 400
        assert "add_generation_prompt" in response.json()["error"]["message"]

    def test_continuing_a_user_message_is_refused(self, sim):
        """``continue_final_message`` needs the final message to be the assistant's."""
        body = {
            "messages": [{"role": "user", "content": "x"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
        assert post(sim, "/v1/chat/completions", body).status_code == 400
