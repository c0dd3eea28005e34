"""Model files between nodes: each agent serves the files of its copies, and fetches from the others.

The server side (:class:`PeerFiles`) answers ``GET /v1/peer/files/DIGEST/PATH``
(``Range: bytes=N-`` resumes) over mutual TLS, to node certificates only,
read-only, and only files a manifest names: a seed's files as they are, a
copy's files once verified. A peer asking with ``X-Llmgw-Partial: 1`` also
gets the bytes of a file still being fetched here (a Hub download), followed
as they grow (:func:`fetch_file` with ``follow``): so when the downloading node dies, the
fleet still has what it had downloaded (the copy verifies the whole file
later, against the manifest). At most ``max_uploads`` files go out at once (a
peer asking for more gets 503 and tries another node), and all of them
together within ``bandwidth_limit``.

The client side (:func:`fetch_file`) speaks HTTP/1.1 over its own TLS
connection: node certificates carry the client purpose only, so the chain is
verified after the handshake (issued by the CA, in its validity, a node's,
with the node id asked for), not by OpenSSL's server-purpose check.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import http.client
import logging
import os
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from urllib.parse import quote, unquote

import attrs
import trio
from cryptography import x509

from llmgw.agent.models_dir import PARTIAL_SUFFIX, ModelsDir
from llmgw.net.server import HttpServer, Request, Response
from llmgw.pki import IdentityError, PkiError, Role, peer_identity
from llmgw.weights import Manifest, ManifestFile

__all__ = [
    "PeerError", "PeerFiles", "fetch_file", "in_worker", "peer_client_context", "verify_peer"
]  # fmt: skip

log = logging.getLogger("llmgw.agent.peers")

_CHUNK = 1024 * 1024
#: bytes received (into one reused buffer), hashed and written at a time
_WRITE_BLOCK = 1024 * 1024
#: seconds without a byte from a peer after which it counts as gone (a machine that stopped answering)
STALL_TIMEOUT = 30.0
#: seconds between two looks at a partial file being followed
FOLLOW_POLL = 0.1
#: the request header asking for the bytes of a file still being fetched
PARTIAL_HEADER = "x-llmgw-partial"


class PeerError(Exception):
    """A peer could not give a file: unreachable, refused, busy, or sent something else."""


@attrs.define
class _Offer:
    manifest: Manifest
    root: Path
    seed: bool


class _Bucket:
    """A token bucket shared by every upload: ``rate`` bytes per second in all (0: no limit)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.next_free = 0.0

    async def take(self, size: int) -> None:
        if self.rate <= 0:
            return
        now = trio.current_time()
        start = max(now, self.next_free)
        self.next_free = start + size / self.rate
        if start > now:
            await trio.sleep(start - now)


class PeerFiles:
    """What this node serves to its peers; :meth:`serve` runs the HTTPS server."""

    def __init__(self, models: ModelsDir, *, max_uploads: int = 4, bandwidth_limit: float = 0.0) -> None:
        """:param bandwidth_limit: MB/s in all (0: no limit)."""
        self.models = models
        self.max_uploads = max_uploads
        self.bucket = _Bucket(bandwidth_limit * 1e6)
        self.offers: dict[str, _Offer] = {}
        #: uploads in progress, and bytes sent since start (for tests and benchmarks)
        self.uploading = 0
        #: copy digest -> its files being sent now (such a copy is not evicted)
        self.sending: dict[str, int] = {}
        #: (copy digest, path) of the files being written here now (from the Hub or a peer)
        self.writing: set[tuple[str, str]] = set()
        self.bytes_served = 0
        self.port: int | None = None

    @contextlib.contextmanager
    def write(self, digest: str, path: str) -> Iterator[None]:
        """While in it, ``path`` of copy ``digest`` is being fetched here: peers following it wait."""
        self.writing.add((digest, path))
        try:
            yield
        finally:
            self.writing.discard((digest, path))

    def offer(self, manifest: Manifest, root: Path, *, seed: bool) -> None:
        """Serve the files of ``manifest`` under ``root`` (a copy's files only once verified)."""
        self.offers[manifest.digest] = _Offer(manifest, root, seed)

    async def serve(
        self, ssl_context: ssl.SSLContext, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled; ``task_status.started(port)`` once bound."""
        server = HttpServer(self.handle, ssl_context=ssl_context)

        async def bound(task_status=trio.TASK_STATUS_IGNORED) -> None:
            await server.serve(host, port, task_status=task_status)

        async with trio.open_nursery() as nursery:
            address = await nursery.start(bound)
            self.port = address[1]
            task_status.started(self.port)

    async def handle(self, request: Request) -> Response:
        """Answer one peer: the file asked for, from the offset its Range asks, or why not."""
        try:
            identity = peer_identity(request.peer_cert_der)
        except IdentityError as exc:
            return Response.text(401, f"client certificate refused: {exc}")
        if identity.role is not Role.NODE:
            return Response.text(403, f"model files are served to node certificates only, not {identity}")
        prefix = "/v1/peer/files/"
        if request.method != "GET" or not request.path.startswith(prefix):
            return Response.text(404, f"no such endpoint: {request.method} {request.path}")
        digest, _, raw_path = request.path[len(prefix) :].partition("/")
        offer = self.offers.get(digest)
        file = offer.manifest.file(unquote(raw_path)) if offer is not None else None
        if offer is None or file is None:
            return Response.text(404, f"no file {unquote(raw_path)!r} of copy {digest[:12]} here")
        path = offer.root / file.path
        usable = await trio.to_thread.run_sync(self._usable, offer, file, path)
        follow = not usable and not offer.seed and request.header(PARTIAL_HEADER) == "1"
        if follow:
            path = offer.root / (file.path + PARTIAL_SUFFIX)
            usable = await trio.to_thread.run_sync(path.is_file)
        if not usable:
            return Response.text(404, f"{file.path} of copy {digest[:12]} is not verified here yet")
        start = _range_start(request.header("range"))
        if start is None or start > file.size:
            return Response.text(416, f"Range: expected bytes=N- with N <= {file.size}")
        if self.uploading >= self.max_uploads:
            return Response.text(503, f"busy: {self.uploading} uploads already (--max-uploads)")
        self.uploading += 1
        self.sending[digest] = self.sending.get(digest, 0) + 1
        sent = [0]
        headers = [("content-range", f"bytes {start}-{max(file.size - 1, start)}/{file.size}")]
        return Response.stream(
            206 if start else 200,
            self._chunks(path, start, file.size, sent, (digest, file.path) if follow else None),
            content_type="application/octet-stream",
            headers=headers,
            after=lambda: self._done(identity.name, file, sent[0], digest),
        )

    def _usable(self, offer: _Offer, file: ManifestFile, path: Path) -> bool:
        if offer.seed:
            return path.is_file() and path.stat().st_size == file.size
        return self.models.trusted(offer.manifest, file)

    def _done(self, peer: str, file: ManifestFile, sent: int, digest: str = "") -> None:
        self.uploading -= 1
        if self.sending.get(digest, 0) > 1:
            self.sending[digest] -= 1
        else:
            self.sending.pop(digest, None)
        log.info("served %s to %s: %d bytes", file.path, peer, sent)

    async def _chunks(
        self, path: Path, start: int, size: int, sent: list[int], follow: tuple[str, str] | None = None
    ) -> AsyncIterator[bytes]:
        """The bytes of ``path`` from ``start`` to ``size``; ``follow``: the (digest, path) of a partial
        file, waited for while it is being written here (:meth:`write`)."""
        try:
            handle = await trio.open_file(path, "rb")
        except OSError:
            return  # a partial file renamed (verified) or removed since: the asker asks again
        try:
            await handle.seek(start)
            left = size - start
            while left > 0:
                data = await handle.read(min(_CHUNK, left))
                if not data and follow in self.writing:
                    await trio.sleep(FOLLOW_POLL)
                    continue
                if not data:
                    return
                await self.bucket.take(len(data))
                left -= len(data)
                self.bytes_served += len(data)
                sent[0] += len(data)
                yield data
        finally:
            await handle.aclose()


def _range_start(header: str | None) -> int | None:
    if header is None:
        return 0
    unit, _, spec = header.strip().partition("=")
    first, dash, last = spec.partition("-")
    if unit != "bytes" or not dash or last or not first.isdigit():
        return None
    return int(first)


# -- the client side ---------------------------------------------------------------------------------


def peer_client_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A TLS client context presenting this node's certificate; the peer is checked by :func:`verify_peer`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        context.load_cert_chain(os.fspath(cert), os.fspath(key))
    except (OSError, ssl.SSLError) as exc:
        raise PkiError(f"cannot load the certificate {cert} with key {key}: {exc}") from None
    return context


def verify_peer(der: bytes | None, ca: x509.Certificate, node: str) -> None:
    """Check the certificate a peer presented: issued by ``ca``, valid now, a node's, for ``node``.

    :raises PeerError: saying which check failed.
    """
    if not der:
        raise PeerError(f"node {node} presented no certificate")
    try:
        cert = x509.load_der_x509_certificate(der)
        cert.verify_directly_issued_by(ca)
    except Exception as exc:  # noqa: BLE001 - InvalidSignature, ValueError, TypeError: all a refusal
        raise PeerError(f"node {node}'s certificate is not issued by this fleet's CA ({exc!r})") from None
    now = dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise PeerError(f"node {node}'s certificate is not valid now")
    try:
        identity = peer_identity(der)
    except IdentityError as exc:
        raise PeerError(f"node {node}'s certificate: {exc}") from None
    if identity.role is not Role.NODE or identity.name != node:
        raise PeerError(f"the peer at node {node}'s address is {identity}, not node {node}")


async def fetch_file(
    context: ssl.SSLContext,
    ca: x509.Certificate,
    peer: tuple[str, str, int],
    digest: str,
    file: ManifestFile,
    partial: Path,
    on_bytes: Callable[[int], None] = lambda n: None,
    *,
    follow: bool = False,
) -> str:
    """Fetch ``file`` of copy ``digest`` from ``peer`` (node id, address, port) into ``partial``.

    Resumes from the bytes ``partial`` already holds (hashing them first);
    returns once it holds ``file.size`` bytes, with the sha256 (hex) of exactly
    the bytes written, computed as they arrive: the caller compares it with the
    manifest's before using the file, without reading it again. The bytes
    move in a worker thread with a blocking TLS socket: TLS records are 16 KB,
    and a trio task per record costs more CPU than the copy itself.

    ``follow``: called when no peer has the file verified yet, appends the
    bytes ``peer`` holds beyond ``partial`` while it still fetches the file
    (a Hub download), as they come, until that stops or the file is whole;
    nothing is hashed (returns ""): a later fetch hashes the whole file.

    :raises PeerError: the peer could not be reached, refused, stalled, or sent too much or too little
        (or, following, has no such bytes or broke off: what came is kept).
    """
    have = await trio.to_thread.run_sync(_resume_from, partial, file.size)
    hashed = None if follow else await trio.to_thread.run_sync(_hash_prefix, partial, have)
    if have < file.size:
        target = f"/v1/peer/files/{digest}/{quote(file.path)}"
        args = (context, ca, peer, target, have, file, partial, hashed)
        await in_worker(_fetch_blocking, *args, on_bytes=on_bytes)
    return hashed.hexdigest() if hashed is not None else ""


async def in_worker(transfer: Callable[..., None], *args: object, on_bytes: Callable[[int], None]) -> None:
    """Run the blocking ``transfer(*args, report, stop)`` in a worker thread; return when it does.

    ``report(n)`` calls ``on_bytes(n)`` back in trio. When this task is
    cancelled the thread is abandoned and ``stop`` (a threading.Event) is set:
    the transfer checks it between blocks and ends. Used by peer and Hub fetches.
    """
    token = trio.lowlevel.current_trio_token()
    stop = threading.Event()

    def report(size: int) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(on_bytes, size, trio_token=token)

    try:
        await trio.to_thread.run_sync(transfer, *args, report, stop, abandon_on_cancel=True)
    finally:
        stop.set()


def _fetch_blocking(
    context: ssl.SSLContext,
    ca: x509.Certificate,
    peer: tuple[str, str, int],
    target: str,
    have: int,
    file: ManifestFile,
    partial: Path,
    hashed: hashlib._Hash | None,
    report: Callable[[int], None],
    stop: threading.Event,
) -> None:
    node, address, port = peer
    whole = hashed is not None  # else following a file still being fetched there
    headers = {"Host": node, "Range": f"bytes={have}-"}
    if not whole:
        headers[PARTIAL_HEADER] = "1"
    connection = http.client.HTTPSConnection(address, port, context=context, timeout=STALL_TIMEOUT)
    try:
        try:
            connection.connect()
        except (OSError, ssl.SSLError) as exc:
            raise PeerError(f"node {node} ({address}:{port}) unreachable: {exc}") from None
        verify_peer(connection.sock.getpeercert(binary_form=True), ca, node)
        try:
            connection.request("GET", target, headers=headers)
            response = connection.getresponse()
            if response.status not in (200, 206):
                text = response.read(300).decode(errors="replace")
                raise PeerError(f"node {node} answered {response.status}: {text}")
            received = have
            buffer = memoryview(bytearray(_WRITE_BLOCK))
            with open(partial, "ab", buffering=0) as handle:
                while not stop.is_set():
                    size = response.readinto(buffer)
                    if not size:
                        break
                    received += size
                    if received > file.size:
                        raise PeerError(f"node {node} sent more than the {file.size} bytes of {file.path}")
                    block = buffer[:size]
                    if whole:
                        hashed.update(block)
                    handle.write(block)
                    report(size)
        except TimeoutError:
            raise PeerError(f"node {node} sent nothing for {STALL_TIMEOUT:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise PeerError(f"node {node} broke the connection: {exc!r}") from None
    finally:
        connection.close()
    if whole and received != file.size and not stop.is_set():
        raise PeerError(f"node {node} sent {received} of the {file.size} bytes of {file.path}")


def _hash_prefix(partial: Path, have: int) -> hashlib._Hash:
    """A sha256 fed with the first ``have`` bytes of ``partial`` (kept by a resumed fetch); blocking."""
    hashed = hashlib.sha256()
    if have:
        with open(partial, "rb") as handle:
            while chunk := handle.read(min(_WRITE_BLOCK, have)):
                hashed.update(chunk)
                have -= len(chunk)
    return hashed


def _resume_from(partial: Path, size: int) -> int:
    """Bytes ``partial`` holds (made empty when it holds more than ``size``); blocking."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    have = partial.stat().st_size if partial.exists() else 0
    if have > size:
        partial.unlink()
        return 0
    return have
