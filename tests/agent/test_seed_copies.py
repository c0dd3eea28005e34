"""A node's seed folder as the agent reports it: a copy only while its files are those it hashed.

An empty folder is no copy and gets no manifest; a folder changed since it
was hashed (a file replaced, half written, removed) is not reported until it
is hashed again, and then with its new digest (which the server compares
with the fleet's).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from llmgw.agent.facts import present_sources
from llmgw.agent.models_dir import ModelsDir

SOURCE = "seed:///data/m"


def models_dir(tmp_path: Path) -> tuple[ModelsDir, Path]:
    models = ModelsDir(tmp_path / "models", seed_root=tmp_path / "disk")
    seed = tmp_path / "disk" / "data" / "m"
    seed.mkdir(parents=True)
    return models, seed


def test_an_empty_folder_is_no_seed(tmp_path):
    models, _ = models_dir(tmp_path)
    assert models.seed_manifest(SOURCE, "node-2") is None
    assert models.seed_copies([SOURCE]) == []
    assert present_sources([SOURCE], models) == ()


def test_a_seed_changed_since_it_was_hashed_is_no_copy_until_hashed_again(tmp_path):
    models, seed = models_dir(tmp_path)
    (seed / "weights.bin").write_bytes(os.urandom(1000))
    (seed / "config.json").write_bytes(b"{}")
    made = models.seed_manifest(SOURCE, "node-1")
    assert made is not None and len(made.files) == 2
    [copy] = models.seed_copies([SOURCE])
    assert (copy.digest, copy.complete, copy.seed) == (made.digest, True, True)
    assert present_sources([SOURCE], models) == (SOURCE,)

    (seed / "weights.bin").write_bytes(os.urandom(1000))  # same size, other bytes
    assert models.seed_copies([SOURCE]) == []
    again = models.seed_manifest(SOURCE, "node-1")
    assert again is not None and again.digest != made.digest
    assert [c.digest for c in models.seed_copies([SOURCE])] == [again.digest]

    shutil.rmtree(seed)
    seed.mkdir()
    assert models.seed_copies([SOURCE]) == [] and models.seed_manifest(SOURCE, "node-1") is None
    assert present_sources([SOURCE], models) == ()
