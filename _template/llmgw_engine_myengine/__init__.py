"""llmgw-engine-myengine: the llmgw plugin for myengine.

It registers :class:`MyEngine`, which builds ``myengine-server`` commands from
launch specs. Replace what follows with what your engine's documentation says.
"""

from __future__ import annotations

import llmgw
from llmgw.engine import Engine, rendezvous_args, serving_args
from llmgw.models import Command, LaunchSpec
from llmgw.version import distribution_version

__all__ = ["MyEngine", "__version__"]

__version__ = distribution_version("llmgw-engine-myengine")

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
    #: what each flag is for, shown by engine-check next to it
    flag_features = _FEATURES
    # Set where your engine differs from an argparse program (the defaults are shown):
    #   help_and_version = {
    #       SERVER: HelpAndVersion(help_args=("--help",), help_env={}, version_args=("--version",)),
    #   }
    #   liveness_probe = openai_canary()  # with ProgressMetrics(...) if it counts tokens: docs/engines.md
    #   wait_for_workers = False
    # and override parse_help, parse_version, help_warnings, option_args or widest_spec likewise.

    def build_command(self, spec: LaunchSpec) -> Command:
        """Build the command of one shard: rank 0 serves HTTP and binds the dist-init address."""
        # --model SOURCE --served-model-name NAME --host HOST --port PORT (pass your engine's spellings of the
        # first two); llmgw.engine has the helpers most engines share, write your own where yours differs
        argv = [self.program_path(spec, SERVER), *serving_args(spec, model="--model")]
        # --nnodes N --node-rank R --dist-init-addr HOST:PORT, on every rank of a multi-node replica
        argv += rendezvous_args(spec)
        argv += spec.extra_args
        # CUDA_VISIBLE_DEVICES from spec.gpus; NCCL_IB_HCA=<exact names> from spec.adapters
        return Command(argv=argv, env=self.device_env(spec))


@llmgw.hookimpl
def llmgw_register_engines() -> list[Engine]:
    """Register the engine, ``engine: myengine`` in a catalog."""
    return [MyEngine()]
