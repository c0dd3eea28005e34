"""Fixtures to run ``llmgw-sim`` as a real process in tests."""

from __future__ import annotations

import httpx
import pytest

from llmgw.dev.cluster import program
from llmgw.testing.processes import ManagedProcess, ProcessSet, free_port, processes, wait_until

__all__ = ["processes"]


#: the console script installed next to this interpreter
SIM = program("llmgw-sim")


class Sim:
    """A running ``llmgw-sim`` and the HTTP address rank 0 serves on."""

    def __init__(self, process: ManagedProcess, host: str, port: int) -> None:
        self.process = process
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"

    def health(self) -> int:
        """The status /health answers now."""
        return httpx.get(f"{self.url}/health", timeout=2).status_code

    def wait_ready(self, timeout: float = 10) -> None:
        """Wait until /health answers 200."""
        wait_until(lambda: self.health() == 200, timeout, f"{self.process.name} to be ready", self.process)


def _starter(process_set: ProcessSet):
    def start_sim(*args: str, host: str = "127.0.0.1", name: str = "sim", **kwargs) -> Sim:
        """Start ``llmgw-sim --host HOST --port <free> ARGS``; ``--model`` defaults to ``test/model``.

        Keyword arguments (``env``, ``extra_env``...) go to :meth:`ProcessSet.start`.
        """
        port = free_port(host)
        argv = [SIM, "--host", host, "--port", str(port), *args]
        if "--model" not in args:
            argv += ["--model", "test/model"]
        return Sim(process_set.start(argv, name=name, **kwargs), host, port)

    return start_sim


@pytest.fixture
def sim_program() -> str:
    """The path of the ``llmgw-sim`` program."""
    return SIM


@pytest.fixture
def start_sim(processes: ProcessSet):
    """``start_sim(*args, host=..., name=..., extra_env=...)`` starts a sim this test owns."""
    return _starter(processes)


@pytest.fixture(scope="module")
def start_module_sim(tmp_path_factory):
    """Like ``start_sim``, for sims shared by a module's tests and killed after the last."""
    process_set = ProcessSet(tmp_path_factory.mktemp("processes"))
    try:
        yield _starter(process_set)
    finally:
        process_set.kill_all()
