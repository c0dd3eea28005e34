"""``llmgw-provision-node`` and the Proxmox provisioner, against a fake ``qm`` on PATH.

The fake records every call and behaves like the real one where it matters:
``qm config`` of a free VMID exits 2 saying its config file does not exist;
``qm create`` on a taken VMID (a VM here, or a VM or container on another
cluster node, which ``qm config`` does not see) is refused with Proxmox's own
message; a failing import fails the create and, like ``qm create``, removes
what it made (or, in one mode, leaves the VM behind as a failed clean-up
would); ``qm start`` can fail as a VM with a passthrough problem does.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import llmgw_proxmox as proxmox
import pytest
from click.testing import CliRunner

from llmgw.dev.cluster import program
from llmgw.models import Command
from llmgw.provision import CommandResult, ExistingMachine, MachineRequest, ProvisionError, Step
from llmgw.provision.cli import provision_node
from llmgw.testing.processes import sigint_default

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBmQ6lRzZ0tZL6bMdrdWJx1EY7oQ8GIhF3l9mOTSvE1t op@laptop"

FAKE_QM = r'''#!{python}
"""A fake qm: records its calls in $FAKE_QM_STATE/calls.jsonl and keeps VM configs there."""
import json, os, sys, time, urllib.parse
from pathlib import Path

state = Path(os.environ["FAKE_QM_STATE"])
argv = sys.argv[1:]
with open(state / "calls.jsonl", "a") as log:
    log.write(json.dumps(argv) + "\n")
modes = json.loads((state / "modes.json").read_text()) if (state / "modes.json").exists() else {{}}
cluster = json.loads((state / "cluster.json").read_text()) if (state / "cluster.json").exists() else {{}}
vms = state / "vms"
vms.mkdir(exist_ok=True)

def fail(text, code=255):
    sys.stderr.write(text + "\n")
    sys.exit(code)

def conf(vmid):
    return vms / f"{{vmid}}.conf"

def options(args):
    pairs = {{}}
    while args:
        key, value, args = args[0].removeprefix("--"), args[1], args[2:]
        pairs[key] = value
    return pairs

command, vmid = argv[0], argv[1]
if command == "config":
    if modes.get("config_denied"):
        fail("Permission check failed (/vms/" + vmid + ", VM.Audit)", 255)
    if not conf(vmid).exists():
        fail(f"Configuration file 'nodes/pve/qemu-server/{{vmid}}.conf' does not exist", 2)
    sys.stdout.write(conf(vmid).read_text())
elif command == "create":
    if modes.get("race"):
        conf(vmid).write_text("name: someone-elses\nmemory: 2048\n")
    if conf(vmid).exists():
        fail(f"unable to create VM {{vmid}} - VM {{vmid}} already exists on node 'pve'")
    if vmid in cluster:
        guest = cluster[vmid]
        kind, node = guest["kind"], guest["node"]
        fail(f"unable to create VM {{vmid}} - {{kind}} {{vmid}} already exists on node '{{node}}'")
    opts = options(argv[2:])
    if modes.get("old_pve") and "ciupgrade" in opts:
        fail("400 Parameter verification failed.\nciupgrade: property is not defined in schema and the "
             "schema does not allow additional properties\nqm create <vmid> [OPTIONS]", 255)
    if "sshkeys" in opts:
        lines = [l for l in Path(opts["sshkeys"]).read_text().splitlines() if l.strip()]
        if any(l.lstrip().startswith("#") for l in lines):
            fail("SSH public key validation error")
        opts["sshkeys"] = urllib.parse.quote(Path(opts["sshkeys"]).read_text(), safe="")
    storage, _, source = opts["scsi0"].partition(":0,import-from=")
    disk = f"{{storage}}:vm-{{vmid}}-disk-0"
    print(f"  transferred 0.0 B of 2.2 GiB (0.00%)", flush=True)
    if modes.get("hang"):
        conf(vmid).write_text(f"name: {{opts['name']}}\nlock: create\n")
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            fail("received interrupt")
    if modes.get("import") or modes.get("import_leaves"):
        if modes.get("import_leaves"):
            conf(vmid).write_text(f"name: {{opts['name']}}\nlock: create\n")
        sys.stderr.write(f"qemu-img: Could not open '{{source}}': Image is not in qcow2 format\n")
        fail(f"unable to create VM {{vmid}} - copy failed: command '/usr/bin/qemu-img convert -p -n -f qcow2 "
             f"-O raw {{source}} zeroinit:/dev/pve/vm-{{vmid}}-disk-0' failed: exit code 1")
    print(f"  transferred 2.2 GiB of 2.2 GiB (100.00%)")
    print(f"scsi0: successfully created disk '{{disk}},size=2252M'")
    opts["scsi0"] = f"{{disk}},size=2252M"
    conf(vmid).write_text("".join(f"{{k}}: {{v}}\n" for k, v in sorted(opts.items())))
elif command in ("resize", "start", "destroy"):
    if not conf(vmid).exists():
        fail(f"Configuration file 'nodes/pve/qemu-server/{{vmid}}.conf' does not exist", 2)
    if command == "start":
        if modes.get("start"):
            fail("kvm: -device vfio-pci,host=0000:41:00.0,id=hostpci0,bus=ich9-pcie-port-1,addr=0x0: "
                 "vfio 0000:41:00.0: failed to setup container for group 12: Failed to set iommu for "
                 "container: Operation not permitted\nstart failed: QEMU exited with code 1")
        (vms / f"{{vmid}}.running").touch()
    elif command == "resize":
        text = conf(vmid).read_text().replace("size=2252M", f"size={{argv[3]}}")
        conf(vmid).write_text(text)
    else:
        conf(vmid).unlink()
else:
    fail(f"fake qm: unsupported command {{command!r}}", 1)
'''


class FakeQm:
    """A fake ``qm`` in its own bin directory, with its state and a log of its calls."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.state = root / "state"
        self.bin.mkdir(parents=True)
        self.state.mkdir()
        (self.state / "vms").mkdir()
        qm = self.bin / "qm"
        qm.write_text(FAKE_QM.format(python=sys.executable))
        qm.chmod(0o755)

    def calls(self) -> list[list[str]]:
        """Every call so far, as argv lists without the program name."""
        log = self.state / "calls.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def add_vm(self, vmid: int, name: str) -> None:
        """A VM on this node."""
        (self.state / "vms" / f"{vmid}.conf").write_text(f"boot: order=scsi0\ncores: 2\nname: {name}\n")

    def add_cluster_guest(self, vmid: int, kind: str, node: str) -> None:
        """A VM or container elsewhere in the cluster: ``qm config`` here does not see it."""
        (self.state / "cluster.json").write_text(json.dumps({str(vmid): {"kind": kind, "node": node}}))

    def set_mode(self, **modes: bool) -> None:
        """Make the fake fail in one of its ways (``import``, ``import_leaves``, ``start``, ``race``...)."""
        (self.state / "modes.json").write_text(json.dumps(modes))

    def config(self, vmid: int) -> str | None:
        """The fake's config of a VM, or ``None``."""
        path = self.state / "vms" / f"{vmid}.conf"
        return path.read_text() if path.exists() else None

    def running(self, vmid: int) -> bool:
        """Whether ``qm start`` succeeded for it."""
        return (self.state / "vms" / f"{vmid}.running").exists()


@pytest.fixture
def qm(tmp_path: Path) -> FakeQm:
    """A fake qm with no VM."""
    return FakeQm(tmp_path / "qm")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home directory whose ``~/.ssh/authorized_keys`` holds one key."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text(KEY + "\n")
    return home


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """A cloud image file (its content does not matter to the fake)."""
    path = tmp_path / "images" / "noble-server-cloudimg-amd64.img"
    path.parent.mkdir()
    path.write_bytes(b"QFI\xfb")
    return path


def provision_exe() -> str:
    return program("llmgw-provision-node")


def base_args(image: Path) -> list[str]:
    return [
        "--vmid", "101",
        "--name", "gpu-01",
        "--ip", "10.20.0.11/24",
        "--gateway", "10.20.0.1",
        "--bridge", "vmbr1",
        "--storage", "fast-lvm",
        "--image", str(image),
        "--cores", "32",
        "--memory", "256G",
        "--disk", "200",
        "--gpu", "0000:41:00.0",
        "--gpu", "0000:c1:00.0",
    ]  # fmt: skip


def expected_commands(image: Path, keys: str) -> list[list[str]]:
    """What a typical request makes, after the read-only check."""
    return [
        [
            "create", "101",
            "--name", "gpu-01",
            "--ostype", "l26",
            "--machine", "q35",
            "--cpu", "host",
            "--cores", "32",
            "--memory", "262144",
            "--balloon", "0",
            "--scsihw", "virtio-scsi-pci",
            "--scsi0", f"fast-lvm:0,import-from={image}",
            "--ide2", "fast-lvm:cloudinit",
            "--boot", "order=scsi0",
            "--serial0", "socket",
            "--vga", "serial0",
            "--net0", "virtio,bridge=vmbr1",
            "--ipconfig0", "ip=10.20.0.11/24,gw=10.20.0.1",
            "--ciupgrade", "0",
            "--sshkeys", keys,
            "--hostpci0", "0000:41:00.0,pcie=1",
            "--hostpci1", "0000:c1:00.0,pcie=1",
        ],
        ["resize", "101", "scsi0", "200G"],
        ["start", "101"],
    ]  # fmt: skip


def run(qm: FakeQm, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real console script, with the fake qm first on PATH and ``home`` as HOME."""
    env = {**os.environ, "PATH": f"{qm.bin}{os.pathsep}{os.environ['PATH']}", "HOME": str(home)}
    env["FAKE_QM_STATE"] = str(qm.state)
    env.pop("LLMGW_LOAD_PLUGINS", None)
    return subprocess.run(
        [provision_exe(), *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


class TestProvisionNode:
    """The console script end to end, against the fake qm."""

    def test_makes_the_vm_with_these_commands(self, qm, home, image):
        """A typical request checks the VMID, then creates with the import, grows the disk and starts."""
        done = run(qm, home, *base_args(image))
        assert done.returncode == 0, done.stderr
        keys = str(home / ".ssh" / "authorized_keys")
        assert qm.calls() == [["config", "101"], *expected_commands(image, keys)]
        config = qm.config(101)
        assert "name: gpu-01" in config and "scsi0: fast-lvm:vm-101-disk-0,size=200G" in config
        assert qm.running(101)
        assert "made VM 101 'gpu-01' (proxmox), started" in done.stdout
        assert "10.20.0.11/24 via 10.20.0.1 on vmbr1" in done.stdout
        assert "0000:41:00.0, 0000:c1:00.0" in done.stdout
        assert f"1 ssh key from {keys}" in done.stdout
        assert "no package upgrade" in done.stdout
        assert "llmgw-onboard-node --node gpu-01 --addr 10.20.0.11" in done.stdout
        assert "warning" not in done.stderr

    @pytest.mark.parametrize("dry_run", [False, True])
    def test_refuses_an_existing_vmid(self, qm, home, image, dry_run):
        """A VMID that qm config shows is refused by number and name; nothing but the check runs."""
        qm.add_vm(101, "old-node")
        before = qm.config(101)
        done = run(qm, home, *base_args(image), *(["--dry-run"] if dry_run else []))
        assert done.returncode == 3, done.stderr
        assert "error: VMID 101 is taken by VM 101 'old-node' (`qm config 101`)" in done.stderr
        assert "never changes an existing machine" in done.stderr
        assert "pvesh get /cluster/nextid" in done.stderr
        assert qm.calls() == [["config", "101"]]
        assert qm.config(101) == before

    def test_a_create_refused_for_a_taken_vmid_is_reported_as_taken(self, qm, home, image):
        """When the VMID is taken between the check and the create, the run says so and cleans nothing."""
        qm.set_mode(race=True)
        done = run(qm, home, *base_args(image))
        assert done.returncode == 3, done.stderr
        assert "error: VMID 101 was taken after the check" in done.stderr
        assert "unable to create VM 101 - VM 101 already exists on node 'pve'" in done.stderr
        assert "This run made nothing, and did not touch VM 101 on node 'pve'" in done.stderr
        assert "destroy" not in done.stderr
        assert [c[0] for c in qm.calls()] == ["config", "create"]
        assert "name: someone-elses" in qm.config(101)

    def test_a_container_on_another_node_is_reported_as_taken(self, qm, home, image):
        """A VMID held by a container elsewhere in the cluster (invisible to qm config) is named as such."""
        qm.add_cluster_guest(101, "CT", "pve2")
        done = run(qm, home, *base_args(image))
        assert done.returncode == 3, done.stderr
        assert "did not touch CT 101 on node 'pve2'" in done.stderr
        assert "note: a container holds it: `qm config` sees only VMs" in done.stderr
        assert [c[0] for c in qm.calls()] == ["config", "create"]

    @pytest.mark.parametrize(
        "mode, says, calls, left",
        [
            pytest.param(
                "import",
                [
                    "error: step 1 of 3 failed: create VM 101 'gpu-01' and import {image} into fast-lvm",
                    "importing {image} into fast-lvm failed; qm said:",
                    "Image is not in qcow2 format",
                    "copy failed: command '/usr/bin/qemu-img convert",
                    "done: nothing",
                    "left behind: nothing; `qm config 101` says VMID 101 is free",
                ],
                ["config", "create", "config"],
                False,
                id="a failing import names the step and qm's message, and checks that nothing was left",
            ),
            pytest.param(
                "import_leaves",
                [
                    "step 1 of 3 failed",
                    "left behind: VM 101 'gpu-01' (`qm config 101`)",
                    "to remove it:\n  qm destroy 101 --destroy-unreferenced-disks 1 --purge 1",
                    "qm resize 101 scsi0 200G\n  qm start 101",
                ],
                ["config", "create", "config"],
                True,
                id="a failing import that leaves the VM says so and how to remove it",
            ),
            pytest.param(
                "start",
                [
                    "error: step 3 of 3 failed: start VM 101",
                    "start failed: QEMU exited with code 1",
                    "hint: PCI passthrough needs the IOMMU on",
                    "done: create VM 101 'gpu-01' and import",
                    "; grow its disk to 200 GiB",
                    "left behind: VM 101 'gpu-01'",
                    "qm destroy 101 --destroy-unreferenced-disks 1 --purge 1",
                ],
                ["config", "create", "resize", "start", "config"],
                True,
                id="a start failing after the create names the VM left, with commands to remove or finish it",
            ),
            pytest.param(
                "old_pve",
                ["does not know --ciupgrade (added in 8.0", "left behind: nothing"],
                ["config", "create", "config"],
                False,
                id="a Proxmox VE without --ciupgrade (before 8.0) fails the create with that said",
            ),
            pytest.param(
                "config_denied",
                ["cannot tell whether VMID 101 is free", "Permission check failed"],
                ["config"],
                False,
                id="a qm config failing for another reason is not taken for free: nothing is created",
            ),
        ],
    )
    def test_a_failing_step_says_what_was_made_and_is_left(self, qm, home, image, mode, says, calls, left):
        """A failed step names itself, qm's message, what was done and what is left, and how to remove it."""
        qm.set_mode(**{mode: True})
        done = run(qm, home, *base_args(image))
        assert done.returncode == 1, done.stderr
        for line in says:
            assert line.format(image=image) in done.stderr
        assert [c[0] for c in qm.calls()] == calls
        assert (qm.config(101) is not None) == left

    def test_an_interrupted_run_says_what_it_left(self, qm, home, image):
        """Ctrl-C during a step waits for qm, then says what is left and how to remove it."""
        qm.set_mode(hang=True)
        env = {**os.environ, "PATH": f"{qm.bin}{os.pathsep}{os.environ['PATH']}", "HOME": str(home)}
        env["FAKE_QM_STATE"] = str(qm.state)
        process = subprocess.Popen(
            [provision_exe(), *base_args(image)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
            preexec_fn=sigint_default(),
        )
        try:
            deadline = time.monotonic() + 30
            while qm.config(101) is None:  # the create is under way
                assert time.monotonic() < deadline and process.poll() is None, process.communicate()
                time.sleep(0.05)
            os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the whole group
            stdout, stderr = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        assert process.returncode == 130, stderr
        assert "error: interrupted during step 1 of 3: create VM 101 'gpu-01'" in stderr
        assert "left behind: VM 101 'gpu-01'" in stderr
        assert "qm destroy 101 --destroy-unreferenced-disks 1 --purge 1" in stderr

    def test_dry_run_changes_nothing_and_prints_the_exact_commands(self, qm, home, image):
        """--dry-run runs only the read-only check and prints the commands a run would issue."""
        done = run(qm, home, *base_args(image), "--dry-run")
        assert done.returncode == 0, done.stderr
        assert qm.calls() == [["config", "101"]]
        assert qm.config(101) is None
        printed = [shlex.split(line) for line in done.stdout.splitlines() if not line.startswith("#")]
        keys = str(home / ".ssh" / "authorized_keys")
        assert printed == [["qm", *argv] for argv in expected_commands(image, keys)]
        assert "# VMID 101 is free (`qm config 101`)" in done.stdout
        assert "nothing was run" in done.stdout

    def test_warns_when_the_name_is_not_the_node_id(self, qm, home, image):
        """A VM name that differs from --node-id is a warning naming both; the run goes on."""
        args = [a if a != "gpu-01" else "gpu01" for a in base_args(image)]
        done = run(qm, home, *args, "--node-id", "gpu-01", "--dry-run")
        assert done.returncode == 0, done.stderr
        assert "warning: the VM is named 'gpu01' but its node id will be 'gpu-01'" in done.stderr
        same = run(qm, home, *base_args(image), "--node-id", "gpu-01", "--dry-run")
        assert "warning" not in same.stderr

    def test_refuses_without_ssh_keys(self, qm, home, image):
        """A missing or empty default authorized_keys is refused, naming --ssh-keys, before any qm call."""
        keys = home / ".ssh" / "authorized_keys"
        keys.write_text("# no keys yet\n\n")
        done = run(qm, home, *base_args(image))
        assert done.returncode == 2
        assert "'--ssh-keys'" in done.stderr and "holds no public key" in done.stderr
        keys.unlink()
        done = run(qm, home, *base_args(image))
        assert done.returncode == 2
        assert f"{keys} does not exist" in done.stderr
        assert qm.calls() == []

    def test_comment_lines_in_the_keys_file_are_left_out(self, qm, home, image, tmp_path):
        """Proxmox refuses comment lines in --sshkeys: the run passes a copy with only the keys."""
        keys = tmp_path / "team_keys"
        keys.write_text(f"# the team\n{KEY}\n\n# ops\n{KEY.replace('op@laptop', 'ops@desk')}\n")
        done = run(qm, home, *base_args(image), "--ssh-keys", str(keys))
        assert done.returncode == 0, done.stderr
        create = qm.calls()[1]
        passed = create[create.index("--sshkeys") + 1]
        assert passed != str(keys)
        assert not Path(passed).exists(), "the copy is removed after the run"
        assert "2 ssh keys from" in done.stdout and "without its 2 comment lines" in done.stdout

    def test_no_qm_on_path_is_explained(self, qm, home, image, tmp_path):
        """Without qm on PATH the run stops before anything, saying where to run it."""
        env = {**os.environ, "PATH": str(Path(sys.executable).parent), "HOME": str(home)}
        done = subprocess.run(
            [provision_exe(), *base_args(image)], capture_output=True, text=True, env=env, check=False
        )
        assert done.returncode == 1
        assert "qm is not on PATH" in done.stderr and "Proxmox VE" in done.stderr


def invoke(*args: str):
    return CliRunner().invoke(provision_node, list(args), catch_exceptions=False)


class TestFlags:
    """Every flag is checked before anything runs, and an error names its flag."""

    @pytest.mark.parametrize(
        ("flag", "value", "message"),
        [
            ("--ip", "10.20.0.11", "has no prefix length"),
            ("--ip", "10.20.0.300/24", "is not an address in CIDR form"),
            ("--ip", "10.20.0.0/24", "network's own address"),
            ("--gateway", "10.30.0.1", "is not in 10.20.0.0/24, the network of --ip 10.20.0.11/24"),
            ("--gateway", "10.20.0.11", "is the VM's own address"),
            ("--gateway", "fe80::1", "is IPv6 but --ip is IPv4"),
            ("--gateway", "gw", "is not an IP address"),
            ("--gpu", "41:00:0", "is not a PCI address"),
            ("--gpu", "0000:c1:00.0", "is given twice"),
            ("--memory", "0", "must be more than 0"),
            ("--memory", "64X", "is not a size"),
            ("--disk", "-5", "is not a size"),
            ("--disk", "512M", "is not a size"),
            ("--cores", "0", "must be at least 1"),
            ("--vmid", "42", "use 100 to 999999999"),
            ("--name", "gpu_01", "is not a DNS name"),
            ("--node-id", "GPU-01", "invalid node id"),
            ("--image", "/images/a,b.img", "may not contain ','"),
            ("--image", "/no/such/image.img", "is not a file here"),
            ("--bridge", "vmbr0,tag=5", "is not a bridge name"),
            ("--ssh-keys", "/no/such/keys", "does not exist"),
        ],
    )
    def test_a_bad_flag_is_refused_by_name(self, image, home, flag, value, message):
        """The error names the flag and what is wrong with its value."""
        args = base_args(image) + ["--ssh-keys", str(home / ".ssh" / "authorized_keys")]
        if flag in args and flag != "--gpu":
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert f"'{flag}'" in result.output
        assert message in result.output

    def test_sizes_take_units(self):
        """--memory is MiB and --disk GiB unless a unit says otherwise."""
        from llmgw.provision.cli import parse_size

        assert parse_size("65536", unit="MiB", flag="--memory") == 65536
        assert parse_size("64G", unit="MiB", flag="--memory") == 65536
        assert parse_size("64GiB", unit="MiB", flag="--memory") == 65536
        assert parse_size("200", unit="GiB", flag="--disk") == 200
        assert parse_size("2T", unit="GiB", flag="--disk") == 2048

    def test_a_private_key_is_refused(self, image, tmp_path):
        """Pointing --ssh-keys at a private key says to pass the public one."""
        key = tmp_path / "id_ed25519"
        key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n-----END OPENSSH PRIVATE KEY-----\n")
        result = invoke(*base_args(image), "--ssh-keys", str(key))
        assert result.exit_code == 2
        assert "holds a private key; pass the public one" in result.output

    def test_a_line_that_is_not_a_key_is_named(self, image, tmp_path):
        """A line that is not an OpenSSH public key is refused with its number."""
        keys = tmp_path / "keys"
        keys.write_text(f"{KEY}\nnot a key\n")
        result = invoke(*base_args(image), "--ssh-keys", str(keys))
        assert result.exit_code == 2
        assert "line 2 is not an OpenSSH public key: 'not a key'" in result.output


def request(**changes) -> MachineRequest:
    fields = dict(
        vmid=101,
        name="gpu-01",
        ip_cidr="10.20.0.11/24",
        gateway="10.20.0.1",
        bridge="vmbr0",
        storage="local-lvm",
        image="/var/lib/vz/template/iso/noble.img",
        cores=8,
        memory_mib=16384,
        disk_gib=64,
    )
    return MachineRequest(**{**fields, **changes})


class TestProxmoxProvisioner:
    """The plugin's commands and its reading of qm's answers, without running anything."""

    def test_is_registered_as_a_builtin(self):
        """llmgw_proxmox is a built-in plugin that registers the proxmox provisioner."""
        from llmgw.plugins import get_plugin_manager

        manager = get_plugin_manager(entry_points=False)
        assert isinstance(manager.provisioners()["proxmox"], proxmox.ProxmoxProvisioner)

    def test_without_gpus_or_keys_there_is_no_balloon_hostpci_or_sshkeys(self):
        """A VM without GPUs keeps ballooning and gets no hostpci or sshkeys options."""
        argv = proxmox.ProxmoxProvisioner().create_argv(request())
        assert "--balloon" not in argv and "--sshkeys" not in argv
        assert not any(a.startswith("--hostpci") for a in argv)
        assert argv[argv.index("--ciupgrade") + 1] == "0"

    def test_ipv6_and_user(self):
        """An IPv6 address becomes ip6/gw6, and --user becomes --ciuser."""
        argv = proxmox.ProxmoxProvisioner().create_argv(
            request(ip_cidr="2001:db8::11/64", gateway="2001:db8::1", user="llmgw")
        )
        assert argv[argv.index("--ipconfig0") + 1] == "ip6=2001:db8::11/64,gw6=2001:db8::1"
        assert argv[argv.index("--ciuser") + 1] == "llmgw"

    def test_reads_qm_config(self):
        """qm config's name and template flag are read; its no-such-config answer means free."""
        p = proxmox.ProxmoxProvisioner()
        assert p.exists_command(request()) == Command(argv=["qm", "config", "101"])
        assert p.read_existing(request(), CommandResult(0, "boot: order=scsi0\nname: old\n")) == (
            ExistingMachine(101, name="old")
        )
        assert p.read_existing(request(), CommandResult(0, "name: base\ntemplate: 1\n")).kind == "template"
        free = CommandResult(2, "", "Configuration file 'nodes/pve/qemu-server/101.conf' does not exist\n")
        assert p.read_existing(request(), free) is None
        other = CommandResult(2, "", "Configuration file 'nodes/pve/qemu-server/102.conf' does not exist\n")
        with pytest.raises(ProvisionError, match="cannot tell whether VMID 101 is free"):
            p.read_existing(request(), other)

    @pytest.mark.parametrize(
        ("stderr", "taken"),
        [
            ("unable to create VM 101 - VM 101 already exists on node 'pve'", "VM 101 on node 'pve'"),
            ("unable to create VM 101 - CT 101 already exists on node 'pve3'", "CT 101 on node 'pve3'"),
            ("unable to create vm 101: config file already exists", "VM 101"),
            ("unable to create VM 101 - VM 1011 already exists on node 'pve'", None),
            ("unable to create VM 101 - copy failed: command 'x' failed: exit code 1", None),
        ],
    )
    def test_tells_a_taken_vmid_from_other_create_failures(self, stderr, taken):
        """Only qm's refusal of this very VMID counts as "taken"."""
        p = proxmox.ProxmoxProvisioner()
        step = p.steps(request())[0]
        failure = p.explain_failure(request(), step, CommandResult(255, "", stderr + "\n"))
        assert (failure.taken_by.describe() if failure.taken_by else None) == taken

    def test_the_default_steps_of_a_provisioner_come_from_its_commands(self):
        """A provisioner that only returns commands still gets steps, a check and no cleanup."""
        p = proxmox.ProxmoxProvisioner()
        steps = super(proxmox.ProxmoxProvisioner, p).steps(request())
        assert steps[0] == Step("qm create", Command(argv=p.create_argv(request())))
        assert [s.title for s in p.steps(request())] == [
            "create VM 101 'gpu-01' and import /var/lib/vz/template/iso/noble.img into local-lvm",
            "grow its disk to 64 GiB",
            "start VM 101",
        ]


def test_help_lists_every_flag():
    """--help documents the flags the issue asks for."""
    result = invoke("--help")
    for flag in textwrap.dedent("""
        --vmid --name --node-id --ip --gateway --bridge --storage --image --cores --memory
        --disk --gpu --ssh-keys --user --kind --dry-run
    """).split():
        assert flag in result.output
