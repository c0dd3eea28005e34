"""Model files between two agents over real mutual TLS: verified, resumed, and served to nodes only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from cryptography import x509

from llmgw import pki
from llmgw.agent.models_dir import ModelsDir
from llmgw.agent.peer_files import PeerError, PeerFiles, fetch_file, peer_client_context
from llmgw.testing.agent import ADDRESS
from llmgw.weights import compute_manifest, file_sha256

SIZE = 3 * 1024 * 1024 + 17


@pytest.fixture
def seed(tmp_path: Path) -> Path:
    root = tmp_path / "seed"
    root.mkdir()
    (root / "weights.bin").write_bytes(os.urandom(SIZE))
    (root / "config.json").write_bytes(b'{"a": 1}')
    return root


async def start_peer(nursery, test_pki, tmp_path, seed: Path, **options) -> tuple[PeerFiles, int, object]:
    """node-1 serving the seed's files; returns (server, port, manifest)."""
    issued = test_pki.client("node", "node-1")
    peers = PeerFiles(ModelsDir(tmp_path / "models-1"), **options)
    manifest = compute_manifest(seed, f"seed://{seed}", made_by="node-1")
    peers.offer(manifest, seed, seed=True)
    context = pki.server_ssl_context(issued.cert_path, issued.key_path, test_pki.ca.cert_path)
    port = await nursery.start(peers.serve, context, ADDRESS, 0)
    return peers, port, manifest


def client(test_pki, role: str = "node", name: str = "node-2"):
    issued = test_pki.client(role, name)
    return peer_client_context(issued.cert_path, issued.key_path)


def ca_of(test_pki) -> x509.Certificate:
    return x509.load_pem_x509_certificate(test_pki.ca.cert_path.read_bytes())


async def test_a_file_arrives_whole_and_matches_its_sha256(nursery, test_pki, tmp_path, seed):
    """node-2 fetches a 3 MB file from node-1 and it hashes to the manifest's sha256."""
    peers, port, manifest = await start_peer(nursery, test_pki, tmp_path, seed)
    file = manifest.file("weights.bin")
    partial = tmp_path / "copy" / "weights.bin.part"
    got = []
    digest = await fetch_file(
        client(test_pki),
        ca_of(test_pki),
        ("node-1", ADDRESS, port),
        manifest.digest,
        file,
        partial,
        got.append,
    )
    assert partial.stat().st_size == SIZE and sum(got) == SIZE
    assert file_sha256(partial) == file.sha256 == digest  # the digest given is that of the bytes written
    assert peers.bytes_served == SIZE


async def test_a_partial_file_resumes_where_it_stopped(nursery, test_pki, tmp_path, seed):
    """A file half there is completed with only its missing bytes."""
    peers, port, manifest = await start_peer(nursery, test_pki, tmp_path, seed)
    file = manifest.file("weights.bin")
    partial = tmp_path / "copy" / "weights.bin.part"
    partial.parent.mkdir()
    partial.write_bytes((seed / "weights.bin").read_bytes()[:1_000_000])
    digest = await fetch_file(
        client(test_pki), ca_of(test_pki), ("node-1", ADDRESS, port), manifest.digest, file, partial
    )
    assert file_sha256(partial) == file.sha256 == digest
    assert peers.bytes_served == SIZE - 1_000_000


async def test_a_wrong_byte_kept_from_a_partial_file_shows_in_the_digest(nursery, test_pki, tmp_path, seed):
    """The digest fetch_file gives covers the resumed bytes read from disk, not only those received."""
    _, port, manifest = await start_peer(nursery, test_pki, tmp_path, seed)
    file = manifest.file("weights.bin")
    partial = tmp_path / "copy" / "weights.bin.part"
    partial.parent.mkdir()
    kept = bytearray((seed / "weights.bin").read_bytes()[:1_000_000])
    kept[500_000] ^= 0xFF
    partial.write_bytes(bytes(kept))
    digest = await fetch_file(
        client(test_pki), ca_of(test_pki), ("node-1", ADDRESS, port), manifest.digest, file, partial
    )
    assert digest == file_sha256(partial) != file.sha256


async def test_only_node_certificates_get_files(nursery, test_pki, tmp_path, seed):
    """An admin certificate is refused with 403; a peer is checked to be the node asked for."""
    _, port, manifest = await start_peer(nursery, test_pki, tmp_path, seed)
    file = manifest.file("config.json")
    partial = tmp_path / "c.part"
    with pytest.raises(PeerError, match="answered 403: model files are served to node certificates only"):
        await fetch_file(client(test_pki, "admin", "alice"), ca_of(test_pki), ("node-1", ADDRESS, port),
                         manifest.digest, file, partial)  # fmt: skip
    with pytest.raises(PeerError, match="not node node-3"):
        await fetch_file(
            client(test_pki), ca_of(test_pki), ("node-3", ADDRESS, port), manifest.digest, file, partial
        )
    other_ca = pki.init_ca(tmp_path / "other-ca")
    with pytest.raises(PeerError, match="not issued by this fleet's CA"):
        await fetch_file(
            client(test_pki), other_ca.cert, ("node-1", ADDRESS, port), manifest.digest, file, partial
        )


async def test_files_outside_the_manifest_are_not_served(nursery, test_pki, tmp_path, seed):
    """A file not named in a manifest (or of an unknown copy) is a 404, even when it exists."""
    _, port, manifest = await start_peer(nursery, test_pki, tmp_path, seed)
    (seed / "secret.txt").write_bytes(b"no")
    sneaky = type(manifest.files[0])("secret.txt", 2, "0" * 64)
    with pytest.raises(PeerError, match="answered 404"):
        peer = ("node-1", ADDRESS, port)
        await fetch_file(client(test_pki), ca_of(test_pki), peer, manifest.digest, sneaky, tmp_path / "s")
    with pytest.raises(PeerError, match="answered 404"):
        await fetch_file(client(test_pki), ca_of(test_pki), ("node-1", ADDRESS, port), "f" * 64,
                         manifest.files[0], tmp_path / "s.part")  # fmt: skip


async def test_a_busy_peer_says_so(nursery, test_pki, tmp_path, seed):
    """Past --max-uploads, a peer answers 503 at once so the fetcher tries another node."""
    peers, port, manifest = await start_peer(nursery, test_pki, tmp_path, seed, max_uploads=1)
    peers.uploading = 1
    with pytest.raises(PeerError, match="answered 503: busy"):
        await fetch_file(client(test_pki), ca_of(test_pki), ("node-1", ADDRESS, port), manifest.digest,
                         manifest.files[0], tmp_path / "b.part")  # fmt: skip


async def test_bandwidth_limit_paces_uploads(nursery, test_pki, tmp_path, seed):
    """With --bandwidth-limit 10 (MB/s), 3 MB take at least about 0.2 s (the first 1 MB goes at once)."""
    _, port, manifest = await start_peer(nursery, test_pki, tmp_path, seed, bandwidth_limit=10)
    started = trio.current_time()
    await fetch_file(client(test_pki), ca_of(test_pki), ("node-1", ADDRESS, port), manifest.digest,
                     manifest.file("weights.bin"), tmp_path / "w.part")  # fmt: skip
    assert trio.current_time() - started >= 0.2
