"""The simulated engine's OpenAI-compatible HTTP API, served by rank 0.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions``, ``POST /v1/embeddings``, with ``--enable-lora``
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (see
:mod:`llmgw_engine_sim.lora`), ``GET /metrics`` (token
counters, request gauges and latency histograms, named and labelled as vLLM's:
see :mod:`llmgw_engine_sim.batch`) and the debug ``GET /sim/info``. Errors have OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.

With ``--max-num-seqs N`` at most N generations run at once and the others
wait for a seat, as in a real engine's batch: a request can wait long while
the engine is busy producing tokens.

Chat requests take vLLM's ``continue_final_message`` (with
``add_generation_prompt: false``): the final assistant message is left open and
the answer goes on from its text, token for token what the unbroken answer
would have been (see :mod:`llmgw_engine_sim.generate`); ``ignore_eos`` makes
an answer run to ``max_tokens``.
"""

from __future__ import annotations

import base64
import logging
import os
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import trio

from llmgw.net.server import InvalidJSON, Request, Response
from llmgw_engine_sim.batch import Batch, Timing
from llmgw_engine_sim.errors import ApiError, unavailable
from llmgw_engine_sim.generate import Generation, count_tokens, embed, generate
from llmgw_engine_sim.lora import LoraOptions, Loras
from llmgw_engine_sim.prefix_cache import Prefill, PrefillOptions
from llmgw_engine_sim.prompt import chat_prompt, prompt_texts

__all__ = ["ApiError", "ServeOptions", "SimApp", "unavailable"]

log = logging.getLogger("llmgw_engine_sim")

DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 16
EMBEDDING_DIMENSIONS = 64
#: environment variables /sim/info reports, for every rank
REPORTED_ENV = ("CUDA_VISIBLE_DEVICES", "NCCL_IB_HCA")


def reported_env() -> dict[str, str | None]:
    """The values of :data:`REPORTED_ENV` in this process."""
    return {name: os.environ.get(name) for name in REPORTED_ENV}


@attrs.frozen
class ServeOptions:
    """What the HTTP API needs from the command line."""

    model: str
    served_model_names: tuple[str, ...] = attrs.field(converter=tuple)
    max_model_len: int | None = None
    time_to_first_token: float = 0.0
    tokens_per_second: float = 0.0
    hang_after_requests: int | None = None
    exit_after_requests: int | None = None
    oom_after_requests: int | None = None
    log_requests: bool = True
    #: generations running at once; the others wait (None: no limit)
    max_num_seqs: int | None = None
    prefill: PrefillOptions = PrefillOptions()
    lora: LoraOptions = LoraOptions()


class SimApp:
    """The request handler of rank 0.

    :param exit: called as ``exit(code, reason)`` to end the process (used by
        ``--exit-after-requests``).
    :param info: returns the rank/replica part of ``/sim/info``.
    """

    def __init__(
        self,
        options: ServeOptions,
        *,
        exit: Callable[[int, str], None],
        info: Callable[[], dict[str, Any]],
    ) -> None:
        self.options = options
        self.ready = False
        self.shutting_down = False
        self.inference_requests = 0
        #: the seats of --max-num-seqs and the counters of /metrics
        self.batch = Batch(options.max_num_seqs, options.served_model_names[0])
        #: set when a peer was lost or hangs (``--on-peer-loss abort-on-request``): awaited by
        #: every inference request before anything else (it aborts the process, or hangs)
        self.peer_problem: Callable[[], Awaitable[None]] | None = None
        self.created = int(time.time())
        self._exit = exit
        self.prefill = Prefill(options.prefill)
        #: the LoRA adapters (loaded at run time, with --enable-lora)
        self.loras = Loras(options.lora, self.options.served_model_names)
        self.batch.registry.register(self.loras)
        self._info = info
        self._routes = {
            "/health": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/completions": {"POST": self._completions},
            "/v1/embeddings": {"POST": self._embeddings},
            "/v1/load_lora_adapter": {"POST": self._load_lora},
            "/v1/unload_lora_adapter": {"POST": self._unload_lora},
            "/metrics": {"GET": self._metrics},
            "/sim/info": {"GET": self._sim_info},
        }

    async def handle(self, request: Request) -> Response:
        """Answer one HTTP request (the :class:`llmgw.net.server.HttpServer` handler)."""
        try:
            response = await self._route(request)
        except ApiError as error:
            response = error.response()
        if self.options.log_requests and request.path not in ("/health", "/metrics"):
            host, port = request.client or ("-", 0)
            log.info('%s:%s "%s %s" %d', host, port, request.method, request.path, response.status)
        return response

    def _out_of_memory(self) -> None:
        """``--oom-after-requests``: die as vLLM's engine does when CUDA runs out of memory."""
        log.error("EngineCore encountered a fatal error.")
        log.error(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
            "capacity of 79.15 GiB of which 1.02 GiB is free."
        )
        self._exit(1, f"out of memory (--oom-after-requests {self.options.oom_after_requests})")

    async def _route(self, request: Request) -> Response:
        methods = self._routes.get(request.path)
        if methods is None:
            raise ApiError(404, f"Invalid URL ({request.method} {request.path})")
        endpoint = methods.get(request.method)
        if endpoint is None:
            allowed = ", ".join(methods)
            message = f"Method {request.method} not allowed for {request.path}; use {allowed}"
            error = ApiError(405, message).response()
            return attrs.evolve(error, headers=(*error.headers, ("allow", allowed)))
        return await endpoint(request)

    # --- plain endpoints --------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        # llama-server's shapes: 200 {"status": "ok"}; 503 with an OpenAI-style error while loading
        if self.ready and not self.shutting_down:
            return Response.json(200, {"status": "ok"})
        message = "Shutting down" if self.shutting_down else "Loading model"
        return unavailable(message).response()

    async def _models(self, request: Request) -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "llmgw-sim",
                "root": self.options.model,
                "parent": None,
                "max_model_len": self.options.max_model_len,
            }
            for name in self.options.served_model_names
        ]
        data += self.loras.model_cards(parent=self.options.served_model_names[0])
        return Response.json(200, {"object": "list", "data": data})

    async def _metrics(self, request: Request) -> Response:
        return Response(
            200, (("content-type", "text/plain; version=0.0.4; charset=utf-8"),), self.batch.prometheus()
        )

    async def _sim_info(self, request: Request) -> Response:
        info = {**self._info(), "ready": self.ready, "requests": self.inference_requests}
        return Response.json(200, {**info, "lora": self.loras.info()})

    # --- LoRA adapters (vLLM's runtime endpoints) -------------------------------------------

    def _json_body(self, request: Request) -> Any:
        try:
            return request.json()
        except InvalidJSON as exc:
            raise ApiError(400, str(exc), code="invalid_json") from None

    def _require_serving(self) -> None:
        # vLLM serves its API (these endpoints too) only once the engine is up
        if not self.ready or self.shutting_down:
            raise unavailable("Shutting down" if self.shutting_down else "Loading model")

    async def _load_lora(self, request: Request) -> Response:
        self._require_serving()
        return Response.text(200, await self.loras.load(self._json_body(request)))

    async def _unload_lora(self, request: Request) -> Response:
        self._require_serving()
        return Response.text(200, self.loras.unload(self._json_body(request)))

    # --- inference --------------------------------------------------------------------------

    async def _admit(self, request: Request) -> tuple[dict[str, Any], Callable[[], object] | None]:
        """Count an inference request, apply fault injection, and parse its body."""
        if not self.ready:
            raise unavailable("Loading model")
        if self.peer_problem is not None:
            await self.peer_problem()
        self.inference_requests += 1
        number = self.inference_requests
        hang_after = self.options.hang_after_requests
        if hang_after is not None and number > hang_after:
            log.info("request %d hangs (--hang-after-requests %d)", number, hang_after)
            await self.batch.hang()
        after = None
        exit_after = self.options.exit_after_requests
        if exit_after is not None and number >= exit_after:
            reason = f"exiting after {number} requests (--exit-after-requests {exit_after})"
            after = lambda: self._exit(1, reason)  # noqa: E731
        oom_after = self.options.oom_after_requests
        if oom_after is not None and number >= oom_after:
            after = self._out_of_memory
        try:
            body = request.json()
        except InvalidJSON as exc:
            raise ApiError(400, str(exc), code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise ApiError(400, "you must provide a model parameter", param="model")
        if model not in self.options.served_model_names and self.loras.hit(model) is None:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return body, after

    async def _chat(self, request: Request) -> Response:
        body, after = await self._admit(request)
        chat = chat_prompt(body)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        prompt, prompt_tokens, answer = chat.prompt, chat.prompt_tokens, chat.answer
        job = _Job.build(self, body, prompt, prompt_tokens, max_tokens, "messages", answer=answer)
        await self.prefill.run(prompt, job.adapter)
        job.start = trio.current_time()  # the first token's clock starts after the prefill
        if job.stream:
            return Response.stream(200, self._chat_chunks(job), after=after)
        await job.wait_until_done()
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": gen.text, "refusal": None, "tool_calls": []},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
            }
            for i, gen in enumerate(job.generations)
        ]
        return Response.json(200, job.envelope("chat.completion", choices, usage=True), after=after)

    async def _chat_chunks(self, job: _Job) -> AsyncIterator[bytes]:
        def chunk(index: int, delta: dict, finish_reason: str | None = None) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return job.sse(job.envelope("chat.completion.chunk", [choice]))

        announced = False
        async for i, token, finish_reason in job.tokens():
            if not announced:  # like vLLM, the role comes with the first token, after prefill
                announced = True
                for choice in range(len(job.generations)):
                    yield chunk(choice, {"role": "assistant", "content": ""})
            yield chunk(i, {"content": token})
            if finish_reason:
                yield chunk(i, {}, finish_reason)
        for tail in job.stream_tail():
            yield tail

    async def _completions(self, request: Request) -> Response:
        body, after = await self._admit(request)
        prompt = body.get("prompt")
        if prompt is None:
            raise ApiError(400, "Missing required parameter: 'prompt'.", param="prompt")
        prompts = prompt_texts(prompt)
        if len(prompts) != 1:
            raise ApiError(400, "this engine takes one prompt per request", param="prompt")
        tokens = count_tokens(prompts[0])
        job = _Job.build(self, body, prompts[0], tokens, body.get("max_tokens"), "prompt", answer=None)
        await self.prefill.run(prompts[0], job.adapter)
        job.start = trio.current_time()  # the first token's clock starts after the prefill
        if job.stream:
            return Response.stream(200, self._completion_chunks(job), after=after)
        await job.wait_until_done()
        choices = [
            {"index": i, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}
            for i, gen in enumerate(job.generations)
        ]
        return Response.json(200, job.envelope("text_completion", choices, usage=True), after=after)

    async def _completion_chunks(self, job: _Job) -> AsyncIterator[bytes]:
        async for i, token, finish_reason in job.tokens():
            choice = {"index": i, "text": token, "logprobs": None, "finish_reason": finish_reason}
            yield job.sse(job.envelope("text_completion", [choice]))
        for tail in job.stream_tail():
            yield tail

    async def _embeddings(self, request: Request) -> Response:
        body, after = await self._admit(request)
        if "input" not in body:
            raise ApiError(400, "Missing required parameter: 'input'.", param="input")
        texts = prompt_texts(body["input"], param="input")
        dimensions = body.get("dimensions") or EMBEDDING_DIMENSIONS
        if not _is_int(dimensions) or dimensions < 1:
            raise ApiError(400, "'dimensions' must be a positive integer", param="dimensions")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise ApiError(400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format")
        data = []
        for i, text in enumerate(texts):
            vector: Any = embed(text, dimensions)
            if encoding == "base64":
                vector = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(count_tokens(text) for text in texts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        payload = {"object": "list", "data": data, "model": body["model"], "usage": usage}
        return Response.json(200, payload, after=after)


@attrs.define
class _Job:
    """One generation request: its parameters, results and token schedule."""

    app: SimApp
    id: str
    model: str
    created: int
    generations: list[Generation]
    prompt_tokens: int
    stream: bool
    include_usage: bool
    start: float
    timing: Timing
    #: the LoRA adapter answering (None: the base model)
    adapter: str | None = None

    @classmethod
    def build(
        cls,
        app: SimApp,
        body: dict,
        prompt: str,
        prompt_tokens: int,
        max_tokens: Any,
        prompt_name: str,
        *,
        answer: str | None,
    ) -> _Job:
        """Validate the sampling parameters of ``body`` and generate the text after ``prompt`` (and a
        chat's ``answer`` begun, see :func:`~llmgw_engine_sim.generate.generate`)."""
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not _is_int(max_tokens) or max_tokens < 1:
            raise ApiError(400, "'max_tokens' must be a positive integer", param="max_tokens")
        limit = app.options.max_model_len
        if limit is not None and prompt_tokens + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_name}, "
                f"{max_tokens} in the completion). Please reduce the length of the {prompt_name} "
                "or completion.",
                param=prompt_name,
                code="context_length_exceeded",
            )
        n = body.get("n") or 1
        if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
            raise ApiError(400, f"'n' must be an integer from 1 to {MAX_CHOICES}", param="n")
        seed = body.get("seed")
        if seed is not None and not _is_int(seed):
            raise ApiError(400, "'seed' must be an integer", param="seed")
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        ignore_eos = body.get("ignore_eos") or False
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, "'ignore_eos' must be a boolean", param="ignore_eos")
        kind = "chatcmpl" if prompt_name == "messages" else "cmpl"
        adapter = None if body["model"] in app.options.served_model_names else body["model"]
        return cls(
            app=app,
            id=f"{kind}-{uuid.uuid4().hex}",
            model=body["model"],
            created=int(time.time()),
            generations=[
                generate(
                    prompt,
                    max_tokens,
                    index=i,
                    seed=seed,
                    answer=answer,
                    ignore_eos=ignore_eos,
                    adapter=adapter,
                )
                for i in range(n)
            ],
            prompt_tokens=prompt_tokens,
            stream=stream,
            include_usage=bool(stream_options.get("include_usage")),
            start=trio.current_time(),
            timing=Timing(trio.current_time()),
            adapter=adapter,
        )

    def due(self, position: int) -> float:
        """When token ``position`` (0-based) is produced, on trio's clock."""
        tps = self.app.options.tokens_per_second
        return self.start + self.app.options.time_to_first_token + (position / tps if tps > 0 else 0.0)

    async def wait_until_done(self) -> None:
        """Produce every token on schedule, until the last of the longest choice."""
        async for _ in self.tokens():
            pass

    async def tokens(self) -> AsyncIterator[tuple[int, str, str | None]]:
        """Yield (choice, token, finish_reason or None) on schedule, position by position.

        The schedule starts once the job has a seat (``--max-num-seqs``); every
        token counts in ``/metrics`` as it is produced, and a LoRA adapter's
        requests in its running and waiting counts.
        """
        batch = self.app.batch
        longest = max(len(gen.tokens) for gen in self.generations)
        counts = self.app.loras.waiting if self.adapter else None
        if counts is not None:
            counts[self.adapter] += 1
        try:
            async with batch.seat(self.timing):
                if counts is not None:
                    counts[self.adapter] -= 1
                    counts = self.app.loras.running
                    counts[self.adapter] += 1
                self.start = trio.current_time()
                batch.prompt(self.prompt_tokens)
                for position in range(longest):
                    await trio.sleep_until(self.due(position))
                    for i, gen in enumerate(self.generations):
                        if position < len(gen.tokens):
                            last = position == len(gen.tokens) - 1
                            batch.token(self.timing)
                            yield i, gen.tokens[position], gen.finish_reason if last else None
                batch.finished(self.timing, self.generations[-1].finish_reason)
        finally:
            if counts is not None:
                counts[self.adapter] -= 1

    def usage(self) -> dict[str, int]:
        """OpenAI's usage counts for this job."""
        completion = sum(len(gen.tokens) for gen in self.generations)
        total = self.prompt_tokens + completion
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion, "total_tokens": total}

    def envelope(self, kind: str, choices: list[dict], *, usage: bool = False) -> dict[str, Any]:
        """A response or chunk object of ``kind`` around ``choices``."""
        payload = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        payload["choices"] = choices
        if usage:
            payload["usage"] = self.usage()
        elif self.include_usage:
            payload["usage"] = None
        return payload

    def sse(self, payload: dict[str, Any]) -> bytes:
        """``payload`` as one server-sent event."""
        return b"data: " + Response.json(200, payload).body + b"\n\n"

    def stream_tail(self) -> list[bytes]:
        """The events after the last token: usage if asked for, then ``[DONE]``."""
        tail = []
        if self.include_usage:
            kind = "chat.completion.chunk" if self.id.startswith("chatcmpl") else "text_completion"
            tail.append(self.sse({**self.envelope(kind, []), "usage": self.usage()}))
        tail.append(b"data: [DONE]\n\n")
        return tail


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
