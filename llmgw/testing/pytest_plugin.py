"""The pytest plugin llmgw installs (entry point ``pytest11``): fixtures engine distributions share.

pytest loads it in every run where llmgw is installed, so an engine
distribution's tests use these fixtures without a ``conftest.py``. In a
parallel run (pytest-xdist, ``-n N``) it also gives each worker a network of
its own for simulated nodes (:func:`worker_net`), so two workers' clusters
never meet.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest

# the pinned API engine distributions use (tests/test_imports.py); worker_net is the run's own
__all__ = ["HELP_DIR_ENV", "engine_help_dir", "find_engine_help_dir", "missing_engine_help"]

#: points at the folder of real engine help texts, instead of ``shared/engine-help`` beside the repository
HELP_DIR_ENV = "LLMGW_ENGINE_HELP_DIR"

#: the first three parts of the simulated nodes' addresses (``llmgw.dev.cluster.NODE_NET``)
DEV_NET_ENV = "LLMGW_DEV_NET"


def worker_net(base: str, worker: str) -> str:
    """The simulated nodes' network of pytest-xdist worker ``worker`` (``gw0``, ``gw1``...), from ``base``
    (``$LLMGW_DEV_NET``, ``127.0.0`` by default): the second part moves up by the worker's number plus one,
    so ``127.0.26`` gives ``127.1.26`` to gw0 and ``127.2.26`` to gw1; runs side by side with different
    bases and the workers of one run never share an address.

    :raises pytest.UsageError: when ``base`` is not three numbers or the workers run past 127.255.
    """
    parts = base.split(".")
    if len(parts) != 3 or not all(part.isdigit() for part in parts) or not worker.startswith("gw"):
        raise pytest.UsageError(f"{DEV_NET_ENV}={base!r}: expected three numbers such as 127.0.26")
    second = int(parts[1]) + int(worker.removeprefix("gw")) + 1
    if second > 255:
        raise pytest.UsageError(f"{DEV_NET_ENV}={base!r}: too many workers for it ({worker}); use fewer")
    return f"{parts[0]}.{second}.{parts[2]}"


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> None:
    """In a pytest-xdist worker, set ``$LLMGW_DEV_NET`` to the worker's own network before any test module
    or conftest is imported (``llmgw.dev.cluster`` reads it once), for this process and every process it
    starts. Called once per process, before the conftests of the paths on the command line (a
    ``conftest.py`` that imports ``llmgw.dev.cluster`` there would otherwise read the base network)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        os.environ[DEV_NET_ENV] = worker_net(os.environ.get(DEV_NET_ENV, "127.0.0"), worker)


def find_engine_help_dir(start: Path, environ: Mapping[str, str] = os.environ) -> Path | None:
    """The folder of real ``--help`` texts: ``$LLMGW_ENGINE_HELP_DIR``, else ``shared/engine-help``
    in ``start`` or the nearest folder above it that has one.

    :returns: the folder, or None when there is none (or the variable names a missing one).
    """
    if environ.get(HELP_DIR_ENV):
        path = Path(environ[HELP_DIR_ENV])
        return path if path.is_dir() else None
    for folder in (start, *start.parents):
        candidate = folder / "shared" / "engine-help"
        if candidate.is_dir():
            return candidate
    return None


@pytest.fixture(scope="session")
def engine_help_dir(request: pytest.FixtureRequest) -> Path:
    """The folder of real engine help texts (``engine-0.34.0-serve.txt`` ...); without it the test is skipped,
    or fails in CI (:func:`missing_engine_help`).

    Searched from the pytest root folder (an engine distribution) upwards: the
    engines in the llmgw repository read ``../shared/engine-help/`` beside it.
    """
    found = find_engine_help_dir(Path(request.config.rootpath).resolve())
    if found is None:
        missing_engine_help(
            f"the real engine help texts are not here: no shared/engine-help above {request.config.rootpath} "
            f"(they live in ../shared/engine-help beside the repository; set {HELP_DIR_ENV})"
        )
    return found


def missing_engine_help(message: str, environ: Mapping[str, str] = os.environ) -> None:
    """Skip the test for want of the real help texts, saying ``message``; in CI (``CI`` is ``true`` or ``1``),
    fail it instead, so that a CI run without them is never green with the engine checks left out.

    Called by :func:`engine_help_dir` and by tests that look the texts up themselves; never returns.
    """
    if environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{message}; CI must have them")
    pytest.skip(message)
