"""``_template/`` copied as its README says, with only its facts changed, is a working engine distribution."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "_template"


def readme_steps() -> str:
    """The shell block of _template/README.md that copies the template and renames its facts."""
    blocks = re.findall(r"^```sh\n(.*?)^```$", (TEMPLATE / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, "_template/README.md must hold one ```sh block: the copy-and-rename steps"
    return blocks[0]


def test_a_copy_with_its_facts_changed_passes_the_conformance_suite(tmp_path):
    """Copy, rename as the README says, install into a folder of its own, run its tests: all pass,
    the inherited conformance suite (version and entry point included) among them."""
    shutil.copytree(TEMPLATE, tmp_path / "_template", ignore=shutil.ignore_patterns("__pycache__", ".*"))
    subprocess.run(["bash", "-e", "-c", readme_steps()], cwd=tmp_path, check=True, timeout=60)
    copy = tmp_path / "llmgw-engine-foo"
    assert not list(copy.rglob("*myengine*")), "the README's steps leave files named after the template"

    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--target", str(site), str(copy)],  # with this venv's hatchling (a test dependency): no index
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr

    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("LLMGW_LOAD_PLUGINS", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-v", "-p", "no:cacheprovider"],
        cwd=copy,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for inherited in ("test_version", "test_registered_through_the_entry_point", "test_engine_check_passes"):
        assert re.search(rf"TestFooEngineContract::{inherited}\S* PASSED", result.stdout), result.stdout
