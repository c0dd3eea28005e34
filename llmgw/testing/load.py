"""Clients sending chat completions through a gateway, pausing only after a failure, counting every outcome.

Used by the end-to-end tests and the benchmarks that change a cluster under
load (drains, rollouts, removals) and then check that no request failed::

    with GatewayLoad(cluster.gateway_url, 32, models=["chat", "big"]) as load:
        load.wait_served(64)
        ...  # drain, apply, roll
    assert load.failures == [], load.report()

Half the clients stream (even-numbered ones); clients are spread over the
models in turn. A request counts as failed when the answer is not 200, a
non-streamed answer has no content, a stream ends without ``[DONE]`` or
carries an error event, the connection fails, or a 200's body is garbled
(not the JSON of a completion). Every request is also kept
as an :class:`Answer` (which replica answered, when, streamed or not) for
tests that check where requests went.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import select
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import httpx
import yaml

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.chat import chat_body
from llmgw.testing.processes import free_port

__all__ = ["Answer", "GatewayLoad", "gateway_models", "ready_cluster", "routed_cluster"]

#: seconds a client waits after a failed request before its next one
FAILURE_PAUSE = 0.05


@attrs.frozen
class Answer:
    """One request of a :class:`GatewayLoad`: how it went and which replica answered."""

    model: str
    stream: bool
    #: the ``x-llmgw-replica`` header of the answer; "" when there was none (no answer, or a refusal)
    replica: str
    #: ``time.time()`` when the request was sent and when its answer ended
    began: float
    ended: float
    #: what went wrong, as in :attr:`GatewayLoad.failures`; None when it succeeded
    failure: str | None


def gateway_models(url: str) -> list[str] | None:
    """The model names ``GET url/v1/models`` lists, sorted, LoRA adapters (entries with a ``parent``) left
    out; None when the gateway does not answer 200."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=2)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return sorted(m["id"] for m in response.json()["data"] if "parent" not in m)


@contextlib.contextmanager
def ready_cluster(
    root: Path,
    catalog: str,
    *,
    nodes: int = 2,
    fabric: str | None | object = ...,
    gateway: Sequence[str] | None = None,
    sim: str | None = None,
    lost_after: float = 10,
    store: str | None = None,
    metrics_port: int | None = None,
) -> Iterator[LocalCluster]:
    """A server and ``nodes`` agents running every replica of ``catalog``; all stopped after.

    Called by end-to-end tests and benchmarks to set up the cluster they act on. ``catalog`` names its models'
    sources ``{models}/NAME``: the directories are made under ``root/models``. Yields once every replica the
    catalog asks for is ready and, with a gateway, the gateway lists every model.

    :param fabric: every node's fabric (None: islands); by default as :func:`LocalCluster.start` says.
    :param gateway: start a gateway with these more ``llmgw gateway`` options (None: no gateway).
    :param sim: the sim program (see :class:`LocalCluster`).
    :param store: the server's ``--store`` (None: sqlite in its state folder).
    :param metrics_port: the server's ``--metrics-listen`` port, agents' the next (see :class:`LocalCluster`).
    """
    cluster = LocalCluster(
        root / "cluster", server_port=free_port(), lost_after=lost_after, poll_timeout=1, sim=sim, store=store
    )
    cluster.metrics_port = metrics_port
    for name in re.findall(r"\{models\}/([\w.-]+)", catalog):
        (root / "models" / name).mkdir(parents=True, exist_ok=True)
    catalog = catalog.format(models=root / "models")
    counts = [model.get("replicas", 1) for model in yaml.safe_load(catalog)["models"].values()]
    wanted = sum(c["min"] if isinstance(c, dict) else c for c in counts)  # an autoscaled model: its min
    try:
        cluster.start(nodes, fabric=fabric)
        if gateway is not None:
            cluster.start_gateway(free_port(), extra=gateway)
        cluster.apply(catalog)
        ready = lambda: cluster.all_ready() and len(cluster.replicas().replicas) == wanted  # noqa: E731
        cluster.wait(ready, f"the {wanted} replicas of the catalog to be ready")
        if gateway is not None:
            models = sorted({r.model for r in cluster.replicas().replicas})
            routed = lambda: gateway_models(cluster.gateway_url) == models  # noqa: E731
            cluster.wait(routed, f"the gateway to route {models}", 30)
        yield cluster
    finally:
        cluster.stop_all()


def routed_cluster(
    root: Path, catalog: str, *, gateway: Sequence[str] = (), **options
) -> AbstractContextManager[LocalCluster]:
    """:func:`ready_cluster` with a gateway (given more options in ``gateway``) routing every model."""
    return ready_cluster(root, catalog, gateway=gateway, **options)


class GatewayLoad:
    """``clients`` threads sending requests to ``url`` until stopped (a context manager)."""

    def __init__(
        self, url: str, clients: int, *, models: Iterable[str] = ("chat",), max_tokens: int = 8
    ) -> None:
        self.url = url.rstrip("/")
        self.models = list(models)
        self.max_tokens = max_tokens
        self.stop = threading.Event()
        #: model -> set once its clients should send no new request
        self._stopped_models: dict[str, threading.Event] = {m: threading.Event() for m in self.models}
        #: requests that succeeded, per model
        self.served: Counter[str] = Counter()
        #: one line per failed request: ``model: what went wrong``
        self.failures: list[str] = []
        #: every request that ended, in the order they ended
        self.answers: list[Answer] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(
                target=self._run, args=(self.models[i % len(self.models)], (i // len(self.models)) % 2 == 0)
            )
            for i in range(clients)
        ]
        for thread in self.threads:
            thread.daemon = True

    @property
    def ok(self) -> int:
        """Requests that succeeded so far, every model together."""
        with self.lock:
            return sum(self.served.values())

    def counts(self) -> tuple[int, int]:
        """(succeeded, failed) so far."""
        with self.lock:
            return sum(self.served.values()), len(self.failures)

    def stop_model(self, model: str) -> None:
        """Send no new request to ``model``; requests in flight run to their end (and are counted)."""
        self._stopped_models[model].set()

    def wait_served(
        self, more: int, timeout: float = 60.0, *, check: Callable[[], object] = lambda: None
    ) -> None:
        """Return once ``more`` requests succeeded after this call; raise AssertionError after ``timeout``.

        :param check: called while waiting (a cluster's ``check``, which raises when a process died).
        """
        target = self.ok + more
        deadline = time.monotonic() + timeout
        while self.ok < target:
            check()
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{more} more requests did not succeed within {timeout:g} s: {self.report()}"
                )
            time.sleep(0.1)

    def report(self) -> str:
        """What a failed assertion prints: counts per model and the first failures."""
        with self.lock:
            served = ", ".join(f"{model} {count}" for model, count in sorted(self.served.items()))
            return f"{len(self.failures)} failed, served {served or 'none'}: {self.failures[:5]}"

    def _run(self, model: str, stream: bool) -> None:
        body = json.dumps(chat_body(model, "hello", self.max_tokens, stream=stream)).encode()
        stopped = self._stopped_models[model]
        target = urlsplit(self.url)
        connection = _Connection(target.hostname or "127.0.0.1", target.port or 80, timeout=30)
        path = f"{target.path}/v1/chat/completions"
        try:
            while not (self.stop.is_set() or stopped.is_set()):
                began, replica = time.time(), [""]
                try:
                    outcome = self._one(connection, path, body, stream, replica)
                except (http.client.HTTPException, OSError) as exc:
                    connection.close()
                    outcome = f"{type(exc).__name__}: {exc}"
                except (ValueError, LookupError, TypeError) as exc:  # a body that is not a completion's JSON
                    connection.close()
                    outcome = f"garbled answer: {type(exc).__name__}: {exc}"
                answer = Answer(model, stream, replica[0], began, time.time(), outcome)
                with self.lock:
                    self.answers.append(answer)
                    if outcome is None:
                        self.served[model] += 1
                    else:
                        self.failures.append(f"{model}: {outcome}")
                if outcome is not None:
                    self.stop.wait(FAILURE_PAUSE)  # a refused connection fails in microseconds: no hot loop
        finally:
            connection.close()

    @staticmethod
    def _one(
        connection: _Connection, path: str, body: bytes, stream: bool, replica: list[str]
    ) -> str | None:
        """One request; None when it succeeded, else what went wrong. ``replica[0]``: who answered."""
        connection.post(path, body)
        response = connection.getresponse()
        replica[0] = response.getheader("x-llmgw-replica", "")
        if not stream:
            data = response.read()
            if response.status != 200:
                return f"{response.status}: {data[:200].decode(errors='replace')}"
            return None if json.loads(data)["choices"][0]["message"]["content"] else "empty answer"
        if response.status != 200:
            return f"stream {response.status}: {response.read()[:200]!r}"
        events = []
        while line := response.readline():
            if line.startswith(b"data: "):
                events.append(line[6:].rstrip(b"\r\n").decode())
        if not events or events[-1] != "[DONE]":
            return f"stream ended without [DONE]: {events[-2:]}"
        errors = [e for e in events[:-1] if "error" in json.loads(e)]
        return f"stream error event: {errors[0]}" if errors else None

    def __enter__(self) -> GatewayLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


class _Connection(http.client.HTTPConnection):
    """One client's kept-alive connection (the standard library's: a fifth of httpx's CPU per request, so the
    load generator does not take the CPU the processes under test need)."""

    def post(self, path: str, body: bytes) -> None:
        """Send one POST of JSON ``body``, on a new connection when the gateway closed the kept-alive one
        while it was idle (as httpx's pool does: that is no failure of the request)."""
        if self.sock is not None and select.select([self.sock], [], [], 0)[0]:
            self.close()
        self.request("POST", path, body=body, headers={"content-type": "application/json"})
