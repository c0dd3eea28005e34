"""The version of llmgw that runs and the commit it was built from: ``llmgw version``.

A wheel or sdist records its commit when it is built (``hatch_build.py`` at the
repository root writes ``llmgw/_build_info.py`` into it). Running from a source
tree (an editable install, or a checkout on ``sys.path``) asks git instead, so
the answer follows the tree: the ``HEAD`` commit, with ``-dirty`` when the tree
differs from it (changed, staged or untracked files).
"""

from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path

import attrs
import click

import llmgw

__all__ = ["BuildInfo", "build_info", "distribution_version", "version_info", "version", "UNKNOWN"]

#: The commit when neither a build record nor git can tell.
UNKNOWN = "unknown"


@attrs.frozen
class BuildInfo:
    """What ``llmgw version`` prints."""

    version: str
    #: 40 hex digits, ``-dirty`` appended when built from a tree with changes; or :data:`UNKNOWN`
    commit: str
    #: where ``commit`` comes from: ``build`` (recorded in the wheel or sdist when it was built),
    #: ``source-tree`` (git, at run time: an editable install or a checkout) or ``unknown``
    source: str
    #: the source tree, when ``source`` is ``source-tree``
    tree: str | None = None

    @property
    def dirty(self) -> bool:
        """Whether it was built from (or runs from) a tree with uncommitted changes."""
        return self.commit.endswith("-dirty")

    def to_json(self) -> dict[str, object]:
        """The record as ``llmgw version --json`` prints it."""
        return {**attrs.asdict(self), "dirty": self.dirty}


def build_info() -> BuildInfo:
    """Where this llmgw comes from: its version, commit and the source of that commit."""
    tree = Path(llmgw.__file__).resolve().parent.parent
    commit = git_commit(tree)
    if commit is not None:
        return BuildInfo(llmgw.__version__, commit, "source-tree", str(tree))
    try:
        from llmgw import _build_info  # written by hatch_build.py into wheels and sdists
    except ImportError:
        return BuildInfo(llmgw.__version__, UNKNOWN, "unknown")
    return BuildInfo(llmgw.__version__, _build_info.COMMIT, "build")


def distribution_version(distribution: str) -> str:
    """The installed version of ``distribution``, for a plugin's ``__version__``.

    Called once, at import, by each engine distribution
    (``__version__ = distribution_version("llmgw-engine-foo")``).

    :returns: the version its metadata records, or ``0.0.0+unknown`` for a
        source tree that was never installed.
    """
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def version_info() -> tuple[str, str]:
    """``(version, commit)`` of the llmgw that runs; see :func:`build_info`."""
    info = build_info()
    return info.version, info.commit


def git_commit(tree: Path) -> str | None:
    """``HEAD`` of the git work tree whose top is ``tree`` (``-dirty`` when it has changes); else ``None``.

    Only a tree whose top level is ``tree`` itself counts, so an installed
    package inside some other repository (a venv in a checkout) is not
    mistaken for a source tree.
    """
    if not (tree / ".git").exists():
        return None
    try:
        found = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        if len(found) != 2 or Path(found[0]).resolve() != tree.resolve():
            return None
        changes = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return found[1] + ("-dirty" if changes.strip() else "")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def version(as_json: bool) -> None:
    """Print llmgw's version and the commit it was built from."""
    info = build_info()
    if as_json:
        click.echo(json.dumps(info.to_json(), indent=2))
        return
    click.echo(f"llmgw {info.version}")
    click.echo(f"commit {info.commit}")
    if info.source == "build":
        click.echo("from a built distribution (the commit was recorded when it was built)")
    elif info.source == "source-tree":
        click.echo(f"from the source tree {info.tree} (an editable install or a checkout)")
    else:
        click.echo("from a distribution that did not record its commit")
