"""The simulated engine's LoRA adapters, served as vLLM serves them.

Flags as vLLM's: ``--enable-lora``, ``--max-loras N`` (default 1), ``--max-lora-rank R`` (default 16), and the
sim's own ``--lora-load-time SECONDS`` (default 0.5), the time a load takes to read the adapter's weights.

Endpoints as vLLM's runtime LoRA updating (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``):

- ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``: 200 ``Success: LoRA adapter 'NAME' added
  successfully.`` (plain text) once the adapter is loaded; the server keeps serving meanwhile.
- ``POST /v1/unload_lora_adapter {"lora_name"}``: 200 ``Success: LoRA adapter 'NAME' removed successfully.``

Errors in vLLM's shape, ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the status:

- 400 ``InvalidUserInput``: a field missing (``Both 'lora_name' and 'lora_path' must be provided.``), a name
  already loaded (``The lora adapter 'NAME' has already been loaded. ...``; a second load of a name being
  loaded waits for the first, as vLLM's per-name lock makes it), a name that is a served base model's.
- 404 ``NotFoundError``: load from a path that does not exist (``Loading lora NAME failed: No adapter found
  for PATH``), unload of a name not loaded (``The lora adapter 'NAME' cannot be found.``).
- 400 ``BadRequestError``: the adapter is unreadable: ``adapter_config.json`` missing or not JSON, its
  ``peft_type`` not ``LORA``, its ``r`` not a positive integer or above ``--max-lora-rank`` (vLLM's words:
  ``LoRA rank R is greater than max_lora_rank M.``), no ``adapter_model.safetensors``. Each message starts
  ``Loading lora NAME failed:`` and names the file.
- 409 ``SlotsFullError`` (**a sim choice**): every one of the ``--max-loras`` slots is taken (loaded, or
  being loaded). vLLM itself has no such limit on runtime loads: it registers any number of adapters,
  ``--max-loras`` bounds the adapters *in one batch* (requests for others wait) and ``--max-cpu-loras`` the
  ones kept in CPU memory, least recently used evicted and read from disk again on next use. The sim makes
  ``--max-loras`` a hard slot limit so that what llmgw must manage (a replica's ``max_adapters``) shows.
- 400 ``BadRequestError`` when the sim runs without ``--enable-lora``.
- 503 before the sim is ready (``--startup-delay``) and while it shuts down, as every inference endpoint.

A request whose ``model`` is a loaded adapter is answered by that adapter: text generated as the base
model's is (deterministic and continuation-safe) with the adapter's name in the hash, so it differs from
the base model's and every other adapter's. An adapter not loaded (or still loading) is a model that does
not exist: 404, as vLLM answers. ``/v1/models`` lists each loaded adapter after the base model, with
``root`` its path and ``parent`` the base model's served name.

Metrics: vLLM's ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}``, whose
value is the time of the scrape and whose labels list (comma-separated) the adapters with requests running
and waiting; and the sim's own ``sim:lora_loaded{lora_name}`` (1 per loaded adapter),
``sim:lora_requests_total{lora_name}`` (requests admitted per adapter: its hits),
``sim:lora_loads_total{result}`` (``loaded``, ``failed``, ``full``), ``sim:lora_unloads_total`` and
``sim:lora_slots`` (``--max-loras``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import attrs
import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw_engine_sim.errors import ApiError
from llmgw_engine_sim.lora_options import LoraOptions

__all__ = ["Adapter", "LoraOptions", "Loras", "read_adapter"]

log = logging.getLogger("llmgw_engine_sim")

#: the files of a PEFT LoRA adapter directory
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@attrs.frozen
class AdapterFiles:
    """What an adapter directory's ``adapter_config.json`` says."""

    rank: int
    base_model: str | None


def _failed(status: int, name: str, reason: str) -> ApiError:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return ApiError(status, f"Loading lora {name} failed: {reason}", kind=kind, code=status)


def read_adapter(name: str, path: str, max_rank: int) -> AdapterFiles:
    """Read and check the configuration of adapter ``name`` in directory ``path``.

    Called at the start of a load, before the load time. Raises :class:`ApiError` (404 for a path that
    does not exist, else 400) naming the adapter and the reason; the weights are checked after the load
    time by :func:`check_weights`.
    """
    if not os.path.isdir(path):
        raise _failed(404, name, f"No adapter found for {path}")
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_path, encoding="utf-8") as file:
            config = json.load(file)
    except FileNotFoundError:
        raise _failed(400, name, f"no {CONFIG_FILE} in {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _failed(400, name, f"cannot read {config_path}: {exc}") from None
    if not isinstance(config, dict):
        raise _failed(400, name, f"{config_path} is not a JSON object")
    peft_type = config.get("peft_type")
    if peft_type is not None and peft_type != "LORA":
        raise _failed(400, name, f"{config_path}: peft_type is {peft_type!r}, not 'LORA'")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _failed(400, name, f"{config_path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _failed(400, name, f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
    base = config.get("base_model_name_or_path")
    return AdapterFiles(rank=rank, base_model=base if isinstance(base, str) else None)


def check_weights(name: str, path: str) -> None:
    """Check that adapter ``name`` has its weights file in ``path``; raises a 400 :class:`ApiError` if not.

    Called at the end of a load, after the load time (the weights are what takes the time to read).
    """
    weights = os.path.join(path, WEIGHTS_FILE)
    try:
        size = os.path.getsize(weights)
    except OSError:
        raise _failed(400, name, f"{path} doesn't contain tensors (no {WEIGHTS_FILE})") from None
    if size < 8:
        raise _failed(400, name, f"{weights} is not a safetensors file ({size} bytes)")


@attrs.define
class Adapter:
    """One loaded adapter."""

    name: str
    path: str
    rank: int
    base_model: str | None
    #: wall-clock time the load finished
    loaded_at: float
    #: requests admitted for it since it was loaded
    requests: int = 0
    #: wall-clock time of its last request (None: none yet)
    last_used: float | None = None

    def info(self) -> dict[str, Any]:
        """The adapter as ``/sim/info`` shows it."""
        return attrs.asdict(self)


class Loras:
    """The adapters of one replica: loaded, being loaded, and their counts.

    :param base_names: the served names of the base model (an adapter may not take one).
    """

    def __init__(self, options: LoraOptions, base_names: tuple[str, ...]) -> None:
        self.options = options
        self.base_names = base_names
        self.loaded: dict[str, Adapter] = {}
        #: name -> set when its load ends (either way)
        self.loading: dict[str, trio.Event] = {}
        self.hits: Counter[str] = Counter()
        self.loads: Counter[str] = Counter({"loaded": 0, "failed": 0, "full": 0})
        self.unloads = 0
        #: adapter -> requests running / waiting for a seat
        self.running: Counter[str] = Counter()
        self.waiting: Counter[str] = Counter()

    def _require_enabled(self) -> None:
        if not self.options.enabled:
            raise ApiError(
                400,
                "LoRA is not enabled: start llmgw-sim with --enable-lora",
                kind="BadRequestError",
                code=400,
            )

    async def load(self, body: Any) -> str:
        """Load the adapter a ``/v1/load_lora_adapter`` body names; called by that endpoint.

        Waits ``--lora-load-time`` (serving other requests meanwhile). :returns: vLLM's success text;
        raises :class:`ApiError` with vLLM's status and message on failure (see the module's docstring).
        """
        self._require_enabled()
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", kind="InvalidUserInput", code=400)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise ApiError(
                400, "Both 'lora_name' and 'lora_path' must be provided.", kind="InvalidUserInput", code=400
            )
        if name in self.base_names:
            raise ApiError(
                400,
                f"The lora adapter name '{name}' conflicts with a served base model.",
                kind="InvalidUserInput",
                param="lora_name",
                code=400,
            )
        while name in self.loading:  # vLLM's per-name lock: a second load waits for the first
            await self.loading[name].wait()
        if name in self.loaded:
            raise ApiError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                "place, set 'load_inplace' to True.",
                kind="InvalidUserInput",
                param="lora_name",
                code=400,
            )
        taken = len(self.loaded) + len(self.loading)
        if taken >= self.options.max_loras:
            self.loads["full"] += 1
            raise ApiError(
                409,
                f"Cannot load lora {name}: all {self.options.max_loras} LoRA slots are taken "
                f"(--max-loras {self.options.max_loras}; loaded: {', '.join(self.loaded) or 'none'}"
                f"{'; loading: ' + ', '.join(self.loading) if self.loading else ''}); unload one first",
                kind="SlotsFullError",
                param="lora_name",
                code=409,
            )
        done = self.loading[name] = trio.Event()
        try:
            files = read_adapter(name, path, self.options.max_lora_rank)
            log.info("loading LoRA adapter %s from %s (rank %d)", name, path, files.rank)
            await trio.sleep(self.options.load_time)
            check_weights(name, path)
        except ApiError as error:
            self.loads["failed"] += 1
            log.warning("LoRA adapter %s failed to load: %s", name, error.message)
            raise
        finally:
            del self.loading[name]
            done.set()
        self.loaded[name] = Adapter(name, path, files.rank, files.base_model, loaded_at=time.time())
        self.loads["loaded"] += 1
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: Any) -> str:
        """Unload the adapter a ``/v1/unload_lora_adapter`` body names; called by that endpoint.

        Requests already running on it finish. :returns: vLLM's success text; raises :class:`ApiError`
        (404 when the adapter is not loaded).
        """
        self._require_enabled()
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not name or not isinstance(name, str):
            raise ApiError(
                400,
                "either 'lora_name' and 'lora_int_id' needs to be provided.",
                kind="InvalidUserInput",
                code=400,
            )
        if name not in self.loaded:
            raise ApiError(
                404,
                f"The lora adapter '{name}' cannot be found.",
                kind="NotFoundError",
                param="lora_name",
                code=404,
            )
        del self.loaded[name]
        self.unloads += 1
        log.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def hit(self, name: str) -> Adapter | None:
        """The loaded adapter ``name``, counted as used now; None when no adapter of that name is loaded.

        Called for every inference request whose model is not a base model's served name.
        """
        adapter = self.loaded.get(name)
        if adapter is not None:
            adapter.requests += 1
            adapter.last_used = time.time()
            self.hits[name] += 1
        return adapter

    def model_cards(self, parent: str) -> list[dict[str, Any]]:
        """The loaded adapters as ``/v1/models`` lists them after the base model, as vLLM does: ``root`` the
        adapter's path, ``parent`` the base model's served name."""
        return [
            {
                "id": adapter.name,
                "object": "model",
                "created": int(adapter.loaded_at),
                "owned_by": "llmgw-sim",
                "root": adapter.path,
                "parent": parent,
                "max_model_len": None,
            }
            for adapter in self.loaded.values()
        ]

    def info(self) -> dict[str, Any]:
        """The adapters as ``/sim/info`` shows them."""
        return {
            "enabled": self.options.enabled,
            "max_loras": self.options.max_loras,
            "max_lora_rank": self.options.max_lora_rank,
            "load_time": self.options.load_time,
            "loaded": [adapter.info() for adapter in self.loaded.values()],
            "loading": list(self.loading),
        }

    def describe(self) -> list[Metric]:
        """Nothing: the metrics are read when scraped (prometheus_client's custom collector protocol)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The LoRA metrics, as scraped now (nothing without ``--enable-lora``, as vLLM)."""
        if not self.options.enabled:
            return
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        running = ",".join(name for name, n in self.running.items() if n > 0)
        waiting = ",".join(name for name, n in self.waiting.items() if n > 0)
        info.add_metric([str(self.options.max_loras), running, waiting], time.time())
        yield info
        loaded = GaugeMetricFamily("sim:lora_loaded", "LoRA adapters loaded (1 each).", labels=["lora_name"])
        for name in self.loaded:
            loaded.add_metric([name], 1)
        yield loaded
        hits = CounterMetricFamily(
            "sim:lora_requests", "Inference requests admitted per LoRA adapter.", labels=["lora_name"]
        )
        for name, count in self.hits.items():
            hits.add_metric([name], count)
        yield hits
        loads = CounterMetricFamily(
            "sim:lora_loads", "LoRA adapter loads by result (loaded, failed, full).", labels=["result"]
        )
        for result, count in self.loads.items():
            loads.add_metric([result], count)
        yield loads
        yield CounterMetricFamily("sim:lora_unloads", "LoRA adapters unloaded.", value=self.unloads)
        yield GaugeMetricFamily(
            "sim:lora_slots", "LoRA adapter slots (--max-loras).", value=self.options.max_loras
        )
