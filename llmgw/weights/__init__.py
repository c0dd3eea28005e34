"""Model weights the fleet copies itself: distributable sources and their manifests.

A catalog ``source`` is one of:

- an absolute path (``/models/llama``): it must already be on a node's disk; never moved;
- ``seed:///ABSOLUTE/PATH``: a *distributable* path: the files present on any
  one node are copied by llmgw into the other nodes' models directories
  (``llmgw agent --models-dir``) when a replica is placed there;
- ``hf://ORG/NAME[@REVISION]``: a model on a Hugging Face Hub (``llmgw agent
  --hub-endpoint``); one node downloads it (:mod:`llmgw.weights.hub`), pinning
  the revision to its commit, and the others copy it from peers like a seed;
- any other name (a hub id such as ``meta-llama/Llama-3.1-8B``): handed to the engine as is.

A model's LoRA adapters (its catalog ``adapters:``) have sources of the same
kinds, and travel the same way (:func:`catalog_sources`, :func:`adapter_sources`).

The first node holding (or downloading) a distributable source computes its :class:`Manifest`
(every file's path, size and sha256); the server keeps it, and every copy is
verified against it, file by file.
"""

from llmgw.weights._adapter import ADAPTER_CONFIG, adapter_problem, adapter_rank
from llmgw.weights._catalog import adapter_sources, catalog_sources
from llmgw.weights._holding import agreeing_facts, differing_files, differs, holds
from llmgw.weights._manifest import (
    MANIFEST_LIMIT,
    Manifest,
    ManifestFile,
    compute_manifest,
    file_sha256,
    safe_relpath,
)
from llmgw.weights._sources import (
    HF_SCHEME,
    SEED_SCHEME,
    HubRef,
    check_source,
    hub_ref,
    is_distributable,
    seed_path,
)

__all__ = [
    "ADAPTER_CONFIG",
    "adapter_problem",
    "adapter_rank",
    "adapter_sources",
    "catalog_sources",
    "MANIFEST_LIMIT",
    "agreeing_facts",
    "differing_files",
    "differs",
    "holds",
    "Manifest",
    "ManifestFile",
    "compute_manifest",
    "file_sha256",
    "safe_relpath",
    "HF_SCHEME",
    "HubRef",
    "SEED_SCHEME",
    "hub_ref",
    "check_source",
    "is_distributable",
    "seed_path",
]
