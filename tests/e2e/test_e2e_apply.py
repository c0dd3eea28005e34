"""`llmgw ctl apply --wait` against a real cluster: it returns when the new model serves, or says why not."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.load import routed_cluster

pytestmark = pytest.mark.timeout(240)

#: the models a catalog may add to ``chat``: two replicas of ``fresh``; ``nowhere``, on more GPUs than a node
MORE = {"fresh": model("{models}/fresh", replicas=2), "nowhere": model("{models}/fresh", "huge")}


def catalog_with(*more: str) -> str:
    """``chat`` on one GPU, and the models of :data:`MORE` named in ``more``."""
    models = {"chat": model("{models}/chat")} | {name: MORE[name] for name in more}
    return catalog_yaml(models, one=sim_profile(1), huge=sim_profile(64))


@pytest.fixture
def cluster(tmp_path: Path):
    """Server, 2 agents and a gateway; one model ready and routed."""
    (tmp_path / "models" / "fresh").mkdir(parents=True)
    with routed_cluster(tmp_path, catalog_with()) as local:
        yield local


def test_apply_wait_returns_once_a_new_model_serves(cluster, tmp_path):
    """`apply --wait` adding a model returns once both its replicas are ready: a request right after succeeds.

    Then a model no node can hold makes `apply --wait --timeout 3` exit 1, naming the model and why.
    """
    ctl = cluster.ctl
    models = tmp_path / "models"
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(catalog_with("fresh").format(models=models))
    applied = ctl("apply", "--wait", "--timeout", "90", str(catalog))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    body = {"model": "fresh", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = httpx.post(f"{cluster.gateway_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    lines = applied.stdout.splitlines()
    assert "  + model fresh: added: 2 replicas to place" in lines
    assert lines[-2:] == ["fresh: 2/2 ready", "revision 2: all 3 replicas ready"]
    assert "chat: 1/1 ready" in lines and lines.count("chat: 1/1 ready") == 1, "unchanged progress repeated"
    assert any(line.startswith(("fresh: 0/2 ready", "fresh: 1/2 ready")) for line in lines)
    ready = [r for r in cluster.replicas().replicas if r.model == "fresh" and r.state == "ready"]
    assert len(ready) == 2

    wide = ctl("replicas", "--wide")
    assert wide.returncode == 0, wide.stderr
    row = next(line for line in wide.stdout.splitlines() if line.startswith("fresh-0 "))
    assert f"--model {models}/fresh" in row and "CUDA_VISIBLE_DEVICES=" in row and ".log" in row
    described = ctl("describe", "replica", "fresh-0")
    assert described.returncode == 0, described.stderr
    log = next(line.split()[-1] for line in described.stdout.splitlines() if line.startswith("  log "))
    assert Path(log).exists(), described.stdout
    engine = next(line.split()[-1] for line in described.stdout.splitlines() if line.startswith("  engine "))
    assert engine != "-", described.stdout
    missing = ctl("describe", "replica", "nope-0")
    assert missing.returncode == 1 and "no replica 'nope-0' (replicas: " in missing.stderr

    catalog.write_text(catalog_with("fresh", "nowhere").format(models=models))
    stuck = ctl("apply", "--wait", "--timeout", "3", str(catalog))
    assert stuck.returncode == 1
    assert "not every replica was ready within 3 s" in stuck.stderr
    assert "nowhere: 0/1 ready (1 cannot be placed)" in stuck.stderr
    assert "nowhere-0: " in stuck.stderr
