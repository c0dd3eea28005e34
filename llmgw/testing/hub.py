"""A Hugging Face Hub stand-in for tests: a real HTTP server on 127.0.0.x speaking the Hub's API.

It answers what ``huggingface_hub`` asks, the way the Hub does:

- ``GET /api/models/ORG/NAME[/revision/REV]`` (``?blobs=true``): the repo's
  ``sha`` (commit) and ``siblings``, with ``size``, ``blobId`` and, for LFS
  files, ``lfs: {size, sha256, pointerSize}``;
- ``HEAD``/``GET /ORG/NAME/resolve/REV/PATH``: a small file itself with
  ``ETag`` (its git blob id), ``X-Repo-Commit`` and ``Content-Length``; an
  LFS file as a 302 to a second origin (the "CDN", another port) with
  ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``;
- ``Range: bytes=N-`` (206 with ``Content-Range``) on every file;
- errors with the Hub's ``X-Error-Code``: an unknown repo (``RepoNotFound``,
  404), an unknown revision (``RevisionNotFound``, 404), a missing or wrong
  token when one is required (401), and forced ``fail`` modes (401, 404, 429
  with ``Retry-After``).

It counts requests and the bytes of each file it served, so a test can say
"each file was served exactly once". Servers run in threads of the test
process; :meth:`HubStandIn.stop` (or the ``with`` block) ends them.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import attrs

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.processes import free_port

__all__ = ["HubStandIn", "StandInFile", "hub_cluster", "hub_downloader"]

#: bytes written per chunk of a response
_CHUNK = 256 * 1024
_LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".onnx")


def hub_cluster(
    root: Path, hub: HubStandIn, nodes: int, *, lost_after: float, agent_args: Sequence[str] = ()
) -> LocalCluster:
    """A server and ``nodes`` agents under ``root`` downloading from ``hub``, started; the caller stops them.

    :param agent_args: more ``llmgw agent`` options.
    """
    cluster = LocalCluster(root / "cluster", server_port=free_port(), lost_after=lost_after, poll_timeout=1)
    cluster.agent_args = ["--hub-endpoint", hub.endpoint, *agent_args]
    try:
        cluster.start(nodes)
    except BaseException:
        cluster.stop_all()
        raise
    return cluster


def hub_downloader(server_log: Path, source: str) -> str | None:
    """The node the server's log names as downloading ``source`` from the hub.

    Polled by tests that then act on that node (kill it, read its partial files).

    :returns: the node's id, or None while no such line is logged.
    """
    for line in server_log.read_text().splitlines():
        if f"downloads {source} from the hub" in line:
            return line.split("node ")[1].split()[0]
    return None


@attrs.frozen
class StandInFile:
    """One file of a stand-in repo: its bytes (in memory or on disk), size and hashes."""

    path: str
    size: int
    sha256: str
    #: the git blob id of what git stores: the file itself, or its LFS pointer
    blob_id: str
    lfs: bool
    data: bytes | None = None
    on_disk: Path | None = None

    def pointer(self) -> bytes:
        """The LFS pointer git stores for an LFS file."""
        spec = "version https://git-lfs.github.com/spec/v1"
        return f"{spec}\noid sha256:{self.sha256}\nsize {self.size}\n".encode()

    def read(self, start: int) -> Any:
        """Chunks of the content from byte ``start`` on."""
        if self.data is not None:
            view = memoryview(self.data)
            for offset in range(start, self.size, _CHUNK):
                yield view[offset : offset + _CHUNK]
            return
        assert self.on_disk is not None
        with open(self.on_disk, "rb") as handle:
            handle.seek(start)
            while chunk := handle.read(_CHUNK):
                yield chunk


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _make_file(path: str, content: bytes | Path, lfs_min: int) -> StandInFile:
    if isinstance(content, Path):
        digest, size = hashlib.sha256(), 0
        with open(content, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
        data, on_disk = None, content
    else:
        digest, size, data, on_disk = hashlib.sha256(content), len(content), content, None
    lfs = size >= lfs_min or path.endswith(_LFS_SUFFIXES)
    sha = digest.hexdigest()
    file = StandInFile(path, size, sha, "", lfs, data, on_disk)
    if lfs:
        return attrs.evolve(file, blob_id=_git_blob_id(file.pointer()))
    assert data is not None or on_disk is not None
    return attrs.evolve(file, blob_id=_git_blob_id(data if data is not None else on_disk.read_bytes()))


class HubStandIn:
    """The stand-in: add models with :meth:`add_model`, give agents :attr:`endpoint`."""

    def __init__(self, host: str = "127.0.0.1", *, token: str | None = None, rate: float = 0.0) -> None:
        """:param token: when set, every request must carry ``Authorization: Bearer TOKEN`` (else 401).
        :param rate: bytes per second each file response is held to (0: as fast as it goes)."""
        self.host = host
        self.token = token
        self.rate = rate
        #: forced answer to every Hub request (401, 404, 429), None: answer normally
        self.fail: int | None = None
        #: the ``Retry-After`` seconds of a forced 429
        self.retry_after = 30
        #: repo -> commit -> path -> file; repo -> branch or tag -> commit
        self.commits: dict[str, dict[str, dict[str, StandInFile]]] = {}
        self.refs: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()
        #: ``"METHOD /path"`` (no query) -> requests; ``"repo/path"`` -> content bytes sent, and content GETs
        self.requests: Counter[str] = Counter()
        self.bytes_served: Counter[str] = Counter()
        self.downloads: Counter[str] = Counter()
        #: ``(repo/path, first byte)`` of every content GET, in order (a resumed download starts past 0)
        self.starts: list[tuple[str, int]] = []
        #: Authorization headers the CDN origin received (the library must not send the token there)
        self.cdn_authorizations: list[str] = []
        self._servers: list[http.server.ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []

    # -- content -----------------------------------------------------------------------------------

    def add_model(
        self, repo: str, files: Mapping[str, bytes | Path], *, branch: str = "main", lfs_min: int = 1_000_000
    ) -> str:
        """Commit ``files`` (path -> bytes, or a file on disk) to ``repo`` on ``branch``; the commit sha.

        Files of ``lfs_min`` bytes or more, and weight files (``.safetensors``...), are stored with LFS.
        """
        made = {path: _make_file(path, content, lfs_min) for path, content in files.items()}
        parent = self.refs.get(repo, {}).get(branch, "")
        listing = "".join(f"{f.path}\0{f.blob_id}\n" for f in sorted(made.values(), key=lambda f: f.path))
        commit = hashlib.sha1(f"{parent}\n{listing}".encode(), usedforsecurity=False).hexdigest()
        with self._lock:
            self.commits.setdefault(repo, {})[commit] = made
            self.refs.setdefault(repo, {})[branch] = commit
        return commit

    def total_bytes_served(self) -> int:
        """Content bytes sent, every file together."""
        with self._lock:
            return sum(self.bytes_served.values())

    # -- servers -----------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The Hub's base URL (``--hub-endpoint``)."""
        return f"http://{self.host}:{self._servers[0].server_address[1]}"

    @property
    def cdn(self) -> str:
        """The base URL LFS files are redirected to."""
        return f"http://{self.host}:{self._servers[1].server_address[1]}"

    def start(self) -> HubStandIn:
        """Start the Hub and its CDN on free ports of :attr:`host`; returns self."""
        for role in ("hub", "cdn"):
            server = http.server.ThreadingHTTPServer((self.host, 0), _Handler)
            server.daemon_threads = True
            server.stand_in = self  # type: ignore[attr-defined]
            server.role = role  # type: ignore[attr-defined]
            thread = threading.Thread(
                target=server.serve_forever, args=(0.05,), name=f"hub stand-in {role}", daemon=True
            )
            thread.start()
            self._servers.append(server)
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop both servers and wait for their threads."""
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> HubStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what the handler asks ---------------------------------------------------------------------

    def _count(self, key: str, counter: Counter[str], amount: int = 1) -> None:
        with self._lock:
            counter[key] += amount

    def _commit(self, repo: str, revision: str) -> str | None:
        with self._lock:
            if revision in self.commits.get(repo, {}):
                return revision
            return self.refs.get(repo, {}).get(revision)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Quiet: tests read the counters instead."""

    @property
    def hub(self) -> HubStandIn:
        return self.server.stand_in

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(head=False)

    # -- plumbing ------------------------------------------------------------------------------------

    def _send(self, status: int, headers: Mapping[str, str], body: bytes = b"", head: bool = False) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str, head: bool, **extra: str) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message, **extra}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, headers, json.dumps({"error": message}).encode(), head)

    def _answer(self, head: bool) -> None:
        split = urlsplit(self.path)
        self.hub._count(f"{self.command} {split.path}", self.hub.requests)
        try:
            if self.server.role == "cdn":
                self._cdn(split.path, head)
            else:
                self._hub(split.path, parse_qs(split.query), head)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _refused(self, head: bool) -> bool:
        """Answer a forced failure or a missing/wrong token; whether it did."""
        fail = self.hub.fail
        if fail == 429:
            retry = str(self.hub.retry_after)
            self._error(429, None, "You have been rate-limited", head, **{"Retry-After": retry})
        elif fail == 404:
            self._error(404, "RepoNotFound", "Repository not found", head)
        elif fail is not None:
            self._error(fail, None, "Invalid credentials in Authorization header", head)
        if fail is not None:
            return True
        if self.hub.token is None:
            return False
        given = self.headers.get("Authorization")
        if given is None:
            self._error(401, "RepoNotFound", "Invalid username or password.", head)
            return True
        if given != f"Bearer {self.hub.token}":
            self._error(401, None, "Invalid credentials in Authorization header", head)
            return True
        return False

    def _hub(self, path: str, query: dict[str, list[str]], head: bool) -> None:
        if self._refused(head):
            return
        parts = path.lstrip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            self._tree(f"{parts[2]}/{parts[3]}", unquote(parts[5]), head)
        elif (
            parts[:2] == ["api", "models"]
            and len(parts) in (4, 6)
            and (len(parts) == 4 or parts[4] == "revision")
        ):
            repo = f"{parts[2]}/{parts[3]}"
            revision = unquote(parts[5]) if len(parts) == 6 else "main"
            self._model_info(
                repo, revision, query.get("blobs") == ["true"] or query.get("blobs") == ["True"], head
            )
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo = f"{parts[0]}/{parts[1]}"
            self._resolve(repo, unquote(parts[3]), unquote("/".join(parts[4:])), head)
        else:
            self._error(404, None, f"no such endpoint {path}", head)

    def _repo_and_commit(self, repo: str, revision: str, head: bool) -> str | None:
        if repo not in self.hub.commits:
            self._error(404, "RepoNotFound", "Repository not found", head)
            return None
        commit = self.hub._commit(repo, revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
        return commit

    def _model_info(self, repo: str, revision: str, blobs: bool, head: bool) -> None:
        commit = self._repo_and_commit(repo, revision, head)
        if commit is None:
            return
        siblings = []
        for file in self.hub.commits[repo][commit].values():
            entry: dict[str, Any] = {"rfilename": file.path}
            if blobs:
                entry.update(size=file.size, blobId=file.blob_id)
                if file.lfs:
                    entry["lfs"] = {
                        "size": file.size,
                        "sha256": file.sha256,
                        "pointerSize": len(file.pointer()),
                    }
            siblings.append(entry)
        info = {
            "_id": commit[:24], "id": repo, "modelId": repo, "author": repo.split("/")[0], "sha": commit,
            "private": self.hub.token is not None, "gated": False, "disabled": False, "tags": [],
            "downloads": 0, "likes": 0,
            "lastModified": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()), "siblings": siblings,
        }  # fmt: skip
        self._send(200, {"Content-Type": "application/json"}, json.dumps(info).encode(), head)

    def _tree(self, repo: str, revision: str, head: bool) -> None:
        """``GET /api/models/ORG/NAME/tree/REV?recursive=true``: every file and folder, one page."""
        commit = self._repo_and_commit(repo, revision, head)
        if commit is None:
            return
        entries: list[dict[str, Any]] = []
        folders = set()
        for file in self.hub.commits[repo][commit].values():
            entry: dict[str, Any] = {
                "type": "file",
                "oid": file.blob_id,
                "size": file.size,
                "path": file.path,
            }
            if file.lfs:
                entry["lfs"] = {"oid": file.sha256, "size": file.size, "pointerSize": len(file.pointer())}
            entries.append(entry)
            folders.update("/".join(file.path.split("/")[:i]) for i in range(1, file.path.count("/") + 1))
        oid = "0" * 40
        entries += [
            {"type": "directory", "oid": oid, "size": 0, "path": folder} for folder in sorted(folders)
        ]
        self._send(200, {"Content-Type": "application/json"}, json.dumps(entries).encode(), head)

    def _resolve(self, repo: str, revision: str, path: str, head: bool) -> None:
        commit = self._repo_and_commit(repo, revision, head)
        if commit is None:
            return
        file = self.hub.commits[repo][commit].get(path)
        if file is None:
            self._error(
                404,
                "EntryNotFound",
                f"{path} does not exist on {revision}",
                head,
                **{"X-Repo-Commit": commit},
            )
            return
        common = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if file.lfs:
            target = (
                f"{self.hub.cdn}/cdn/{file.sha256}?repo={quote(repo, safe='')}&file={quote(path, safe='')}"
            )
            headers = {
                **common,
                "Location": target,
                "ETag": f'"{file.blob_id}"',
                "X-Linked-Etag": f'"{file.sha256}"',
                "X-Linked-Size": str(file.size),
                "Content-Length": "0",
            }
            self._send(302, headers, head=True)
            return
        self._content(f"{repo}/{path}", file, {**common, "ETag": f'"{file.blob_id}"'}, head)

    def _cdn(self, path: str, head: bool) -> None:
        if self.headers.get("Authorization"):
            self.hub.cdn_authorizations.append(self.headers["Authorization"])
        sha = path.rsplit("/", 1)[-1]
        for repo, commits in list(self.hub.commits.items()):
            for files in commits.values():
                for file in files.values():
                    if file.lfs and file.sha256 == sha:
                        self._content(f"{repo}/{file.path}", file, {"ETag": f'"{sha}"'}, head)
                        return
        self._error(404, None, "no such object", head)

    def _content(self, key: str, file: StandInFile, headers: dict[str, str], head: bool) -> None:
        start = 0
        wanted = self.headers.get("Range")
        if wanted:
            unit, _, spec = wanted.partition("=")
            first, _, _ = spec.partition("-")
            if unit.strip() != "bytes" or not first.isdigit() or int(first) > file.size:
                self._error(
                    416, None, f"bad range {wanted!r}", head, **{"Content-Range": f"bytes */{file.size}"}
                )
                return
            start = int(first)
        status = 206 if wanted else 200
        out = {
            **headers,
            "Content-Type": "application/octet-stream",
            "Content-Length": str(file.size - start),
        }
        if wanted:
            out["Content-Range"] = f"bytes {start}-{max(file.size - 1, start)}/{file.size}"
        self._send(status, out, head=True)
        if head:
            return
        self.hub._count(key, self.hub.downloads)
        with self.hub._lock:
            self.hub.starts.append((key, start))
        began = time.monotonic()
        sent = 0
        for chunk in file.read(start):
            self.wfile.write(chunk)
            sent += len(chunk)
            self.hub._count(key, self.hub.bytes_served, len(chunk))
            if self.hub.rate > 0:
                ahead = sent / self.hub.rate - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
