"""llmgw-engine-myengine: the llmgw plugin for myengine.

It registers :class:`MyEngine`, which builds ``myengine-server`` commands from
launch specs. Replace what follows with what your engine's documentation says.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata

import llmgw
from llmgw.engine import Engine
from llmgw.models import Command, LaunchSpec

__all__ = ["MyEngine", "__version__"]

try:
    __version__ = metadata.version("llmgw-engine-myengine")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

SERVER = "myengine-server"

_FEATURES = {
    "--model": "model source",
    "--served-model-name": "served model name",
    "--host": "HTTP address",
    "--port": "HTTP address",
    "--nnodes": "multi-node rendezvous",
    "--node-rank": "multi-node rendezvous",
    "--dist-init-addr": "multi-node rendezvous",
}


class MyEngine(Engine):
    """Builds ``myengine-server`` commands: single-node, rank 0, and workers."""

    name = "myengine"
    #: the engine versions whose real help the tests check every flag against
    checked_versions = ("1.0.0",)
    multi_node = True
    #: answers 200 on rank 0 once the replica serves
    health_path = "/health"
    #: program names; the agent's configuration maps each to a path on the node
    programs = (SERVER,)

    def build_command(self, spec: LaunchSpec) -> Command:
        """Build the command of one shard: rank 0 serves HTTP and binds the dist-init address."""
        argv = [
            self.program_path(spec, SERVER),
            "--model",
            spec.model_source,
            "--served-model-name",
            spec.served_name,
            "--host",
            spec.host,
            "--port",
            str(spec.port),
        ]
        if spec.nnodes > 1:
            argv += [
                "--nnodes",
                str(spec.nnodes),
                "--node-rank",
                str(spec.rank),
                "--dist-init-addr",
                str(spec.dist_init_addr),
            ]
        argv += spec.extra_args
        # CUDA_VISIBLE_DEVICES from spec.gpus; NCCL_IB_HCA=<exact names> from spec.adapters
        return Command(argv=argv, env=self.device_env(spec))

    def widest_spec(self) -> LaunchSpec:
        """A spec that makes build_command emit every flag it ever emits: engine-check builds it."""
        return LaunchSpec(
            model_source="/models/example",
            served_name="example",
            host="10.0.0.1",
            port=8000,
            gpus=(0, 1),
            rank=0,
            nnodes=2,
            dist_init_addr="10.0.0.1:29500",
            adapters=("mlx5_0", "mlx5_1"),
        )

    def flag_features(self) -> Mapping[str, str]:
        """What each flag is for, shown by engine-check next to it."""
        return _FEATURES


@llmgw.hookimpl
def llmgw_register_engines() -> list[Engine]:
    """Register the engine, ``engine: myengine`` in a catalog."""
    return [MyEngine()]
