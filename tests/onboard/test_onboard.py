"""``llmgw-onboard-node`` end to end, over a real OpenSSH server on 127.0.0.1.

The test starts Debian's ``/usr/sbin/sshd`` on a free port with its own host
key, config, pid file and an authorized key it generates, and a real
``llmgw server`` (:class:`LocalCluster`). Onboarding then logs in as root over
ssh, with the node's side redirected so this machine is not changed:

- ``--remote-root`` prefixes every path on the node (``/etc/llmgw`` lands in
  ``<tmp>/node/etc/llmgw``);
- ``--remote-path`` puts a folder first on the node's ``PATH`` holding a fake
  ``systemctl`` (it records its calls and, for ``enable --now`` and ``restart``,
  really starts the unit's ``ExecStart`` as its own process group), a fake
  ``update-ca-certificates`` and ``journalctl`` that record their calls, and
  ``python3`` (this test's base interpreter, so the release's wheels fit).

The release is built the way a release is built: ``scripts/release`` in a
fresh ``git clone`` of this repository's HEAD (a clean tree, so not
``--allow-dirty``), with the dependency wheels (``--no-isolation``:
hatchling is a test dependency, so no index is needed for it). It takes about 5 s
and is built once per module. The
agent the fake systemctl starts therefore runs the committed code from a venv
under the node root, not this working tree: that is the point.

Every process (sshd, the agent) is ended with its whole process group when the
test ends, pass or fail. Skipped, saying so, only when sshd is not installed
(``apt-get install -y openssh-server openssh-client``) or the test is not root.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgw.agent.config import load_agent_config
from llmgw.ctl.client import write_client_config
from llmgw.dev.cluster import LocalCluster
from llmgw.testing.fakes import make_adapters, make_gpus, write_fake_nvidia_smi, write_ib_sysfs
from llmgw.testing.processes import ProcessSet, free_port, wait_until
from llmgw.testing.require import REQUIRE_SSHD, require
from tests.onboard.releases import build_release

REPO = Path(__file__).resolve().parents[2]
SSHD = Path("/usr/sbin/sshd")
NODE = "gpu-node-7"

pytestmark = pytest.mark.timeout(300)

@pytest.fixture
def needs_sshd() -> None:
    """The end-to-end tests need OpenSSH and root (the unit tests at the end need neither): skipped without,
    failed in CI (``LLMGW_REQUIRE_SSHD=1``)."""
    installed = SSHD.exists() and shutil.which("ssh") is not None and shutil.which("ssh-keygen") is not None
    missing = "OpenSSH is not installed: apt-get install -y openssh-server openssh-client"
    require(installed, REQUIRE_SSHD, missing)
    require(os.geteuid() == 0, REQUIRE_SSHD, "onboarding logs in as root to a real sshd: run as root")


#: marks an end-to-end test: it runs only where :func:`needs_sshd` finds OpenSSH and root
e2e = pytest.mark.usefixtures("needs_sshd")


# -- the node side ---------------------------------------------------------------------------------

FAKE_SYSTEMCTL = r'''#!{python}
"""A fake systemctl for one node root: records calls; enable --now / restart really run ExecStart."""
import os, shlex, signal, subprocess, sys, time
ROOT = {root!r}
STATE = os.path.join(ROOT, "fake-systemd")
os.makedirs(STATE, exist_ok=True)
with open(os.path.join(STATE, "calls.log"), "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\n")
args = [a for a in sys.argv[1:] if not a.startswith("-")]
flags = [a for a in sys.argv[1:] if a.startswith("-")]
verb, units = (args[0], [u.removesuffix(".service") for u in args[1:]]) if args else ("", [])

def pid_file(unit): return os.path.join(STATE, unit + ".pid")

def running(unit):
    try:
        pid = int(open(pid_file(unit)).read())
        with open(f"/proc/{{pid}}/stat") as f:
            return pid if f.read().rpartition(")")[2].split()[0] != "Z" else None
    except (OSError, ValueError):
        return None

def start(unit):
    if running(unit):
        return
    exec_start, env = None, {{"PATH": "/usr/bin:/bin", "HOME": "/root"}}
    for line in open(os.path.join(ROOT, "etc/systemd/system", unit + ".service")):
        key, _, value = line.strip().partition("=")
        if key == "ExecStart":
            exec_start = value
        elif key == "Environment":
            name, _, v = value.partition("=")
            env[name] = v
    with open(os.path.join(STATE, unit + ".log"), "ab") as out:
        process = subprocess.Popen(shlex.split(exec_start), stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    open(pid_file(unit), "w").write(str(process.pid))
    with open(os.path.join(STATE, "started.log"), "a") as log:
        log.write(f"{{unit}} {{process.pid}}\n")

def stop(unit):
    pid = running(unit)
    if pid is None:
        return
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while running(unit) and time.monotonic() < deadline:
        time.sleep(0.05)
    if running(unit):
        os.killpg(pid, signal.SIGKILL)

for unit in units:
    if verb == "enable":
        open(os.path.join(STATE, unit + ".enabled"), "w").close()
        if "--now" in flags:
            start(unit)
    elif verb == "start":
        start(unit)
    elif verb == "restart":
        stop(unit); start(unit)
    elif verb == "stop":
        stop(unit)
    elif verb == "is-active":
        sys.exit(0 if running(unit) else 3)
    elif verb == "is-enabled":
        sys.exit(0 if os.path.exists(os.path.join(STATE, unit + ".enabled")) else 1)
    elif verb == "status":
        print(f"{{unit}}.service: " + ("active (running)" if running(unit) else "inactive (dead)"))
        sys.exit(0 if running(unit) else 3)
'''

FAKE_RECORDER = """#!/bin/sh
# A fake {name}: records its call.
mkdir -p {state}
echo "{name} $*" >> {state}/calls.log
"""

FAKE_JOURNALCTL = """#!/bin/sh
tail -n 30 {state}/llmgw-agent.log 2>/dev/null
"""


class FakeNode:
    """The node's root directory and the fake tools on its PATH."""

    def __init__(self, base: Path) -> None:
        self.root = base / "node"
        self.bin = base / "node-bin"
        self.state = self.root / "fake-systemd"
        (self.root / "etc").mkdir(parents=True)
        self.bin.mkdir()
        (self.root / "etc" / "os-release").write_text(
            'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n'
        )
        self._script("systemctl", FAKE_SYSTEMCTL.format(python=sys.executable, root=str(self.root)))
        self._script(
            "update-ca-certificates", FAKE_RECORDER.format(name="update-ca-certificates", state=self.state)
        )
        self._script("journalctl", FAKE_JOURNALCTL.format(state=self.state))
        base_python = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
        (self.bin / "python3").symlink_to(base_python)
        hardware = base / "hardware"
        hardware.mkdir()
        self.nvidia_smi = write_fake_nvidia_smi(hardware / "nvidia-smi", make_gpus(2, seed=NODE))
        self.ib_root = write_ib_sysfs(
            hardware / "infiniband", make_adapters({"mlx5_0": "ACTIVE", "mlx5_1": "ACTIVE"})
        )

    def _script(self, name: str, text: str) -> None:
        path = self.bin / name
        path.write_text(text)
        path.chmod(0o755)

    def path(self, remote: str) -> Path:
        return self.root / remote.lstrip("/")

    def calls(self) -> list[str]:
        log = self.state / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def agent_pid(self) -> int | None:
        try:
            pid = int((self.state / "llmgw-agent.pid").read_text())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def started(self) -> list[str]:
        log = self.state / "started.log"
        return log.read_text().splitlines() if log.exists() else []

    def kill_agents(self) -> None:
        """SIGKILL the process group of every agent the fake systemctl started."""
        for line in self.started():
            pid = int(line.split()[1])
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for line in self.started():
            pid = int(line.split()[1])
            deadline = time.monotonic() + 5
            while _group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A release folder built by scripts/release from a clean clone of HEAD (about 5 s)."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("a release is built from a git work tree; this is not one")
    base = tmp_path_factory.mktemp("release")
    clone = base / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    out = base / "release"
    done = build_release("--out", str(out), cwd=clone)  # with this venv's hatchling: no index needed for it
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture
def sshd(tmp_path: Path):
    """A real sshd on 127.0.0.1:<free port> taking a key made here for root; yields (port, key, process)."""
    base = tmp_path / "sshd"
    base.mkdir(mode=0o700)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(base / name)], check=True)
    authorized = base / "authorized_keys"
    authorized.write_text((base / "client_key.pub").read_text())
    authorized.chmod(0o600)
    port = free_port()
    config = base / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {base / 'host_key'}\nPidFile {base / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {authorized}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPrintMotd no\n"
        "Subsystem sftp internal-sftp\n"
    )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    processes = ProcessSet(base / "logs")
    try:
        daemon = processes.start([str(SSHD), "-D", "-e", "-f", str(config)], name="sshd")

        def listening() -> bool:
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

        wait_until(listening, 15, "sshd to listen", daemon)
        yield port, base / "client_key", daemon
    finally:
        processes.kill_all()


@pytest.fixture
def cluster(tmp_path: Path):
    """A CA and a real llmgw server; no nodes."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), poll_timeout=1)
    try:
        local.start_server()
        local.wait(lambda: local.client.request("GET", "/v1/admin/nodes"), "the server to answer", 60)
        yield local
    finally:
        local.stop_all()


@pytest.fixture
def node(tmp_path: Path):
    fake = FakeNode(tmp_path)
    try:
        yield fake
    finally:
        fake.kill_agents()


def onboard(
    cluster: LocalCluster,
    node: FakeNode,
    port: int,
    key: Path,
    release: Path,
    tmp_path: Path,
    fabric: str = "ib-a",
) -> subprocess.CompletedProcess[str]:
    admin = tmp_path / "admin-config"
    if not admin.exists():
        write_client_config(
            admin,
            cluster.server_url,
            cluster.ca.cert_path,
            cluster.admin_tls.cert_path,
            cluster.admin_tls.key_path,
        )
    argv = [
        sys.executable, "-m", "llmgw.onboard",
        "--node", NODE,
        "--addr", f"127.0.0.1:{port}",
        "--server", cluster.server_url,
        "--fabric", fabric,
        "--ca-dir", str(cluster.ca.directory),
        "--ssh-key", str(key),
        "--release", str(release),
        "--admin-config-dir", str(admin),
        "--nvidia-smi", str(node.nvidia_smi),
        "--ib-root", str(node.ib_root),
        "--wait", "60",
        "--remote-root", str(node.root),
        "--remote-path", str(node.bin),
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)


def item_statuses(output: str) -> dict[str, str]:
    """``{item: status}`` from onboarding's per-item lines."""
    names = ("release", "certificate", "key", "CA root", "trust store", "agent config", "systemd unit")
    found = {}
    for line in output.splitlines():
        stripped = line.strip()
        for name in names:
            if stripped.startswith(name + " "):
                rest = stripped[len(name) :].split()
                if rest and rest[0] in ("installed", "updated", "unchanged"):
                    found[name] = rest[0]
    return found


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- tests -----------------------------------------------------------------------------------------


@e2e
def test_onboards_a_node_over_ssh_and_a_rerun_changes_nothing(cluster, node, sshd, release_dir, tmp_path):
    """Files land with their modes, the root is trusted, the release runs and arrives; re-runs are safe."""
    port, key, daemon = sshd
    started = time.monotonic()
    first = onboard(cluster, node, port, key, release_dir, tmp_path)
    output = first.stdout + first.stderr
    print(output)
    # (sshd refuses root with a locked password, "!" in /etc/shadow, even for a key: its log says so)
    assert first.returncode == 0, output + _agent_log(node) + "\n" + daemon.stderr_tail()
    assert item_statuses(output) == dict.fromkeys(
        ("release", "certificate", "key", "CA root", "trust store", "agent config", "systemd unit"),
        "installed",
    ), output
    assert f"onboarded {NODE}" in output
    assert "What onboarding did not do" in output and "llmgw ctl nodes" in output
    assert "engines" in output and "weights" in output

    # identity: key 0600 root, certificate and CA root 0644, the CA's own root
    etc = node.path("/etc/llmgw")
    assert mode(etc / "node.key") == 0o600 and (etc / "node.key").stat().st_uid == 0
    assert mode(etc / "node.pem") == 0o644 and mode(etc / "ca.pem") == 0o644
    assert (etc / "ca.pem").read_bytes() == cluster.ca.cert_path.read_bytes()
    from llmgw import pki

    assert pki.identity_of(_cert(etc / "node.pem")).name == NODE
    # the trust store: the Debian anchor and update-ca-certificates run
    anchor = node.path("/usr/local/share/ca-certificates/llmgw-ca.crt")
    assert anchor.read_bytes() == cluster.ca.cert_path.read_bytes() and mode(anchor) == 0o644
    assert "update-ca-certificates " in node.calls()
    # the agent's config is one the agent accepts, and the unit runs the release venv
    config = load_agent_config(config_file=etc / "agent.toml")
    assert (config.node, config.server, config.fabrics) == (NODE, cluster.server_url, ("ib-a",))
    assert config.key == etc / "node.key" and config.state_dir == node.path("/var/lib/llmgw-agent")
    unit = node.path("/etc/systemd/system/llmgw-agent.service").read_text()
    assert f"ExecStart={node.root}/opt/llmgw/venv/bin/llmgw agent --config {etc}/agent.toml" in unit
    calls = [c for c in node.calls() if not c.startswith(("is-active", "is-enabled"))]
    assert calls == ["update-ca-certificates ", "daemon-reload", "enable --now llmgw-agent"]

    # the agent runs from the installed release venv, which is a built release of HEAD, not this tree
    pid = node.agent_pid()
    assert pid is not None, _agent_log(node)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert argv[0].decode().startswith(f"{node.root}/opt/llmgw/venvs/")
    assert argv[1].decode() == f"{node.root}/opt/llmgw/venv/bin/llmgw"
    manifest = json.loads((release_dir / "RELEASE").read_text())
    venv_llmgw = node.path("/opt/llmgw/venv/bin/llmgw")
    shown = json.loads(
        subprocess.run(
            [str(venv_llmgw), "version", "--json"], capture_output=True, text=True, check=True, cwd=tmp_path
        ).stdout
    )
    assert (shown["source"], shown["commit"], shown["dirty"]) == ("build", manifest["commit"], False)
    where = subprocess.run(
        [str(node.path("/opt/llmgw/venv/bin/python")), "-c", "import llmgw; print(llmgw.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.strip()
    assert str(Path(where).resolve()).startswith(f"{node.root}/opt/llmgw/venvs/"), where

    # the server sees the node arrive, on its fabric, with the fake GPUs
    nodes = {n["node_id"]: n for n in cluster.client.request("GET", "/v1/admin/nodes")["nodes"]}
    assert nodes[NODE]["state"] == "ready" and nodes[NODE]["fabrics"] == ["ib-a"]
    assert nodes[NODE]["gpus_total"] == 2
    assert f"server: {NODE} is ready" in output

    # a second run: every item unchanged, the agent not restarted
    calls_before = len(node.calls())
    second = onboard(cluster, node, port, key, release_dir, tmp_path)
    output2 = second.stdout + second.stderr
    print(output2)
    assert second.returncode == 0, output2
    assert set(item_statuses(output2).values()) == {"unchanged"} and len(item_statuses(output2)) == 7, output2
    assert "certificate: keeping serial" in output2
    assert "the agent was not restarted" in output2
    assert node.agent_pid() == pid and len(node.started()) == 1
    new_calls = node.calls()[calls_before:]
    assert not [
        c for c in new_calls if c.split()[0] in ("restart", "enable", "start", "stop", "daemon-reload")
    ]
    assert not [c for c in new_calls if c.startswith("update-ca-certificates")]

    # a changed setting: only the agent's config is updated, and the agent is restarted to read it;
    # what the operator added to agent.toml since (an engine, a port range) is kept
    sim = node.path("/opt/llmgw/venv/bin/llmgw-sim")
    with (etc / "agent.toml").open("a") as f:
        f.write(f'port_range = "21000-21999"\n\n[engines.sim]\nllmgw-sim = "{sim}"\n')
    third = onboard(cluster, node, port, key, release_dir, tmp_path, fabric="ib-b")
    output3 = third.stdout + third.stderr
    print(output3)
    assert third.returncode == 0, output3 + _agent_log(node)
    statuses = item_statuses(output3)
    assert statuses.pop("agent config") == "updated" and set(statuses.values()) == {"unchanged"}, output3
    assert "restart llmgw-agent" in node.calls() and len(node.started()) == 2
    assert node.agent_pid() not in (None, pid)
    nodes = {n["node_id"]: n for n in cluster.client.request("GET", "/v1/admin/nodes")["nodes"]}
    assert nodes[NODE]["fabrics"] == ["ib-b"], "onboarding returned before the restarted agent synced"
    assert "keeping the node's own port_range, engines" in output3
    config = load_agent_config(config_file=etc / "agent.toml")
    assert config.port_range == (21000, 21999) and config.engines == {"sim": {"llmgw-sim": str(sim)}}
    assert config.fabrics == ("ib-b",)
    print(f"onboarding test took {time.monotonic() - started:.1f} s")


@e2e
def test_refuses_what_is_not_a_release(cluster, node, sshd, release_dir, tmp_path):
    """A working tree, a dirty manifest or a changed wheel is refused before anything is issued or copied."""
    port, key, _ = sshd
    records_before = sorted(p.name for p in (cluster.ca.directory / "issued").iterdir())

    tree = onboard(cluster, node, port, key, REPO, tmp_path)
    assert tree.returncode == 2
    assert "is a source tree" in tree.stderr and "scripts/release" in tree.stderr

    dirty = tmp_path / "dirty"
    shutil.copytree(release_dir, dirty)
    manifest = json.loads((dirty / "RELEASE").read_text())
    (dirty / "RELEASE").write_text(json.dumps({**manifest, "dirty": True}))
    done = onboard(cluster, node, port, key, dirty, tmp_path)
    assert done.returncode == 2
    assert "uncommitted changes" in done.stderr and "scripts/release" in done.stderr

    changed = tmp_path / "changed"
    shutil.copytree(release_dir, changed)
    wheel = next(d["wheel"] for d in manifest["distributions"] if d["name"] == "llmgw-engine-sim")
    with open(changed / wheel, "ab") as f:
        f.write(b"\0")
    done = onboard(cluster, node, port, key, changed, tmp_path)
    assert done.returncode == 2 and f"{wheel} changed since the release was built" in done.stderr

    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy2(changed / wheel, loose / wheel)
    done = onboard(cluster, node, port, key, loose, tmp_path)
    assert done.returncode == 2 and "no RELEASE manifest" in done.stderr

    assert sorted(p.name for p in (cluster.ca.directory / "issued").iterdir()) == records_before
    assert not node.path("/etc/llmgw").exists() and node.calls() == []


def _cert(path: Path):
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes())


def _agent_log(node: FakeNode) -> str:
    log = node.state / "llmgw-agent.log"
    return "\n--- agent log ---\n" + (log.read_text(errors="replace")[-3000:] if log.exists() else "(none)")


# -- units: no ssh ---------------------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_release(
    folder: Path, *, version: str = "1.2.0", commit: str = COMMIT, editable: bool = False
) -> Path:
    """A minimal folder shaped as scripts/release writes it: two tiny wheels and a RELEASE manifest."""
    import hashlib
    import zipfile

    folder.mkdir()
    wheels = {
        "llmgw": f"llmgw-{version}-py3-none-any.whl",
        "llmgw-engine-sim": "llmgw_engine_sim-0.1.0-py3-none-any.whl",
    }
    with zipfile.ZipFile(folder / wheels["llmgw"], "w") as wheel:
        wheel.writestr("llmgw/__init__.py", "")
        wheel.writestr("llmgw/_build_info.py", f'COMMIT = "{commit}"\n')
        if editable:
            wheel.writestr("_llmgw.pth", "/home/someone/llmgw\n")
    with zipfile.ZipFile(folder / wheels["llmgw-engine-sim"], "w") as wheel:
        wheel.writestr("llmgw_engine_sim/__init__.py", "")
    files = sorted(p.name for p in folder.iterdir())
    manifest = {
        "format": 1,
        "llmgw": version,
        "commit": commit,
        "dirty": False,
        "tag": f"llmgw-v{version}",
        "tags_at_commit": [f"llmgw-v{version}"],
        "distributions": [
            {"name": "llmgw", "version": version, "wheel": wheels["llmgw"]},
            {"name": "llmgw-engine-sim", "version": "0.1.0", "wheel": wheels["llmgw-engine-sim"]},
        ],
        "dependencies": [],
        "dependencies_for": None,
        "sha256": {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in files},
    }
    (folder / "RELEASE").write_text(json.dumps(manifest))
    return folder


class TestCheckRelease:
    """check_release accepts what scripts/release built and refuses anything else, saying how to build it."""

    def test_accepts_a_release(self, tmp_path):
        """A whole, clean release is accepted, with the distributions to install."""
        from llmgw.onboard import check_release

        release = check_release(fake_release(tmp_path / "r"))
        assert release.names == ["llmgw", "llmgw-engine-sim"]
        assert release.describe() == f"llmgw 1.2.0 at commit {COMMIT[:12]} (llmgw-v1.2.0)"

    @pytest.mark.parametrize(
        ("spoil", "message"),
        [
            (lambda d: (d / "RELEASE").unlink(), "holds wheels but no RELEASE manifest"),
            (lambda d: (d / "pyproject.toml").write_text("") or (d / "RELEASE").unlink(), "is a source tree"),
            (
                lambda d: (d / "extra-1.0-py3-none-any.whl").write_bytes(b"x"),
                "files not in RELEASE were added",
            ),
            (
                lambda d: (d / "llmgw_engine_sim-0.1.0-py3-none-any.whl").unlink(),
                "files listed in RELEASE are missing",
            ),
            (lambda d: (d / "RELEASE").write_text("[]"), "RELEASE is not a JSON object"),
        ],
    )
    def test_refuses_a_spoilt_folder(self, tmp_path, spoil, message):
        """No manifest, a source tree, an added or a missing file is refused, pointing at scripts/release."""
        from llmgw.onboard import ReleaseError, check_release

        folder = fake_release(tmp_path / "r")
        spoil(folder)
        with pytest.raises(ReleaseError, match="scripts/release") as caught:
            check_release(folder)
        assert message in str(caught.value)

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"version": "1.2.0.dev3"}, "development or local version"),
            ({"version": "1.2.0+g1234"}, "development or local version"),
            ({"editable": True}, "is an editable wheel"),
        ],
    )
    def test_refuses_what_is_not_a_release_version(self, tmp_path, kwargs, message):
        """Development and local versions and editable wheels are not releases."""
        from llmgw.onboard import ReleaseError, check_release

        with pytest.raises(ReleaseError, match=message):
            check_release(fake_release(tmp_path / "r", **kwargs))

    def test_refuses_a_wheel_of_another_commit(self, tmp_path):
        """The llmgw wheel must record the commit the manifest names."""
        from llmgw.onboard import ReleaseError, check_release

        folder = fake_release(tmp_path / "r")
        manifest = json.loads((folder / "RELEASE").read_text())
        (folder / "RELEASE").write_text(json.dumps({**manifest, "commit": "f" * 40}))
        with pytest.raises(ReleaseError, match=f"records commit {COMMIT}, but RELEASE says f"):
            check_release(folder)


class TestAddr:
    """--addr and --ssh-port."""

    @pytest.mark.parametrize(
        ("text", "port", "expected"),
        [
            ("gpu-7", None, ("gpu-7", 22)),
            ("10.0.0.7:2222", None, ("10.0.0.7", 2222)),
            ("10.0.0.7:2222", 22, ("10.0.0.7", 22)),
            ("[fd00::7]:2200", None, ("fd00::7", 2200)),
            ("[fd00::7]", None, ("fd00::7", 22)),
        ],
    )
    def test_parses(self, text, port, expected):
        """HOST, HOST:PORT and [IPV6]:PORT; --ssh-port wins over the address's port."""
        from llmgw.onboard.remote import parse_addr

        assert parse_addr(text, port) == expected

    @pytest.mark.parametrize("text", ["", "gpu-7:ssh", "-oProxyCommand=x", "[fd00::7]x"])
    def test_refuses(self, text):
        """What ssh would misread is refused."""
        from llmgw.onboard import OnboardError
        from llmgw.onboard.remote import parse_addr

        with pytest.raises(OnboardError):
            parse_addr(text, None)


class TestWaitForNode:
    """The wait for the node ends with the server's refusal or the agent's log."""

    class Admin:
        def __init__(self, nodes, events):
            self.nodes, self.events = nodes, events

        def request(self, method, path, reply, **kwargs):
            """Answer as the admin API does: the JSON of a node or event list, read as ``reply``."""
            from llmgw.wire import from_json

            data = {"nodes": self.nodes} if path.endswith("/nodes") else {"events": self.events}
            return from_json(data, reply)

    class Ssh:
        target = "root@gpu-7:22"

        def run(self, script, **kwargs):
            return "agent: sync refused (403)\n"

    def settings(self, wait: float = 5.0):
        from llmgw.onboard import Settings

        return Settings(
            node=NODE,
            server="https://s:7443",
            address="10.0.0.7",
            fabrics=(),
            ca_dir=Path("/ca"),
            release=None,
            wait=wait,
        )

    def test_prints_the_servers_refusal_and_the_agents_log(self):
        """A refusal event naming the node ends the wait with the server's message and the agent's log."""
        from llmgw.onboard import OnboardError
        from llmgw.onboard.node import _wait_for_node

        events = [
            {
                "id": 9,
                "at": 0.0,
                "kind": "refusal",
                "subject": NODE,
                "message": "sync refused: certificate is for 'x'",
            }
        ]
        with pytest.raises(OnboardError) as caught:
            _wait_for_node(
                self.settings(), self.Ssh(), self.Admin([], events), lambda s: None, since_restart=None
            )
        text = str(caught.value)
        assert f"the server refused {NODE}: sync refused: certificate is for 'x'" in text
        assert "agent: sync refused (403)" in text

    def test_a_node_that_never_arrives_times_out_with_the_agents_log(self):
        """No sync within --wait: the error says so and shows the agent's log."""
        from llmgw.onboard import OnboardError
        from llmgw.onboard.node import _wait_for_node

        with pytest.raises(
            OnboardError, match="did not appear in the server's node list within 0 s"
        ) as caught:
            _wait_for_node(
                self.settings(0.0), self.Ssh(), self.Admin([], []), lambda s: None, since_restart=None
            )
        assert "agent: sync refused (403)" in str(caught.value)


class TestNodeCredentials:
    """The node's certificate is issued once and kept while the CA's records say it is good."""

    def test_issues_keeps_and_reissues_after_revocation(self, tmp_path):
        """First run issues, the next keeps the same serial, and a revoked one is replaced."""
        from llmgw import pki
        from llmgw.onboard.node import node_credentials

        ca = pki.init_ca(tmp_path / "ca")
        said: list[str] = []
        first = node_credentials(ca.directory, NODE, said.append)
        assert said[-1].startswith(f"certificate: issued serial {first.identity.serial_hex} for node {NODE}")
        assert stat.S_IMODE(first.key_path.stat().st_mode) == 0o600
        again = node_credentials(ca.directory, NODE, said.append)
        assert again.identity.serial == first.identity.serial
        assert said[-1].startswith(f"certificate: keeping serial {first.identity.serial_hex}")
        pki.revoke(ca, NODE)
        third = node_credentials(ca.directory, NODE, said.append)
        assert third.identity.serial != first.identity.serial
        assert f"serial {first.identity.serial_hex} is revoked" in said[-1]
