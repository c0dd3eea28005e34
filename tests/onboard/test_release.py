"""Releases: ``scripts/release`` builds a folder that installs offline, and ``llmgw version`` says what it is.

``test_the_release_installs_offline_into_a_fresh_venv`` builds every
distribution of the repository (as CI and the release workflow do), installs
the folder into a new venv with ``pip install --no-index --find-links`` and no
pip configuration, and runs ``llmgw version`` and ``llmgw plugins`` from there.
It takes about half a minute; run it alone with ``pytest tests/test_release.py``
or leave it out with ``-k "not offline"``.

The release folder carries the wheels of the dependencies (``pip download`` at
release time), so the fresh venv is made with no ``--system-site-packages`` and
no other wheelhouse: whatever the folder lacks, the install lacks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw.version import build_info, git_commit, version, version_info
from tests.onboard.releases import build_release

REPO = Path(__file__).resolve().parents[2]
RELEASE = REPO / "scripts" / "release"
COMMIT = re.compile(r"^[0-9a-f]{40}(-dirty)?$")


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def in_git_tree() -> bool:
    return (REPO / ".git").exists() and shutil.which("git") is not None


needs_git = pytest.mark.skipif(
    not in_git_tree(), reason="a release is built from a git work tree; this is not one"
)


def distributions() -> dict[str, tuple[str, str]]:
    """Every distribution in the repository: name -> (folder, version)."""
    found = {}
    for pyproject in [REPO / "pyproject.toml", *sorted(REPO.glob("llmgw-engine-*/pyproject.toml"))]:
        project = tomllib.loads(pyproject.read_text())["project"]
        found[project["name"]] = (
            pyproject.parent.name if pyproject.parent != REPO else ".",
            project["version"],
        )
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without pip configuration, plugin selection or extra import paths."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIP_", "LLMGW_", "VIRTUAL_ENV")) and k not in ("PYTHONPATH", "PYTHONHOME")
    }
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return {**env, **extra}


def release(*args: str, cwd: Path = REPO, script: Path = RELEASE) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        [str(script), *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=900, check=False
    )


class TestVersion:
    """``llmgw version`` and :mod:`llmgw.version` in this (editable) install."""

    @needs_git
    def test_an_editable_install_reports_the_source_tree(self):
        """Running from the source tree, the commit is git's HEAD, with -dirty when the tree has changes."""
        info = build_info()
        assert info.source == "source-tree" and info.tree == str(REPO)
        assert COMMIT.match(info.commit)
        assert info.commit.removesuffix("-dirty") == git("rev-parse", "HEAD")
        assert version_info() == (info.version, info.commit)

    def test_only_the_top_of_a_work_tree_counts(self, tmp_path):
        """A folder that is not the top of a git work tree (a venv inside a checkout) gives no commit."""
        assert git_commit(tmp_path) is None
        assert git_commit(REPO / "llmgw") is None

    def test_the_command_prints_version_and_commit(self):
        """``llmgw version`` prints the version and the commit; --json gives the same as one object."""
        result = CliRunner().invoke(version, [], catch_exceptions=False)
        info = build_info()
        assert result.output.splitlines()[:2] == [f"llmgw {info.version}", f"commit {info.commit}"]
        data = json.loads(CliRunner().invoke(version, ["--json"]).output)
        assert data["commit"] == info.commit and data["dirty"] == info.dirty


@needs_git
class TestReleaseScript:
    """``scripts/release`` refusals, in a clone of this repository (no build needed)."""

    @pytest.fixture
    def clone(self, tmp_path: Path) -> Path:
        """A clone of HEAD, with this tree's release script and build hook in it (maybe not committed yet)."""
        clone = tmp_path / "clone"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        for name in ("scripts/release", "hatch_build.py"):
            (clone / name).parent.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
        return clone

    def test_refuses_a_dirty_tree(self, clone):
        """A tree with changes is refused, listing them, and nothing is built."""
        (clone / "scratch.txt").write_text("notes\n")
        done = release("--out", str(clone / "out"), cwd=clone, script=clone / "scripts" / "release")
        assert done.returncode == 1
        assert "the work tree has changes that are not in commit" in done.stderr
        assert "?? scratch.txt" in done.stderr and "--allow-dirty" in done.stderr
        assert not (clone / "out").exists()

    def test_finds_the_venv_of_run_without_python_set(self, clone):
        """With PYTHON unset it builds with the venv ./run made (.venv/bin/python), and says so."""
        (clone / ".venv" / "bin").mkdir(parents=True)
        python = clone / ".venv" / "bin" / "python"
        python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # this venv's, as ./run makes one
        python.chmod(0o755)
        (clone / "scratch.txt").write_text("notes\n")  # refused after the tools are found: nothing is built
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "LLMGW_VENV")}
        script = str(clone / "scripts" / "release")
        done = subprocess.run([script], cwd=clone, capture_output=True, text=True, env=env, timeout=60)
        assert f"release: building with {clone}/.venv/bin/python" in done.stderr, done.stderr
        assert done.returncode == 1 and "the work tree has changes" in done.stderr

    def test_refuses_a_tag_that_does_not_match(self, clone):
        """--tag must name a distribution here at its version, and point at HEAD."""
        script = clone / "scripts" / "release"
        _, core_version = distributions()["llmgw"]
        done = release("--allow-dirty", "--tag", "llmgw-v99.0.0", cwd=clone, script=script)
        assert done.returncode == 1
        assert (
            f"--tag llmgw-v99.0.0 says llmgw 99.0.0 but ./pyproject.toml says {core_version}" in done.stderr
        )
        done = release("--allow-dirty", "--tag", "llmgw-engine-nope-v1.0", cwd=clone, script=script)
        assert "names llmgw-engine-nope, which is not a distribution here" in done.stderr
        tag = f"llmgw-v{core_version}"
        subprocess.run(["git", "tag", "-d", tag], cwd=clone, capture_output=True, check=False)
        done = release("--allow-dirty", "--tag", tag, cwd=clone, script=script)
        assert f"there is no tag {tag} in this repository" in done.stderr
        git("tag", tag, cwd=clone)
        git(
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.com",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "later",
            cwd=clone,
        )
        done = release("--allow-dirty", "--tag", tag, cwd=clone, script=script)
        assert f"tag {tag} is commit" in done.stderr and "but HEAD is" in done.stderr


@needs_git
@pytest.mark.timeout(900)
def test_the_release_installs_offline_into_a_fresh_venv(tmp_path):
    """The release folder installs with no index into a new venv whose llmgw names its commit and engines."""
    head = git("rev-parse", "HEAD")
    out = tmp_path / "release"
    done = build_release("--out", str(out), "--allow-dirty")
    assert done.returncode == 0, done.stdout + done.stderr

    manifest = json.loads((out / "RELEASE").read_text())
    assert manifest["commit"] == head
    expected = distributions()
    assert {d["name"]: (d["folder"], d["version"]) for d in manifest["distributions"]} == expected
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    for d in manifest["distributions"]:
        assert (out / d["wheel"]).is_file() and (out / d["sdist"]).is_file()
    assert manifest["dependencies"], "the folder carries its dependencies' wheels"

    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=clean_env())
    bin_dir = venv / "bin"
    install = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "--no-index", "--find-links", str(out), *expected],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=tmp_path,
        check=False,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    shown = subprocess.run(
        [str(bin_dir / "llmgw"), "version"], capture_output=True, text=True, env=clean_env(), cwd=tmp_path
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"llmgw {expected['llmgw'][1]}"
    commit = lines[1].removeprefix("commit ")
    assert COMMIT.match(commit) and commit.removesuffix("-dirty") == head
    assert commit.endswith("-dirty") == manifest["dirty"]
    assert lines[2].startswith("from a built distribution")

    listed = subprocess.run(
        [str(bin_dir / "llmgw"), "plugins", "--json"],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    records = json.loads(listed.stdout)
    assert [r["name"] for r in records if r["status"] != "loaded"] == []
    by_distribution = {r["distribution"]: r for r in records if not r["builtin"]}
    engines = {name: version for name, (_, version) in expected.items() if name != "llmgw"}
    assert {name: by_distribution[name]["version"] for name in engines if name in by_distribution} == engines
    assert all(by_distribution[name]["engines"] for name in engines)
    builtins = {r["name"] for r in records if r["builtin"]}
    assert {"llmgw_nvidia", "llmgw_infiniband", "llmgw_proxmox"} <= builtins
