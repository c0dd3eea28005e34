"""Checking a release folder before onboarding installs it on a node.

A release is what ``scripts/release`` builds from a commit: one wheel and one
sdist per distribution of the repository, the wheels of their dependencies,
and a ``RELEASE`` JSON manifest (versions, commit, dirty flag, sha256 of every
file). Onboarding installs only such a folder, so that whoever onboards a
machine never quietly becomes the build server: a working tree, an editable
install, a folder of loose wheels, a release built from uncommitted changes or
one whose files changed since it was built are all refused, each with how to
build a real one.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path

import attrs

from llmgw.errors import LlmgwError

__all__ = ["Distribution", "Release", "ReleaseError", "check_release", "HOW_TO_BUILD"]

#: What every refusal ends with.
HOW_TO_BUILD = (
    "build a release from a clean checkout of a commit (ideally a tag) with "
    "`scripts/release --out DIR` (or `scripts/release --tag llmgw-vX.Y.Z --out DIR`) and pass --release DIR"
)
_MANIFEST_FILES = ("RELEASE", "SHA256SUMS")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
#: PEP 440 development, local and pre-release-free check: these are not releases.
_NOT_A_RELEASE = re.compile(r"(\.dev\d*|\+.+)$")


class ReleaseError(LlmgwError):
    """A --release folder onboarding will not install; the message says why and how to build one."""

    exit_code = 2


@attrs.frozen
class Distribution:
    """One distribution of the release: its name, version and wheel file name."""

    name: str
    version: str
    wheel: str


@attrs.frozen
class Release:
    """A checked release folder."""

    path: Path
    llmgw_version: str
    commit: str
    tag: str | None
    tags_at_commit: tuple[str, ...]
    distributions: tuple[Distribution, ...]
    #: sha256 of the RELEASE manifest: what a node records to know which release it runs
    manifest_sha256: str
    files: tuple[str, ...]

    @property
    def ident(self) -> str:
        """A name for this release on a node: ``<llmgw version>-<commit 12>-<manifest 8>``."""
        return f"{self.llmgw_version}-{self.commit[:12]}-{self.manifest_sha256[:8]}"

    @property
    def names(self) -> list[str]:
        """The distributions to install: llmgw and every engine plugin."""
        return [d.name for d in self.distributions]

    def describe(self) -> str:
        """One line for people: version, commit and tag."""
        tag = self.tag or (", ".join(self.tags_at_commit) if self.tags_at_commit else "no tag")
        return f"llmgw {self.llmgw_version} at commit {self.commit[:12]} ({tag})"


def _refuse(path: Path, why: str) -> ReleaseError:
    return ReleaseError(f"--release {path}: {why}; not installing it. To fix: {HOW_TO_BUILD}")


def check_release(path: str | Path) -> Release:
    """Check that ``path`` is a release folder built by ``scripts/release`` and unchanged since.

    Called by ``llmgw-onboard-node`` before anything is issued or copied.

    :raises ReleaseError: when the folder is missing, is a source tree or a
        folder of wheels without a manifest, was built from uncommitted changes
        (``dirty``), holds a file whose sha256 differs from the manifest (or a
        file the manifest does not list, or misses one it lists), holds an
        editable wheel, or a version that is not a release (``.devN``, ``+local``).
    :returns: the :class:`Release`.
    """
    path = Path(path).expanduser().absolute()
    if not path.is_dir():
        raise _refuse(path, "is not a folder")
    manifest_path = path / "RELEASE"
    if not manifest_path.is_file():
        if (path / "pyproject.toml").exists() or (path / ".git").exists():
            why = "is a source tree (a working tree or an editable install's checkout), not a release"
        elif any(path.glob("*.whl")):
            why = (
                "holds wheels but no RELEASE manifest, so nothing says which commit they are "
                "or that they are whole"
            )
        else:
            why = "has no RELEASE manifest"
        raise _refuse(path, why)
    raw = manifest_path.read_bytes()
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise _refuse(path, f"RELEASE is not a JSON object ({exc})") from None
    if manifest.get("format") != 1:
        raise _refuse(path, f"RELEASE has format {manifest.get('format')!r}; this onboarding reads format 1")
    commit = manifest.get("commit")
    if manifest.get("dirty") is not False or not isinstance(commit, str):
        raise _refuse(
            path,
            f"it was built from a work tree with uncommitted changes (commit {commit}-dirty, "
            "`scripts/release --allow-dirty`), so no commit says what is in it",
        )
    if not _COMMIT.match(commit):
        raise _refuse(path, f"RELEASE names commit {commit!r}, which is not 40 hex digits")

    sha256 = manifest.get("sha256")
    if not isinstance(sha256, dict) or not sha256:
        raise _refuse(path, "RELEASE lists no sha256 of its files")
    present = sorted(p.name for p in path.iterdir() if p.is_file() and p.name not in _MANIFEST_FILES)
    extra = sorted(set(present) - set(sha256))
    missing = sorted(set(sha256) - set(present))
    if missing:
        raise _refuse(path, f"files listed in RELEASE are missing: {', '.join(missing)}")
    if extra:
        raise _refuse(path, f"files not in RELEASE were added to the folder: {', '.join(extra)}")
    for name in present:
        digest = hashlib.sha256((path / name).read_bytes()).hexdigest()
        if digest != sha256[name]:
            raise _refuse(
                path, f"{name} changed since the release was built (its sha256 differs from RELEASE)"
            )

    distributions = []
    for entry in manifest.get("distributions") or []:
        try:
            name, version, wheel = entry["name"], entry["version"], entry["wheel"]
        except (KeyError, TypeError):
            raise _refuse(
                path, f"RELEASE has a distribution entry without name, version and wheel: {entry!r}"
            ) from None
        if wheel not in sha256:
            raise _refuse(path, f"the wheel of {name} ({wheel}) is not in the folder")
        if _NOT_A_RELEASE.search(version):
            raise _refuse(path, f"{name} {version} is a development or local version, not a release")
        _check_not_editable(path, wheel)
        distributions.append(Distribution(name, version, wheel))
    if not distributions or distributions[0].name != "llmgw":
        raise _refuse(path, "RELEASE does not list the llmgw distribution first")
    _check_recorded_commit(path, distributions[0].wheel, commit)
    return Release(
        path=path,
        llmgw_version=distributions[0].version,
        commit=commit,
        tag=manifest.get("tag") or None,
        tags_at_commit=tuple(manifest.get("tags_at_commit") or ()),
        distributions=tuple(distributions),
        manifest_sha256=hashlib.sha256(raw).hexdigest(),
        files=tuple(present),
    )


def _check_not_editable(path: Path, wheel: str) -> None:
    """An editable wheel points at a source tree (a top-level ``.pth`` file) instead of carrying the code."""
    try:
        with zipfile.ZipFile(path / wheel) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        raise _refuse(path, f"{wheel} is not a wheel (not a zip file)") from None
    if any("/" not in n and n.endswith(".pth") for n in names) or any("_editable_impl_" in n for n in names):
        raise _refuse(
            path, f"{wheel} is an editable wheel: it points at a source tree instead of carrying the code"
        )


def _check_recorded_commit(path: Path, wheel: str, commit: str) -> None:
    with zipfile.ZipFile(path / wheel) as archive:
        try:
            info = archive.read("llmgw/_build_info.py").decode()
        except KeyError:
            raise _refuse(
                path, f"{wheel} records no commit (llmgw/_build_info.py): it was not built by scripts/release"
            ) from None
    found = re.search(r'^COMMIT = "([^"]*)"', info.replace("'", '"'), re.MULTILINE)
    recorded = found.group(1) if found else "?"
    if recorded != commit:
        raise _refuse(path, f"{wheel} records commit {recorded}, but RELEASE says {commit}")
