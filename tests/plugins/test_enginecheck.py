"""engine-check: the check, the help commands, ``ctl engine-check``, and the engine template."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import stat
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import llmgw
import llmgw.enginecheck.cli
from llmgw.engine import Engine, HelpAndVersion
from llmgw.enginecheck import (
    ACCEPTED,
    MISSING,
    PROFILE_ARGS,
    UNCHECKED,
    CheckReport,
    HelpCommandError,
    check_engine,
    check_installed,
    option_flags,
    run_help,
)
from llmgw.enginecheck.cli import engine_check
from llmgw.models import Command, LaunchSpec
from llmgw.plugins import get_plugin_manager
from llmgw.testing.processes import run_pytest
from llmgw.testing.pytest_plugin import find_engine_help_dir, missing_engine_help

REPO = Path(__file__).resolve().parents[2]
#: the real help texts, found as the engine distributions' engine_help_dir fixture finds them
HELP_DIR = find_engine_help_dir(REPO) or REPO.parent / "shared" / "engine-help"

SERVER_HELP = """\
usage: toy-server [-h] --model MODEL [--host HOST] [--port PORT] [--workers WORKERS]
                  [--gpu-layers N] [--max-len MAX_LEN]

options:
  -h, --help            show this help message and exit
  --model MODEL, -m MODEL
                        The model to serve.
  --host HOST           Address to serve on.
  --port PORT           Port to serve on; see also --port-range.
  --workers WORKERS     Comma-separated worker addresses.
  --gpu-layers N        Layers to offload.
  --max-len MAX_LEN     Context length.
"""

WORKER_HELP = """\
usage: toy-worker [-h] [--listen LISTEN]

options:
  -h, --help       show this help message and exit
  --listen LISTEN  HOST:PORT to accept the server on.
"""


class ToyEngine(Engine):
    """Two programs, like llama.cpp: rank 0 runs toy-server and dials the toy-workers."""

    name = "toy"
    checked_versions = ("1.0",)
    multi_node = True
    programs = ("toy-server", "toy-worker")

    def build_command(self, spec: LaunchSpec) -> Command:
        if spec.rank > 0:
            return Command([self.program_path(spec, "toy-worker"), "--listen", f"{spec.host}:{spec.port}"])
        argv = [self.program_path(spec, "toy-server"), "--model", spec.model_source, "--port", str(spec.port)]
        argv += ["--gpu-layers=-1"]
        if spec.nnodes > 1:
            argv += ["--workers", ",".join(spec.peer_addrs[1:])]
        return Command([*argv, *spec.extra_args], env=self.device_env(spec))

    def widest_spec(self) -> LaunchSpec:
        return LaunchSpec(
            model_source="/m",
            served_name="m",
            host="10.0.0.1",
            port=9000,
            nnodes=3,
            dist_init_addr="10.0.0.1:9001",
            peer_addrs=("10.0.0.1:9000", "10.0.0.2:9000", "10.0.0.3:9000"),
        )

    flag_features = {"--workers": "multi-node workers"}


class ToyPlugin:
    """Registers ToyEngine."""

    @llmgw.hookimpl
    def llmgw_register_engines(self):
        return [ToyEngine()]


HELPS = {"toy-server": SERVER_HELP, "toy-worker": WORKER_HELP}


def by_flag(report):
    return {(f.program, f.flag): f for f in report.flags}


class TestOptionFlags:
    """Which arguments are flags."""

    def test_values_and_negative_numbers(self):
        """Values, ``=value`` and negative numbers are not flags; each flag counts once."""
        assert option_flags(["serve", "--a", "1", "--b=-1", "-n", "-1", "-2.5", "--a", "-"]) == [
            "--a",
            "--b",
            "-n",
        ]


class TestCheckEngine:
    """check_engine on help texts in hand."""

    def test_every_flag_of_every_rank(self):
        """Each flag is checked against its own program's help, with the ranks that carry it."""
        report = check_engine(ToyEngine(), HELPS)
        assert report.ok and not report.warnings
        flags = by_flag(report)
        assert set(flags) == {
            ("toy-server", "--model"),
            ("toy-server", "--port"),
            ("toy-server", "--gpu-layers"),
            ("toy-server", "--workers"),
            ("toy-worker", "--listen"),
        }
        assert flags["toy-worker", "--listen"].ranks == (1, 2)
        assert flags["toy-server", "--workers"].feature == "multi-node workers"
        assert flags["toy-server", "--model"].feature == "-"
        assert [p.documented for p in report.programs] == [9, 3]

    def test_whole_spellings_only(self):
        """--port is not satisfied by --port-range, even where the help mentions both."""
        text = SERVER_HELP.replace("  --port PORT  ", "  --port-range R")
        report = check_engine(ToyEngine(), {**HELPS, "toy-server": text})
        assert [(f.flag, f.status, f.possibly_truncated) for f in report.missing] == [
            ("--port", MISSING, False)
        ]
        assert "--port" in text, "still mentioned, in --port-range's and --port's old description"

    def test_mentions_in_descriptions_do_not_document(self):
        """A flag named only in another option's description is missing."""
        text = SERVER_HELP.replace(
            "  --workers WORKERS     Comma", "  --peers WORKERS       Use --workers; comma"
        )
        assert [f.flag for f in check_engine(ToyEngine(), {**HELPS, "toy-server": text}).missing] == [
            "--workers"
        ]

    def test_profile_args(self):
        """Profile args are checked too, labelled as such."""
        report = check_engine(ToyEngine(), HELPS, extra_args=["--max-len", "4096", "--no-such", "x"])
        flags = by_flag(report)
        assert flags["toy-server", "--max-len"].status == ACCEPTED
        assert flags["toy-server", "--no-such"].status == MISSING
        assert flags["toy-server", "--no-such"].feature == PROFILE_ARGS

    def test_failed_help_leaves_flags_unchecked(self):
        """A program whose help could not be read has its flags unchecked, not missing."""
        report = check_engine(ToyEngine(), {"toy-server": SERVER_HELP}, failures={"toy-worker": "it broke"})
        assert not report.ok and not report.missing
        assert by_flag(report)["toy-worker", "--listen"].status == UNCHECKED
        assert [p.failure for p in report.failures] == ["it broke"]
        assert "help of toy-worker unavailable" in report.summary()

    def test_program_without_help(self):
        """A program given no help at all is a failure, not a pass."""
        report = check_engine(ToyEngine(), {"toy-server": SERVER_HELP})
        assert [p.failure for p in report.failures] == ["no help given"]

    def test_unknown_program(self):
        """Help for a program the engine does not run is refused."""
        with pytest.raises(ValueError, match="runs toy-server, toy-worker, not toy-other"):
            check_engine(ToyEngine(), {**HELPS, "toy-other": ""})

    def test_json_round_trip(self):
        """A report with warnings and failures survives JSON (the agent sends it to the server)."""
        text = SERVER_HELP.replace("  -h, --help            show this help message and exit\n", "")
        report = check_engine(ToyEngine(), {"toy-server": text}, failures={"toy-worker": "broke"})
        assert CheckReport.from_json(json.loads(json.dumps(report.to_json()))) == report

    def test_json(self):
        """The report is JSON-serialisable, with its verdict."""
        data = json.loads(json.dumps(check_engine(ToyEngine(), HELPS).to_json()))
        assert data["ok"] is True
        assert data["flags"][0] == {
            "flag": "--model",
            "program": "toy-server",
            "feature": "-",
            "ranks": [0],
            "status": "accepted",
            "possibly_truncated": False,
        }


class TestCompleteness:
    """Helps that look cut short, or are not the full help."""

    def test_no_help_option(self):
        """A help that does not define --help on an option line draws a warning; missing flags are marked."""
        text = SERVER_HELP.replace("  -h, --help            show this help message and exit\n", "")
        report = check_engine(
            ToyEngine(), {**HELPS, "toy-server": text.replace("  --workers WORKERS", "  --x X")}
        )
        assert any(w.startswith("toy-server: the help defines no --help option") for w in report.warnings)
        assert [(f.flag, f.possibly_truncated) for f in report.missing] == [("--workers", True)]

    def test_mentioning_help_is_not_defining_it(self):
        """A text that names --help=all but has no -h/--help option line draws the warning."""
        text = "usage: toy-server [options]\n\nFor everything: toy-server --help=all\n  --model MODEL  x\n"
        report = check_engine(ToyEngine(), {**HELPS, "toy-server": text})
        assert any("defines no --help option" in w for w in report.warnings)

    def test_usage_names_flags_the_options_lack(self):
        """A help cut after its usage line draws a warning: the usage names flags no option line defines."""
        text = SERVER_HELP[: SERVER_HELP.index("  --host")]
        report = check_engine(ToyEngine(), {**HELPS, "toy-server": text})
        assert any("usage line names 5 flags that no option line defines" in w for w in report.warnings)
        assert report.missing and all(f.possibly_truncated for f in report.missing)

    def test_one_flag_gone_from_the_middle_is_not_a_cut(self):
        """One option line deleted from the middle (usage entry left) is reported missing, not truncated."""
        text = SERVER_HELP.replace("  --workers WORKERS     Comma-separated worker addresses.\n", "")
        report = check_engine(ToyEngine(), {**HELPS, "toy-server": text})
        assert not report.warnings
        assert [(f.flag, f.possibly_truncated) for f in report.missing] == [("--workers", False)]

    def test_interpreter_in_the_usage_line(self):
        """``usage: python -m pkg [-h]`` does not count python's -m as a flag of the help."""
        text = (
            "usage: python -m toy.server [-h] [--model MODEL]\n\noptions:\n  -h, --help  x\n  --model M  x\n"
        )
        assert not check_engine(ToyEngine(), {**HELPS, "toy-server": text}).warnings


def script(path: Path, body: str) -> str:
    """An executable shell script at ``path``."""
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


class TestRunHelp:
    """Running a program's help command."""

    def test_help_on_stdout(self, tmp_path):
        """The help is read from stdout, with the engine's help arguments."""
        exe = script(tmp_path / "toy-server", f'[ "$1" = --help ] || exit 3\ncat <<"EOF"\n{SERVER_HELP}EOF\n')
        run = run_help(ToyEngine(), "toy-server", exe, timeout=10)
        assert run.text == SERVER_HELP and run.returncode == 0
        assert run.command == f"{exe} --help"

    def test_help_on_stderr(self, tmp_path):
        """A help printed on stderr (llama.cpp's older rpc-server) is found there."""
        exe = script(tmp_path / "w", f'cat >&2 <<"EOF"\n{WORKER_HELP}EOF\n')
        assert run_help(ToyEngine(), "toy-worker", exe, timeout=10).text == WORKER_HELP

    def test_exit_1_with_nothing_on_stdout(self, tmp_path):
        """A help command that exits 1 printing nothing is that failure, with its stderr's tail."""
        exe = script(
            tmp_path / "s", "echo loading >&2\necho 'RuntimeError: Failed to infer device type' >&2\nexit 1\n"
        )
        with pytest.raises(HelpCommandError) as caught:
            run_help(ToyEngine(), "toy-server", exe, timeout=10)
        message = str(caught.value)
        assert "exited 1 and printed nothing on stdout" in message
        assert message.endswith("  loading\n  RuntimeError: Failed to infer device type")

    def test_logs_but_no_help(self, tmp_path):
        """Log lines on stdout without any option definition are not a help."""
        exe = script(tmp_path / "s", "echo 'INFO starting'\n")
        with pytest.raises(HelpCommandError, match="exited 0 and printed no option definitions on stdout"):
            run_help(ToyEngine(), "toy-server", exe, timeout=10)

    def test_timeout_kills_the_process_group(self, tmp_path):
        """A help command that hangs is stopped after the timeout, children too."""
        exe = script(tmp_path / "s", "sleep 60 &\nwait\n")
        with pytest.raises(HelpCommandError, match="did not finish within 0.5 s"):
            run_help(ToyEngine(), "toy-server", exe, timeout=0.5)

    def test_not_found(self, tmp_path):
        """A path that does not exist is a failure naming it."""
        with pytest.raises(HelpCommandError, match="cannot run `.*/nope --help`: No such file"):
            run_help(ToyEngine(), "toy-server", str(tmp_path / "nope"), timeout=10)

    def test_help_env(self, tmp_path, monkeypatch):
        """The engine's help environment is added to the caller's."""
        exe = script(tmp_path / "s", f'[ "$TOY_DEVICE" = cpu ] || exit 1\ncat <<"EOF"\n{SERVER_HELP}EOF\n')
        asked = {"toy-server": HelpAndVersion(help_env={"TOY_DEVICE": "cpu"})}
        monkeypatch.setattr(ToyEngine, "help_and_version", asked)
        assert run_help(ToyEngine(), "toy-server", exe, timeout=10).command == f"TOY_DEVICE=cpu {exe} --help"


class TestCheckInstalled:
    """What the agent runs at start."""

    def test_one_program_fails(self, tmp_path):
        """The failing program's flags are unchecked; the other program is checked."""
        server = script(tmp_path / "srv", f'cat <<"EOF"\n{SERVER_HELP}EOF\n')
        worker = script(tmp_path / "wrk", "exit 1\n")
        report = check_installed(ToyEngine(), {"toy-server": server, "toy-worker": worker}, timeout=10)
        assert not report.ok and not report.missing
        assert {f.status for f in report.flags if f.program == "toy-server"} == {ACCEPTED}
        assert "exited 1 and printed nothing on stdout; its stderr is empty" in report.failures[0].failure

    def test_nonzero_exit_with_a_help(self, tmp_path):
        """A help printed by a command that then exits non-zero is used, with a warning."""
        server = script(tmp_path / "srv", f'cat <<"EOF"\n{SERVER_HELP}EOF\nexit 2\n')
        worker = script(tmp_path / "wrk", f'cat <<"EOF"\n{WORKER_HELP}EOF\n')
        report = check_installed(ToyEngine(), {"toy-server": server, "toy-worker": worker}, timeout=10)
        assert report.ok
        assert report.warnings == ("toy-server: its help command exited 2, so the help may be incomplete",)


def invoke(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(engine_check, list(args), input=stdin, catch_exceptions=False)


@pytest.fixture
def toy_cli(monkeypatch):
    """``ctl engine-check`` sees the toy engine (and the built-ins) only."""
    monkeypatch.setattr(
        llmgw.enginecheck.cli,
        "get_plugin_manager",
        lambda: get_plugin_manager(plugins=[ToyPlugin()], entry_points=False),
    )


@pytest.fixture
def toy_files(tmp_path) -> dict[str, Path]:
    files = {}
    for program, text in HELPS.items():
        files[program] = tmp_path / f"{program}.txt"
        files[program].write_text(text)
    return files


def help_files(files: dict[str, Path]) -> list[str]:
    """``--help-file PROGRAM=PATH`` for each of ``files``."""
    return [arg for program, path in files.items() for arg in ("--help-file", f"{program}={path}")]


class TestCli:
    """``llmgw ctl engine-check`` on the toy engine."""

    def test_pass(self, toy_cli, toy_files):
        """One help file per program: every flag accepted, exit 0."""
        result = invoke(
            "toy",
            *help_files(toy_files),
        )
        assert result.exit_code == 0, result.output
        assert re.search(r"accepted +--listen +toy-worker +1-2 +-\n", result.output)
        assert "result: all 5 flags accepted" in result.output

    def test_missing_flag(self, toy_cli, toy_files):
        """A flag the help lacks is named, with its feature, and the exit code is 1."""
        server = SERVER_HELP.replace("  --workers WORKERS     Comma-separated worker addresses.\n", "")
        result = invoke(
            "toy",
            "--help-output",
            f"toy-server={server}",
            "--help-file",
            f"toy-worker={toy_files['toy-worker']}",
        )
        assert result.exit_code == 1
        assert re.search(r"missing +--workers +toy-server +0 +multi-node workers\n", result.output)
        assert "result: 1 of 5 flags missing: --workers" in result.output

    def test_stdin_and_binary(self, toy_cli, tmp_path):
        """A help on stdin for one program, a binary for the other."""
        worker = script(tmp_path / "wrk", f'cat <<"EOF"\n{WORKER_HELP}EOF\n')
        result = invoke(
            "toy", "--help-file", "toy-server=-", "--binary", f"toy-worker={worker}", stdin=SERVER_HELP
        )
        assert result.exit_code == 0, result.output
        assert f"help of toy-worker from `{worker} --help`: 3 flags documented" in result.output

    def test_binary_fails(self, toy_cli, tmp_path, toy_files):
        """A help command that fails is reported as that failure, not as every flag missing."""
        server = script(tmp_path / "srv", "echo 'no GPU' >&2\nexit 1\n")
        result = invoke(
            "toy", "--binary", f"toy-server={server}", "--help-file", f"toy-worker={toy_files['toy-worker']}"
        )
        assert result.exit_code == 1
        assert "exited 1 and printed nothing on stdout; its stderr ends with:\n  no GPU" in result.output
        assert "missing" not in result.output
        assert "the help of toy-server could not be read, so its 4 flags were not checked" in result.output

    def test_json(self, toy_cli, toy_files):
        """--json prints the report with its verdict."""
        result = invoke(
            "toy",
            "--json",
            *help_files(toy_files),
        )
        data = json.loads(result.output)
        assert data["engine"] == "toy" and data["ok"] is True
        assert [p["program"] for p in data["programs"]] == ["toy-server", "toy-worker"]

    def test_extra_args(self, toy_cli, toy_files):
        """--extra-args checks a profile's args too."""
        result = invoke(
            "toy",
            "--extra-args",
            "--max-len 4096 --not-here 'a b'",
            *help_files(toy_files),
        )
        assert result.exit_code == 1
        assert re.search(r"missing +--not-here +toy-server +0 +profile args\n", result.output)

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            ((), "give the help to check"),
            (
                ("--help-file", "x"),
                "engine toy runs toy-server, toy-worker: say which, as --help-file PROGRAM=...",
            ),
            (("--help-file", "toy-server=a", "--binary", "toy-server=b"), "toy-server: help given twice"),
            (("--help-file", "toy-server=/dev/null"), "give the help of toy-worker too"),
            (
                ("--help-file", "toy-srv=x", "--help-file", "toy-worker=y"),
                "engine toy runs no program 'toy-srv'",
            ),
        ],
    )
    def test_usage_errors(self, toy_cli, args, message):
        """Helps that do not match the engine's programs are usage errors (exit 2)."""
        result = CliRunner().invoke(engine_check, ["toy", *args])
        assert result.exit_code == 2
        assert message in result.output

    def test_unknown_engine(self, toy_cli):
        """An engine no plugin provides is an error listing those there are."""
        result = invoke("nope", "--help-output", "x")
        assert result.exit_code == 1
        assert "no plugin provides engine 'nope' (engines there are: toy)" in result.output


@pytest.fixture
def needs_help_dir():
    """Skips the test (fails it in CI) when the real engine help texts are absent."""
    if not HELP_DIR.is_dir():
        missing_engine_help(f"the real engine help texts ({HELP_DIR}) are absent")


def needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed")


@pytest.mark.usefixtures("needs_help_dir")
class TestCliOnRealEngines:
    """``ctl engine-check`` with the installed engine distributions and the real help texts."""

    @needs("llmgw_engine_vllm")
    def test_vllm_before_multi_node_without_ray(self):
        """vLLM 0.11.0's help: --nnodes, --node-rank, --master-addr, --master-port missing."""
        result = invoke("vllm", "--help-file", str(HELP_DIR / "lacking" / "vllm-0.11.0-serve.txt"))
        assert result.exit_code == 1
        assert (
            "result: 4 of 14 flags missing: --nnodes, --node-rank, --master-addr, --master-port"
            in result.output
        )
        assert "warning" not in result.output

    @needs("llmgw_engine_sglang")
    def test_sglang_without_a_lora_flag(self, tmp_path):
        """A help without --max-loaded-loras names it missing and says LoRA adapters cannot be used."""
        real = (HELP_DIR / "sglang-0.5.3-launch_server.txt").read_text()
        lacking = re.sub(r"\s*\[--max-loaded-loras MAX_LOADED_LORAS\]", "", real, count=1)
        lacking = re.sub(r"^  --max-loaded-loras \S+\n", "", lacking, count=1, flags=re.MULTILINE)
        (tmp_path / "help.txt").write_text(lacking)
        result = invoke("sglang", "--help-file", str(tmp_path / "help.txt"))
        assert result.exit_code == 1
        row = r"missing +--max-loaded-loras +python +0-2 +LoRA adapters \(max_adapters\)\n"
        assert re.search(row, result.output)
        assert "result: without them llmgw cannot use: LoRA adapters (max_adapters)" in result.output
        report = check_engine(get_plugin_manager().engines()["sglang"].engine, {"python": lacking})
        assert report.missing_features == ("LoRA adapters (max_adapters)",)

    @needs("llmgw_engine_vllm")
    def test_vllm_plain_help(self):
        """vLLM's plain --help is not the full help: a warning, and missing flags marked."""
        result = invoke("vllm", "--help-file", str(HELP_DIR / "lacking" / "vllm-0.34.0-serve-plain-help.txt"))
        assert result.exit_code == 1
        assert "warning: vllm: the help defines no --help option" in result.output
        assert "(possibly because the help is truncated)" in result.output

    @needs("llmgw_engine_vllm")
    def test_vllm_binary(self, tmp_path):
        """--binary runs ``vllm serve --help=all`` with VLLM_TARGET_DEVICE=cpu."""
        real = HELP_DIR / "vllm-0.34.0-serve.txt"
        exe = script(
            tmp_path / "vllm",
            f'[ "$1 $2 $VLLM_TARGET_DEVICE" = "serve --help=all cpu" ] || exit 1\n'
            f'echo "INFO log line"\ncat {real}\n',
        )
        result = invoke("vllm", "--binary", exe)
        assert result.exit_code == 0, result.output
        assert "result: all 14 flags accepted" in result.output

    @needs("llmgw_engine_vllm")
    def test_vllm_binary_without_a_gpu(self, tmp_path):
        """A vLLM whose help exits 1 with nothing on stdout is reported as that failure."""
        exe = script(tmp_path / "vllm", "echo 'RuntimeError: Failed to infer device type' >&2\nexit 1\n")
        result = invoke("vllm", "--binary", exe)
        assert result.exit_code == 1
        assert "exited 1 and printed nothing on stdout" in result.output
        assert "RuntimeError: Failed to infer device type" in result.output
        assert "missing" not in result.output

    @needs("llmgw_engine_llamacpp")
    @pytest.mark.parametrize("commit", ["4227c9b", "0c1e570"])
    def test_llamacpp_one_help_per_program(self, commit):
        """llama.cpp takes the help of llama-server and of its RPC worker."""
        result = invoke(
            "llamacpp",
            "--help-file",
            f"llama-server={HELP_DIR / f'llamacpp-{commit}-llama-server.txt'}",
            "--help-file",
            f"rpc-server={HELP_DIR / f'llamacpp-{commit}-rpc-server.txt'}",
        )
        assert result.exit_code == 0, result.output
        assert re.search(r"accepted +--rpc +llama-server", result.output)
        lora = r"accepted +--lora +llama-server +0 +LoRA adapters \(loaded at start\)"
        assert re.search(lora, result.output)

    @needs("llmgw_engine_sglang")
    @pytest.mark.parametrize("version", ["0.5.3", "0.5.23"])
    def test_sglang(self, version):
        """SGLang's launch_server help passes."""
        result = invoke("sglang", "--help-file", str(HELP_DIR / f"sglang-{version}-launch_server.txt"))
        assert result.exit_code == 0, result.output


def test_template_passes_its_own_tests(tmp_path):
    """_template/, copied as the docs say, passes the conformance suite (minus install-only tests)."""
    copy = tmp_path / "llmgw-engine-foo"
    shutil.copytree(REPO / "_template", copy, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    (copy / "llmgw_engine_myengine").rename(copy / "llmgw_engine_foo")
    for path in copy.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".toml", ".md"):
            path.write_text(path.read_text().replace("myengine", "foo").replace("MyEngine", "FooEngine"))
    (copy / "tests" / "help" / "myengine-server-1.0.0.txt").rename(
        copy / "tests" / "help" / "foo-server-1.0.0.txt"
    )
    (copy / "tests" / "test_myengine.py").rename(copy / "tests" / "test_foo.py")
    result = run_pytest(
        copy, "-k", "not version and not registered", env={**os.environ, "PYTHONPATH": str(copy)}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout
