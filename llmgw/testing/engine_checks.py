"""What engine distributions' own tests share beside the conformance suite: their fixtures and a shard.

The conformance suite (:mod:`llmgw.testing.contract`) checks what every engine must do; an engine's own
tests then spell out its commands and read its real help. They share the ``version`` fixture over the
engine's checked versions, a ``real_help`` fixture reading one version's help as the contract does, and
the shard whose commands they spell out::

    version = version_fixture(MyEngine)
    real_help = real_help_fixture(TestMyEngineContract, "my-server")
    SPEC = shard_spec({"my-server": "/opt/my/bin/my-server"}, extra_args=("--context-length", "32768"))

and what the shard's commands must hold (:func:`shard_serving`, :func:`shard_rendezvous`). Every rank's GPUs
and fabric adapters are the contract's to check (``test_gpus_and_exact_adapter_names``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import pytest

from llmgw.engine import Engine
from llmgw.models import LaunchSpec
from llmgw.testing.contract import EngineContract, read_help_files

__all__ = ["SHARD", "real_help_fixture", "shard_rendezvous", "shard_serving", "shard_spec", "version_fixture"]

#: rank 0 of a two-node replica on four GPUs of each node and a fabric's two adapters, whose names tell
#: an exact-name ``NCCL_IB_HCA`` (``=mlx5_1,mlx5_10``) from a prefix (``mlx5_1`` would also select
#: ``mlx5_10``)
SHARD = LaunchSpec(
    model_source="/models/llama-3.1-70b",
    served_name="llama-70b",
    host="10.0.0.5",
    port=20001,
    gpus=(4, 5, 6, 7),
    nnodes=2,
    dist_init_addr="10.0.0.5:20002",
    adapters=("mlx5_1", "mlx5_10"),
)


def shard_serving(model: str | None = "--model", served_name: str = "--served-model-name") -> tuple[str, ...]:
    """What :data:`SHARD`'s rank 0 is told of its model, served name and address, in an engine's spellings:
    ``--model /models/llama-3.1-70b --served-model-name llama-70b --host 10.0.0.5 --port 20001``.

    Called by an engine's tests for the part of a command they expect; ``model`` None: the model is
    positional (vLLM's). Spelt out here, not built with :func:`llmgw.engine.serving_args`, so that a test
    compares the engine's command with what it should be. :returns: the arguments.
    """
    served = ("/models/llama-3.1-70b", served_name, "llama-70b", "--host", "10.0.0.5", "--port", "20001")
    return served if model is None else (model, *served)


def shard_rendezvous(rank: int = 0) -> tuple[str, ...]:
    """What rank ``rank`` of :data:`SHARD`'s replica is told of it, in the spellings of
    :func:`llmgw.engine.rendezvous_args`: ``--nnodes 2 --node-rank RANK --dist-init-addr 10.0.0.5:20002``.

    Called by the tests of an engine taking those flags, for the part of a command they expect (spelt out,
    as :func:`shard_serving`). :returns: the arguments.
    """
    return ("--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", "10.0.0.5:20002")


def shard_spec(executables: Mapping[str, str], **changes: Any) -> LaunchSpec:
    """:data:`SHARD` with the configured path of each program and ``changes`` (profile args, say).

    Called by an engine's test module for the spec whose commands its tests spell out.
    :returns: the spec.
    """
    return attrs.evolve(SHARD, executables=dict(executables), **changes)


def version_fixture(engine_class: type[Engine]) -> Any:
    """A ``version`` fixture whose params are ``engine_class.checked_versions``.

    Called at import by an engine's test module (``version = version_fixture(MyEngine)``): the contract's
    ``help_texts`` and :func:`real_help_fixture` read the help of each version it gives.
    :returns: the fixture.
    """

    @pytest.fixture(name="version", params=engine_class.checked_versions)
    def version(request: pytest.FixtureRequest) -> str:
        return request.param

    return version


def real_help_fixture(contract: type[EngineContract], program: str | None = None) -> Any:
    """A ``real_help`` fixture: ``program``'s real help at the ``version`` fixture's version, read as the
    contract's ``help_texts`` reads it; with no ``program``, a ``real_helps`` fixture: program -> help.

    Called at import by an engine's test module (``real_help = real_help_fixture(TestMyContract, "my")``).
    :returns: the fixture.
    """

    def real_help(request: pytest.FixtureRequest, version: str) -> Any:
        folder = contract.help_dir or request.getfixturevalue("engine_help_dir")
        texts = read_help_files(folder, contract.help_files, version)
        return texts if program is None else texts[program]

    return pytest.fixture(name="real_help" if program else "real_helps")(real_help)
