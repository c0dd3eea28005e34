"""The OpenAI-compatible API of one llmgw-sim process, over real HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "sim-model"


@pytest.fixture(scope="module")
def sim(start_module_sim, tmp_path_factory):
    """One ready sim, loading a local model directory, shared by the module's tests."""
    weights = tmp_path_factory.mktemp("weights")
    sim = start_module_sim(
        "--model", str(weights), "--served-model-name", MODEL, "other-name", "--max-model-len", "64"
    )
    sim.wait_ready()
    return sim


@pytest.fixture
def client(sim) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)


def post(sim, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{sim.url}{path}", timeout=5, **kwargs)


class TestOpenAIClient:
    """The official openai client talks to the sim."""

    def test_completion(self, client):
        """A completion has text, usage counts and a finish reason."""
        completion = client.completions.create(model=MODEL, prompt="one two three", max_tokens=5)
        choice = completion.choices[0]
        assert choice.text
        assert completion.model == MODEL
        assert completion.id.startswith("cmpl-")
        assert completion.usage.prompt_tokens == 3
        assert completion.usage.completion_tokens == len(choice.text.split())
        assert completion.usage.total_tokens == 3 + completion.usage.completion_tokens
        assert choice.finish_reason in ("stop", "length")

    def test_streamed_chat_completion(self, client):
        """A streamed chat completion arrives in chunks, with usage when asked for."""
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tell me a story"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
        assert finish[-1] in ("stop", "length")
        assert chunks[-1].choices == []
        assert chunks[-1].usage.prompt_tokens == 4
        assert chunks[-1].usage.completion_tokens == len(text.split())
        assert {chunk.id for chunk in chunks} == {chunks[0].id}

    def test_stream_and_non_stream_agree(self, client):
        """Streaming a request yields the same text as asking for it whole."""
        messages = [{"role": "user", "content": "same text please"}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert streamed == whole.choices[0].message.content

    def test_max_tokens_gives_finish_reason_length(self, client):
        """A generation cut by max_tokens ends with finish_reason 'length'."""
        completion = client.completions.create(model=MODEL, prompt="cut me short", max_tokens=1)
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage.completion_tokens == 1

    def test_default_max_tokens_is_16(self, client):
        """Without max_tokens at most 16 tokens are generated."""
        lengths = [
            client.completions.create(model=MODEL, prompt=f"prompt {i}").usage.completion_tokens
            for i in range(8)
        ]
        assert max(lengths) <= 16
        assert 16 in lengths

    def test_embeddings(self, client):
        """Embeddings are deterministic unit vectors, also through the client's base64 encoding."""
        first = client.embeddings.create(model=MODEL, input=["hello world", "other"])
        again = client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
        vector = first.data[0].embedding
        assert len(vector) == 64
        assert sum(v * v for v in vector) == pytest.approx(1.0, rel=1e-5)
        assert again.data[0].embedding == pytest.approx(vector, rel=1e-5)
        assert first.data[1].embedding != pytest.approx(vector)
        assert first.usage.prompt_tokens == 3

    def test_models_lists_served_names(self, client):
        """/v1/models lists every served name."""
        assert [model.id for model in client.models.list()] == [MODEL, "other-name"]

    def test_any_served_name_is_accepted(self, client):
        """A request may use any of the served names, and gets it back as the model."""
        completion = client.completions.create(model="other-name", prompt="hi", max_tokens=2)
        assert completion.model == "other-name"

    def test_wrong_model_raises_not_found(self, client):
        """The client sees a 404 NotFoundError for a model the sim does not serve."""
        with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist."):
            client.completions.create(model="nope", prompt="hi")


class TestDeterminism:
    """Generated text depends on the request only."""

    def test_same_request_same_text(self, client):
        """The same request twice gives the same text; another prompt gives another text."""

        def text(prompt: str) -> str:
            messages = [{"role": "user", "content": prompt}]
            return client.chat.completions.create(model=MODEL, messages=messages).choices[0].message.content

        assert text("what is a gpu") == text("what is a gpu")
        assert text("what is a gpu") != text("what is a cpu")

    def test_choices_differ(self, client):
        """With n > 1 each choice has its own text."""
        completion = client.completions.create(model=MODEL, prompt="several", n=3, max_tokens=8)
        assert [choice.index for choice in completion.choices] == [0, 1, 2]
        assert len({choice.text for choice in completion.choices}) == 3


class TestErrors:
    """Errors have OpenAI's shape and the right status."""

    def assert_error(self, response: httpx.Response, status: int, param=None, code=None) -> str:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert (error["param"], error["code"]) == (param, code)
        return error["message"]

    def test_bad_json(self, sim):
        """A body that is not JSON is a 400."""
        response = post(sim, "/v1/chat/completions", content=b"{not json")
        assert "not valid JSON" in self.assert_error(response, 400, code="invalid_json")

    def test_missing_field(self, sim):
        """A chat request without messages is a 400 naming the parameter."""
        response = post(sim, "/v1/chat/completions", json={"model": MODEL})
        assert self.assert_error(response, 400, param="messages") == "Missing required parameter: 'messages'."
        response = post(sim, "/v1/completions", json={"prompt": "x"})
        self.assert_error(response, 400, param="model")

    def test_wrong_model(self, sim):
        """An unknown model is a 404 whose message names it."""
        response = post(sim, "/v1/completions", json={"model": "x", "prompt": "hi"})
        message = self.assert_error(response, 404, param="model", code="model_not_found")
        assert message == "The model `x` does not exist."

    def test_bad_max_tokens(self, sim):
        """A max_tokens that is not a positive integer is a 400."""
        for value in (0, "5", True, 1.5):
            response = post(
                sim, "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": value}
            )
            self.assert_error(response, 400, param="max_tokens")

    def test_context_length_exceeded(self, sim):
        """Prompt plus max_tokens over --max-model-len is a 400, as vLLM answers it."""
        prompt = " ".join(["word"] * 60)
        response = post(sim, "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5})
        message = self.assert_error(response, 400, param="prompt", code="context_length_exceeded")
        assert message.startswith(
            "This model's maximum context length is 64 tokens. However, you requested 65"
        )

    def test_unknown_path(self, sim):
        """An unknown path is a 404."""
        response = httpx.get(f"{sim.url}/v2/nothing", timeout=5)
        assert self.assert_error(response, 404) == "Invalid URL (GET /v2/nothing)"

    def test_wrong_method(self, sim):
        """A GET on a POST endpoint is a 405 with an Allow header."""
        response = httpx.get(f"{sim.url}/v1/chat/completions", timeout=5)
        self.assert_error(response, 405)
        assert response.headers["allow"] == "POST"


class TestInfo:
    """The /sim/info debug endpoint."""

    def test_info(self, sim):
        """/sim/info reports argv, rank, nnodes and the environment the engine saw."""
        info = httpx.get(f"{sim.url}/sim/info", timeout=5).json()
        assert info["rank"] == 0
        assert info["nnodes"] == 1
        assert "--max-model-len" in info["argv"]
        assert set(info["env"]) == {"CUDA_VISIBLE_DEVICES", "NCCL_IB_HCA"}
        assert info["workers"] == []
