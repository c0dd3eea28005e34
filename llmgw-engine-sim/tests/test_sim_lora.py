"""LoRA adapters on a real llmgw-sim: vLLM's load/unload endpoints, slots, errors, answers and metrics."""

from __future__ import annotations

import json
import struct
import threading
import time

import attrs
import httpx
import pytest
from llmgw_engine_sim import SimEngine

from llmgw.models import LaunchSpec, LoraSpec
from llmgw.testing.lora import make_sim_adapter
from llmgw.testing.metrics import samples
from llmgw.testing.processes import wait_until

BASE = "base-model"


def post(sim, path: str, body: dict, timeout: float = 10) -> httpx.Response:
    return httpx.post(f"{sim.url}{path}", json=body, timeout=timeout)


def load(sim, name: str, path, timeout: float = 10) -> httpx.Response:
    return post(sim, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, timeout)


def unload(sim, name: str) -> httpx.Response:
    return post(sim, "/v1/unload_lora_adapter", {"lora_name": name})


def complete(sim, model: str, prompt: str = "tell me about the fleet", **extra) -> httpx.Response:
    return post(sim, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12, **extra})


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def error(response: httpx.Response) -> dict:
    """The ``error`` object of a vLLM-shaped error answer."""
    return response.json()["error"]


def in_thread(results: list, call) -> threading.Thread:
    """Start ``call()`` in a thread that appends its result, or the exception it raised, to ``results``."""

    def run() -> None:
        try:
            results.append(call())
        except Exception as exc:  # the sim was ended under it: the test says what it expected
            results.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def model_ids(sim) -> dict[str, dict]:
    data = httpx.get(f"{sim.url}/v1/models", timeout=5).json()["data"]
    return {card["id"]: card for card in data}


def sim_info(sim) -> dict:
    return httpx.get(f"{sim.url}/sim/info", timeout=5).json()


def loading(sim) -> list[str]:
    """The adapters the sim is loading now."""
    return sim_info(sim)["lora"]["loading"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Adapter directories: three good ones of rank 8, and broken ones."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": make_sim_adapter(root / "sql", base=BASE),
        "chat": make_sim_adapter(root / "chat", base=BASE),
        "poem": make_sim_adapter(root / "poem", base=BASE),
        "big": make_sim_adapter(root / "big", rank=32),
        "no-weights": make_sim_adapter(root / "no-weights", weights=False),
        "bad-config": make_sim_adapter(root / "bad-config", config="{not json"),
        "not-lora": make_sim_adapter(root / "not-lora", peft_type="PREFIX_TUNING"),
        "missing": root / "does-not-exist",
    }


@pytest.fixture
def sim(start_sim):
    """A ready sim serving BASE with LoRA on: 2 slots, rank up to 16, loads of 0.2 s."""
    sim = start_sim(
        "--served-model-name", BASE, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-load-time", "0.2",
    )  # fmt: skip
    sim.wait_ready()
    return sim


class TestLoadAndServe:
    """An adapter loaded at run time answers requests naming it, as vLLM's does."""

    def test_load_lists_and_answers(self, sim, adapters):
        """A load answers vLLM's success text; /v1/models lists the adapter under its base; it answers."""
        response = load(sim, "sql", adapters["sql"])
        assert response.status_code == 200
        assert response.text == "Success: LoRA adapter 'sql' added successfully."
        cards = model_ids(sim)
        assert cards["sql"]["parent"] == BASE and cards["sql"]["root"] == str(adapters["sql"])
        assert cards[BASE]["parent"] is None
        answer = complete(sim, "sql")
        assert answer.json()["model"] == "sql"
        assert text(answer)

    def test_each_adapter_says_something_else(self, sim, adapters):
        """One prompt gets different text from the base model and each adapter, the same every time."""
        load(sim, "sql", adapters["sql"])
        load(sim, "chat", adapters["chat"])
        base, sql, chat = text(complete(sim, BASE)), text(complete(sim, "sql")), text(complete(sim, "chat"))
        assert len({base, sql, chat}) == 3
        assert text(complete(sim, "sql")) == sql

    def test_adapter_answers_are_continuation_safe(self, sim, adapters):
        """A completion prompt ending with an adapter's first words is continued with its next words."""
        load(sim, "sql", adapters["sql"])
        prompt = "one two three"
        whole = text(complete(sim, "sql", prompt, ignore_eos=True))
        words = whole.split()
        head = " " + " ".join(words[:4])
        rest = text(complete(sim, "sql", prompt + head, max_tokens=8, ignore_eos=True))
        assert (head + rest).split() == words

    def test_chat_with_an_adapter(self, sim, adapters):
        """Chat completions take the adapter as model too, and differ from the base model's."""
        load(sim, "chat", adapters["chat"])
        body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 10}
        answers = {}
        for model in (BASE, "chat"):
            response = post(sim, "/v1/chat/completions", {**body, "model": model})
            assert response.status_code == 200, response.text
            answers[model] = response.json()["choices"][0]["message"]["content"]
        assert answers[BASE] != answers["chat"]

    def test_unknown_adapter_is_a_model_that_does_not_exist(self, sim, adapters):
        """A request naming an adapter that is not loaded gets vLLM's 404."""
        response = complete(sim, "sql")
        assert response.status_code == 404
        assert error(response)["message"] == "The model `sql` does not exist."

    def test_unload(self, sim, adapters):
        """An unloaded adapter answers no more and leaves /v1/models; unloading it again is a 404."""
        load(sim, "sql", adapters["sql"])
        response = unload(sim, "sql")
        assert response.status_code == 200
        assert response.text == "Success: LoRA adapter 'sql' removed successfully."
        assert "sql" not in model_ids(sim)
        assert complete(sim, "sql").status_code == 404
        again = unload(sim, "sql")
        assert again.status_code == 404
        assert error(again) == {
            "message": "The lora adapter 'sql' cannot be found.",
            "type": "NotFoundError",
            "param": "lora_name",
            "code": 404,
        }

    def test_load_twice(self, sim, adapters):
        """Loading a name already loaded is vLLM's 400, naming the adapter."""
        load(sim, "sql", adapters["sql"])
        response = load(sim, "sql", adapters["chat"])
        assert response.status_code == 400
        assert error(response)["type"] == "InvalidUserInput"
        assert error(response)["message"].startswith("The lora adapter 'sql' has already been loaded.")

    def test_name_of_the_base_model(self, sim, adapters):
        """An adapter may not take the base model's served name."""
        response = load(sim, BASE, adapters["sql"])
        assert response.status_code == 400
        assert "conflicts with a served base model" in error(response)["message"]

    def test_fields_required(self, sim):
        """A load without lora_path is refused with vLLM's message."""
        response = post(sim, "/v1/load_lora_adapter", {"lora_name": "x"})
        assert response.status_code == 400
        assert error(response)["message"] == "Both 'lora_name' and 'lora_path' must be provided."


class TestSlots:
    """--max-loras is a hard slot limit in the sim: a load when all are taken is a 409."""

    def test_full_then_room_after_an_unload(self, sim, adapters):
        """Two slots taken: a third load is refused, naming the slots and holders; an unload frees one."""
        assert load(sim, "sql", adapters["sql"]).status_code == 200
        assert load(sim, "chat", adapters["chat"]).status_code == 200
        full = load(sim, "poem", adapters["poem"])
        assert full.status_code == 409
        message = error(full)["message"]
        assert "poem" in message and "all 2 LoRA slots are taken" in message and "sql, chat" in message
        assert error(full)["type"] == "SlotsFullError"
        assert unload(sim, "sql").status_code == 200
        assert load(sim, "poem", adapters["poem"]).status_code == 200
        assert set(model_ids(sim)) == {BASE, "chat", "poem"}

    def test_a_load_in_progress_holds_its_slot(self, start_sim, adapters):
        """While one load runs, it takes a slot: with one slot, a second load is refused at once."""
        sim = start_sim("--enable-lora", "--max-loras", "1", "--lora-load-time", "30")
        sim.wait_ready()
        results: list[httpx.Response] = []
        thread = in_thread(results, lambda: load(sim, "sql", adapters["sql"], 60))
        try:
            wait_until(lambda: loading(sim) == ["sql"], 10, "the load to start", sim.process)
            second = load(sim, "chat", adapters["chat"])
            assert second.status_code == 409
            assert "loading: sql" in error(second)["message"]
        finally:
            sim.process.kill_group()
            thread.join(timeout=30)


class TestLoadTime:
    """A load takes --lora-load-time; the server keeps serving meanwhile."""

    def test_serves_others_while_loading(self, start_sim, adapters):
        """During a 3 s load the base model and a loaded adapter answer; the loading one is not there yet."""
        sim = start_sim("--enable-lora", "--max-loras", "2", "--lora-load-time", "3")
        sim.wait_ready()
        started = time.monotonic()
        assert load(sim, "sql", adapters["sql"]).status_code == 200
        assert time.monotonic() - started >= 3
        results: list[httpx.Response] = []
        started = time.monotonic()
        thread = in_thread(results, lambda: load(sim, "chat", adapters["chat"], 30))
        try:
            wait_until(lambda: loading(sim) == ["chat"], 10, "the load to start", sim.process)
            assert text(complete(sim, "test/model"))
            assert text(complete(sim, "sql"))
            assert complete(sim, "chat").status_code == 404
            assert loading(sim) == ["chat"], "the load ended before the checks did"
        finally:
            thread.join(timeout=30)
        assert results and isinstance(results[0], httpx.Response) and results[0].status_code == 200
        assert time.monotonic() - started >= 3
        assert text(complete(sim, "chat"))


class TestLoadFailures:
    """A load that fails says which adapter and why, in vLLM's words, and the server serves on."""

    @pytest.mark.parametrize(
        "which, status, words",
        [
            ("missing", 404, "No adapter found for"),
            ("big", 400, "LoRA rank 32 is greater than max_lora_rank 16."),
            ("bad-config", 400, "cannot read"),
            ("not-lora", 400, "peft_type is 'PREFIX_TUNING', not 'LORA'"),
            ("no-weights", 400, "doesn't contain tensors (no adapter_model.safetensors)"),
        ],
    )
    def test_refused(self, sim, adapters, which, status, words):
        """The load is refused with the adapter's name and the reason; the base model still answers."""
        response = load(sim, which, adapters[which])
        assert response.status_code == status, response.text
        message = error(response)["message"]
        assert message.startswith(f"Loading lora {which} failed:") and words in message
        assert error(response)["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
        assert which not in model_ids(sim)
        assert text(complete(sim, BASE))
        assert load(sim, "sql", adapters["sql"]).status_code == 200, "a failed load must free its slot"

    def test_not_before_ready(self, start_sim, adapters):
        """While the model loads (/health 503), a load is a 503 too, as the engine's API is not up yet."""
        sim = start_sim("--enable-lora", "--startup-delay", "30")
        wait_until(lambda: sim.health() == 503, 10, "the sim to answer 503", sim.process)
        assert load(sim, "sql", adapters["sql"]).status_code == 503

    def test_lora_not_enabled(self, start_sim, adapters):
        """Without --enable-lora a load is refused, saying how to enable it."""
        sim = start_sim()
        sim.wait_ready()
        response = load(sim, "sql", adapters["sql"])
        assert response.status_code == 400
        assert "--enable-lora" in error(response)["message"]


class TestMetrics:
    """Loads and hits can be read at /metrics: vLLM's lora_requests_info and the sim's counters."""

    def test_loads_and_hits(self, sim, adapters):
        """Two loads, a refused one and three requests for one adapter show in the metrics."""
        load(sim, "sql", adapters["sql"])
        load(sim, "chat", adapters["chat"])
        load(sim, "poem", adapters["poem"])
        load(sim, "big", adapters["big"])
        for _ in range(3):
            text(complete(sim, "sql"))
        exposition = httpx.get(f"{sim.url}/metrics", timeout=5).text
        [(labels, value)] = samples(exposition, "vllm:lora_requests_info")
        assert labels["max_lora"] == "2" and abs(value - time.time()) < 60
        assert labels["running_lora_adapters"] == labels["waiting_lora_adapters"] == ""
        loaded = {lab["lora_name"] for lab, v in samples(exposition, "sim:lora_loaded") if v == 1}
        assert loaded == {"sql", "chat"}
        hits = {lab["lora_name"]: v for lab, v in samples(exposition, "sim:lora_requests_total")}
        assert hits == {"sql": 3}
        loads = {lab["result"]: v for lab, v in samples(exposition, "sim:lora_loads_total")}
        assert loads == {"loaded": 2, "failed": 0, "full": 2}
        [(_, slots)] = samples(exposition, "sim:lora_slots")
        assert slots == 2
        info = {a["name"]: a for a in sim_info(sim)["lora"]["loaded"]}
        assert info["sql"]["requests"] == 3 and info["sql"]["rank"] == 8 and info["chat"]["last_used"] is None

    def test_running_adapters_are_labelled(self, start_sim, adapters):
        """While a slow request runs on an adapter, lora_requests_info lists it as running."""
        sim = start_sim("--enable-lora", "--lora-load-time", "0", "--tokens-per-second", "2")
        sim.wait_ready()
        load(sim, "sql", adapters["sql"])
        thread = in_thread([], lambda: complete(sim, "sql", max_tokens=60, ignore_eos=True))
        try:

            def running() -> bool:
                exposition = httpx.get(f"{sim.url}/metrics", timeout=5).text
                return samples(exposition, "vllm:lora_requests_info")[0][0]["running_lora_adapters"] == "sql"

            wait_until(running, 10, "sql to be listed as running", sim.process)
        finally:
            sim.process.kill_group()
            thread.join(timeout=30)

    def test_no_lora_metrics_without_lora(self, start_sim):
        """A sim without --enable-lora exports no LoRA metrics, as vLLM."""
        sim = start_sim()
        sim.wait_ready()
        assert "lora" not in httpx.get(f"{sim.url}/metrics", timeout=5).text


class TestThroughTheEngine:
    """SimEngine's command and calls, sent to the process they start."""

    def test_engine_command_and_calls(self, processes, adapters, sim_program):
        """The command built from a LoraSpec serves adapters; lora_load and lora_unload calls work on it."""
        from llmgw.testing.processes import free_port

        engine = SimEngine()
        spec = LaunchSpec(
            model_source="test/model",
            served_name=BASE,
            host="127.0.0.1",
            port=free_port("127.0.0.1"),
            gpus=(),
            executables={"llmgw-sim": sim_program},
            lora=LoraSpec(max_loaded=1, max_rank=8),
        )
        command = engine.build_command(spec)
        argv = list(command.argv)
        assert argv[argv.index("--max-loras") + 1] == "1" and argv[argv.index("--max-lora-rank") + 1] == "8"
        assert "--enable-lora" in argv
        process = processes.start([*argv, "--lora-load-time", "0.1"], name="sim")
        url = f"http://{spec.host}:{spec.port}"
        wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 10, "sim ready", process)

        def send(call) -> httpx.Response:
            return httpx.request(call.method, url + call.path, json=call.body, timeout=call.timeout)

        assert send(engine.lora_load("sql", str(adapters["sql"]))).status_code == 200
        assert send(engine.lora_load("chat", str(adapters["chat"]))).status_code == 409
        field = engine.lora_request_fields("sql", BASE, ["sql", "chat"])
        body = {"model": BASE, "prompt": "hi", "max_tokens": 3, **field}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=10).json()["model"] == "sql"
        assert send(engine.lora_unload("sql")).status_code == 200
        assert send(engine.lora_unload("sql")).status_code == 404
        rank_16 = attrs.evolve(spec, lora=LoraSpec(max_loaded=1, max_rank=16))
        assert "16" in engine.build_command(rank_16).argv


class TestAdapterHelper:
    """make_sim_adapter writes what a PEFT fine-tune leaves on disk."""

    def test_files(self, tmp_path):
        """A PEFT config with the rank and base, and a safetensors file whose header matches its data."""
        folder = make_sim_adapter(tmp_path / "a", rank=4, base=BASE)
        config = json.loads((folder / "adapter_config.json").read_text())
        assert (config["peft_type"], config["r"], config["base_model_name_or_path"]) == ("LORA", 4, BASE)
        data = (folder / "adapter_model.safetensors").read_bytes()
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        tensors = {name: t for name, t in header.items() if name != "__metadata__"}
        assert tensors and all(t["dtype"] == "F32" and 4 in t["shape"] for t in tensors.values())
        end = max(t["data_offsets"][1] for t in tensors.values())
        assert len(data) == 8 + size + end
        assert (
            make_sim_adapter(tmp_path / "b", rank=4, base=BASE)
            .joinpath("adapter_model.safetensors")
            .read_bytes()
            == data
        ), "the same arguments write the same bytes"

    def test_bad_rank(self, tmp_path):
        """A rank below 1 is refused, naming it."""
        with pytest.raises(ValueError, match="rank must be >= 1"):
            make_sim_adapter(tmp_path / "a", rank=0)
