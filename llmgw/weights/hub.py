"""Downloads from a Hugging Face Hub with the ``huggingface_hub`` library: what the one fetching node calls.

Every function here is blocking (the agent runs them in a worker thread):

- :func:`resolve`: ``HfApi.model_info(files_metadata=True)``: the commit the
  asked revision is at (the revision is pinned to it), and every file with
  its size and, for LFS files, the sha256 the Hub gives;
- :func:`download`: one file at that commit into a partial file, resumed
  from the bytes the partial file already holds (``Range``): the library's
  own ``hf_hub_download`` deletes a partial download when it fails, so an
  agent restart would start a large file again.

A refusal becomes a :class:`HubError` whose message says what to do (401:
which setting holds the token; 404: no such repo or revision; 429: when to
retry). The token is read from its file at each use and never logged.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs

from llmgw.weights._sources import HubRef

__all__ = ["DEFAULT_ENDPOINT", "HubError", "HubFile", "HubModel", "HubSettings", "download", "resolve"]

DEFAULT_ENDPOINT = "https://huggingface.co"


class HubError(Exception):
    """The Hub could not give what was asked; ``str()`` says why and what to do, for ``ctl replicas``."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        #: seconds the Hub asked to wait (429 ``Retry-After``), or None
        self.retry_after = retry_after


@attrs.frozen
class HubSettings:
    """Where the Hub is and which token to send (``llmgw agent --hub-endpoint --hub-token-file``)."""

    endpoint: str = DEFAULT_ENDPOINT
    #: a file holding the token; None: no token is sent
    token_file: Path | None = None

    def token(self) -> str | bool:
        """The token from its file (False: none configured, so none is sent, not even a cached one).

        :raises HubError: the file cannot be read or is empty.
        """
        if self.token_file is None:
            return False
        where = f"the hub token file {self.token_file} (--hub-token-file)"
        try:
            token = self.token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise HubError(f"cannot read {where}: {getattr(exc, 'strerror', None) or exc}") from None
        if not token:
            raise HubError(f"{where} is empty")
        return token


@attrs.frozen
class HubFile:
    """One file of a model at a commit: its path in the repo, size, and sha256 when the Hub gives it (LFS)."""

    path: str
    size: int
    sha256: str | None = None


@attrs.frozen
class HubModel:
    """A model repo at a commit: what :func:`resolve` found."""

    repo: str
    commit: str
    files: tuple[HubFile, ...]


def _what(ref: HubRef) -> str:
    return f"{ref.repo}@{ref.revision}" if ref.revision else ref.repo


def _retry_after(headers: Any) -> float | None:
    value = (headers or {}).get("Retry-After")
    return float(value) if value is not None and str(value).strip().isdigit() else None


def explain(exc: BaseException, settings: HubSettings, ref: HubRef, path: str | None = None) -> HubError:
    """What a failure of the library means for an operator, as a :class:`HubError` (called on any failure)."""
    if isinstance(exc, HubError):
        return exc
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    headers = getattr(response, "headers", None) or {}
    where = f"the hub at {settings.endpoint}"
    what = _what(ref) + (f" file {path}" if path else "")
    if status == 401:
        if settings.token_file is None:
            hint = "none is set: give one with --hub-token-file, or hub_token_file in agent.toml"
        else:
            hint = f"the one in {settings.token_file} (--hub-token-file, hub_token_file) was refused"
        return HubError(
            f"{where} answered 401 Unauthorized for {what}: the token is missing or wrong ({hint}); "
            "a private or gated repo answers so without a valid token",
            401,
        )
    if status == 403:
        return HubError(
            f"{where} answered 403 Forbidden for {what}: the token may not read this repo "
            "(a gated model: accept its terms on the hub with the token's account)",
            403,
        )
    if status == 404:
        code = headers.get("X-Error-Code")
        if code == "RevisionNotFound":
            words = f"no revision {ref.revision!r} in {ref.repo} (404): check the catalog's source"
        elif code == "EntryNotFound":
            words = f"no file {path!r} in {_what(ref)} (404)"
        else:
            words = f"no model repo {ref.repo} (404): check the catalog's source (hf://ORG/NAME)"
        return HubError(f"{where} has {words}", 404)
    if status == 429:
        retry = _retry_after(headers)
        after = f"retry after {retry:g} s" if retry is not None else "retry later"
        return HubError(
            f"{where} rate limited this node (429 Too Many Requests) for {what}: {after}", 429, retry
        )
    if status is not None:
        return HubError(f"{where} answered {status} for {what}", status)
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return HubError(f"{where} failed for {what}: {type(exc).__name__}: {first}")


def resolve(settings: HubSettings, ref: HubRef) -> HubModel:
    """The commit ``ref`` is at now and its files (``HfApi.model_info(files_metadata=True)``); blocking.

    :raises HubError: refused, missing, rate limited or unreachable (see :func:`explain`).
    """
    try:
        from huggingface_hub import HfApi

        api = HfApi(endpoint=settings.endpoint, token=settings.token())
        info = api.model_info(ref.repo, revision=ref.revision, files_metadata=True)
    except Exception as exc:  # noqa: BLE001 - every failure of the library is the Hub's answer
        raise explain(exc, settings, ref) from None
    if not info.sha or info.siblings is None:
        raise HubError(f"the hub at {settings.endpoint} gave no commit or file list for {_what(ref)}")
    files = []
    for sibling in info.siblings:
        lfs = sibling.lfs  # a dict before huggingface_hub 0.21, a dict subclass since
        size = lfs["size"] if lfs is not None else sibling.size
        if size is None:
            raise HubError(
                f"the hub at {settings.endpoint} gave no size for {sibling.rfilename} of {_what(ref)}"
            )
        files.append(HubFile(sibling.rfilename, size, lfs["sha256"] if lfs is not None else None))
    return HubModel(ref.repo, info.sha, tuple(files))


class _Stopped(Exception):
    """The download was abandoned (the shard stopped)."""


class _Sink:
    """The partial file as ``http_get`` writes it: bytes counted, and the download stopped on request."""

    def __init__(self, handle: Any, on_bytes: Callable[[int], None], stop: threading.Event) -> None:
        self.handle, self.on_bytes, self.stop = handle, on_bytes, stop

    def write(self, data: bytes) -> int:
        if self.stop.is_set():
            raise _Stopped()
        written = self.handle.write(data)
        self.on_bytes(len(data))
        return written

    def seek(self, *args: Any) -> int:
        return self.handle.seek(*args)

    def tell(self) -> int:
        return self.handle.tell()

    def truncate(self, *args: Any) -> int:
        return self.handle.truncate(*args)


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


#: bytes of a Hub download held in memory before they are written to the partial file
WRITE_EVERY = 1024 * 1024


def download(
    settings: HubSettings,
    ref: HubRef,
    commit: str,
    file: HubFile,
    partial: Path,
    on_bytes: Callable[[int], None] = lambda n: None,
    stop: threading.Event | None = None,
) -> None:
    """Download ``file`` at ``commit`` into ``partial``, resumed from its bytes; blocking.

    Returns once ``partial`` holds ``file.size`` bytes (not verified: the
    caller hashes it). HEAD ``resolve/{commit}/{path}`` gives the download
    location (a CDN for LFS files, where the token is not sent), then one GET
    with ``Range: bytes=N-`` fetches the rest (the library's ``http_get``).

    :raises HubError: refused, missing, rate limited, unreachable, or sent too much or too little.
    """
    stop = stop or threading.Event()
    try:
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers, disable_progress_bars

        disable_progress_bars()
        # written (so counted in the progress, and followed by peers) every MiB, not every 10 MiB: the
        # bytes a dying downloader held in memory are lost to the fleet
        constants.DOWNLOAD_CHUNK_SIZE = WRITE_EVERY
        token = settings.token()
        url = hf_hub_url(ref.repo, file.path, revision=commit, endpoint=settings.endpoint)
        location = get_hf_file_metadata(url, token=token).location
        headers = build_hf_headers(token=token)
        if _origin(location) != _origin(url):
            headers.pop("authorization", None)  # a signed CDN URL: the token stays with the Hub
        partial.parent.mkdir(parents=True, exist_ok=True)
        if partial.exists() and partial.stat().st_size > file.size:
            partial.unlink()
        with open(partial, "r+b" if partial.exists() else "wb") as handle:
            have = handle.seek(0, os.SEEK_END)
            if have == file.size:
                return
            http_get(
                location,
                _Sink(handle, on_bytes, stop),
                resume_size=have,
                headers=headers,
                expected_size=file.size,
            )
    except _Stopped:
        return
    except Exception as exc:  # noqa: BLE001 - every failure of the library is the Hub's answer
        raise explain(exc, settings, ref, file.path) from None
