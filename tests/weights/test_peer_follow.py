"""Following a file a peer is still fetching (a Hub download): its bytes come as they are written.

node-1 writes a file of a copy bit by bit (as its Hub download would);
node-2 follows it over real mutual TLS, gets each block as it lands, and the
stream ends when node-1 stops writing. A peer asking plainly still gets 404
until the file is verified there.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import trio

from llmgw import pki
from llmgw.agent.models_dir import ModelsDir
from llmgw.agent.peer_files import PeerError, PeerFiles, fetch_file
from llmgw.testing.agent import ADDRESS
from llmgw.weights import Manifest, ManifestFile, file_sha256
from tests.weights.test_peer_files import ca_of, client

BLOCK = 1024 * 1024


def append(path: Path, data: bytes) -> None:
    """Write ``data`` at the end of ``path`` (a block of a download landing)."""
    with open(path, "ab") as handle:
        handle.write(data)


async def test_a_file_being_written_is_followed_until_its_writer_stops(nursery, test_pki, tmp_path: Path):
    data = os.urandom(4 * BLOCK)
    file = ManifestFile("weights.bin", len(data), hashlib.sha256(data).hexdigest())
    manifest = Manifest("hf://acme/m", (file,), made_by="node-1", revision="c" * 40)
    models = ModelsDir(tmp_path / "models-1")
    models.begin(manifest)
    peers = PeerFiles(models)
    peers.offer(manifest, models.copy_dir(manifest.digest), seed=False)
    issued = test_pki.client("node", "node-1")
    context = pki.server_ssl_context(issued.cert_path, issued.key_path, test_pki.ca.cert_path)
    port = await nursery.start(peers.serve, context, ADDRESS, 0)
    peer = ("node-1", ADDRESS, port)
    source = models.partial(manifest.digest, file)
    copy = tmp_path / "copy" / "weights.bin.llmgw-partial"
    args = (client(test_pki), ca_of(test_pki), peer, manifest.digest, file, copy)

    try:
        await fetch_file(*args)
        raise AssertionError("a file not verified on node-1 should not be served whole")
    except PeerError as exc:
        assert "not verified here yet" in str(exc)

    received: list[tuple[int, int]] = []  # (bytes written on node-1 then, bytes received in all)

    async def writer() -> None:
        with peers.write(manifest.digest, file.path):
            for block in range(3):  # three of four MiB, then the writer dies
                append(source, data[block * BLOCK : (block + 1) * BLOCK])
                await trio.sleep(0.5)

    def count(size: int) -> None:
        received.append((source.stat().st_size, (received[-1][1] if received else 0) + size))

    async with trio.open_nursery() as both:
        both.start_soon(writer)
        await trio.sleep(0.1)
        with trio.fail_after(10):
            assert await fetch_file(*args, count, follow=True) == ""  # nothing verified while following
    assert copy.read_bytes() == data[: 3 * BLOCK]
    assert received[0][1] <= BLOCK, "the first block should come before the others are written"
    assert received[-1][1] == 3 * BLOCK
    # the rest, once node-1 has the file whole and verified: resumed from the bytes followed, then verified
    append(source, data[3 * BLOCK :])
    os.replace(source, models.copy_dir(manifest.digest) / file.path)
    models.mark_verified(manifest, [file.path])
    assert await fetch_file(*args) == file.sha256 == file_sha256(copy)
    assert peers.bytes_served == len(data)
