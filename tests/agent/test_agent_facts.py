"""What the agent reports about its node: engines and their versions, model sources, problems."""

from __future__ import annotations

import sys

import llmgw_engine_sim
from llmgw_engine_sim import SimEngine

import llmgw
from llmgw.agent.facts import check_engines, gather_facts, parse_version, present_sources
from llmgw.engine import Engine, HelpAndVersion
from llmgw.models import Command, LaunchSpec
from llmgw.plugins import get_plugin_manager
from llmgw.testing import make_gpus, write_fake_nvidia_smi
from llmgw.testing.agent import SIM, agent_config


class Other(Engine):
    """An engine whose program is called ``other``."""

    name = "other"
    checked_versions = ("1",)
    programs = ("other",)

    def build_command(self, spec: LaunchSpec) -> Command:
        """Never called here."""
        raise NotImplementedError

    def widest_spec(self) -> LaunchSpec:
        """Never called here."""
        raise NotImplementedError


def script(path, body: str):
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


async def test_installed_engine_reports_its_version(tmp_path):
    """An engine whose configured program answers --version is installed, with the version it printed."""
    config = agent_config(tmp_path, engines={"sim": {"llmgw-sim": SIM}})
    installed, problems = await check_engines(config, {"sim": SimEngine()})
    assert installed == {"sim": SimEngine.checked_versions[0]}
    assert problems == []


async def test_missing_or_failing_programs_are_problems(tmp_path, monkeypatch):
    """A missing path, a program not on PATH, and a failing --version each give one problem line."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    failing = script(tmp_path / "failing", "echo 'libcuda.so.1: cannot open shared object file' >&2; exit 3")
    engines = {"sim": SimEngine(), "other": Other(), "vllm": Other()}
    config = agent_config(
        tmp_path,
        engines={"sim": {"llmgw-sim": "/opt/nowhere/llmgw-sim"}, "vllm": {"other": failing, "extra": "/x"},
                 "ghost": {"ghost": "/x"}},
    )
    installed, problems = await check_engines(config, engines)
    assert installed == {}
    assert problems == sorted([
        "engine sim: /opt/nowhere/llmgw-sim not found",
        "engine other: other not found on PATH; install it or configure its path (--engine other:other=PATH)",
        f"engine vllm: {failing} --version exited with code 3: libcuda.so.1: cannot open shared object file",
        "engine vllm: program 'extra' is configured but the engine runs only other",
        "engine ghost: paths are configured but no plugin provides it (engines: other, sim, vllm)",
    ])


def test_parse_version():
    """The last word of the first non-empty line."""
    assert parse_version("\nllmgw-sim 0.1.0\n") == "0.1.0"
    assert parse_version("0.6.3") == "0.6.3"
    assert parse_version("  \n") is None


def test_present_sources(tmp_path):
    """Absolute paths count when they exist; hub-style names always count."""
    (tmp_path / "weights").mkdir()
    sources = [str(tmp_path / "weights"), str(tmp_path / "missing"), "meta-llama/Llama-3.1-8B"]
    assert present_sources(sources) == tuple(sorted([str(tmp_path / "weights"), "meta-llama/Llama-3.1-8B"]))


async def test_gather_facts_with_fake_gpus_and_a_missing_nvidia_smi(tmp_path):
    """GPUs come from nvidia-smi; when it is missing, the node reports it as a problem."""
    plugins = get_plugin_manager(plugins=[llmgw_engine_sim], entry_points=False)
    smi = write_fake_nvidia_smi(tmp_path / "nvidia-smi", make_gpus(4, seed="n1"))
    config = agent_config(
        tmp_path, nvidia_smi=str(smi), ib_root=str(tmp_path / "no-ib"), engines={"sim": {"llmgw-sim": SIM}}
    )
    engines = {"sim": SimEngine()}
    facts = await gather_facts(config, plugins, engines, check_sources=["tiny/model", "/no/such/weights"])
    assert (len(facts.gpus), facts.engines, facts.problems) == (4, {"sim": llmgw_engine_sim.__version__}, ())
    assert facts.model_sources == ("tiny/model",)
    assert facts.agent_version == llmgw.__version__ and facts.node_id == "node-1"

    missing = agent_config(tmp_path, nvidia_smi=str(tmp_path / "no-smi"))
    facts = await gather_facts(missing, plugins, engines)
    assert facts.gpus == ()
    assert any("not found" in problem and "no-smi" in problem for problem in facts.problems), facts.problems


class Pythonic(Other):
    """An engine run as ``python -m ...``: its version is its package's, not Python's."""

    name = "pythonic"
    programs = ("python",)
    #: ask the package, not the interpreter
    help_and_version = {
        "python": HelpAndVersion(version_args=("-c", "print('pythonic version: 0.5.23 (build 7)')"))
    }

    def parse_version(self, text: str) -> str | None:
        """The word after ``version:``."""
        return text.split("version:")[1].split()[0]


async def test_engine_version_hooks(tmp_path):
    """An engine's version_args and parse_version, when it has them, decide how its version is read."""
    config = agent_config(tmp_path, engines={"pythonic": {"python": sys.executable}})
    installed, problems = await check_engines(config, {"pythonic": Pythonic()})
    assert installed == {"pythonic": "0.5.23"}
    # this test engine cannot build a command: engine-check says so, and the version still counts
    assert [p for p in problems if "engine-check failed in its plugin" not in p] == []


async def test_engine_whose_help_lacks_a_flag_is_not_used(tmp_path):
    """An installed engine whose --help lacks a flag llmgw passes is left out of the facts, with why."""
    import textwrap

    import trio

    real = (await trio.run_process([SIM, "--help"], capture_stdout=True)).stdout.decode()
    lacking = "\n".join(line for line in real.splitlines() if "--dist-init-addr" not in line)
    fake = tmp_path / "old-sim"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        if "--version" in sys.argv:
            print("llmgw-sim 0.0.9")
        else:
            sys.stdout.write({lacking!r})
        """))
    fake.chmod(0o755)
    config = agent_config(tmp_path, engines={"sim": {"llmgw-sim": str(fake)}})
    assert "--dist-init-addr" in real and "--dist-init-addr" not in lacking
    installed, problems = await check_engines(config, {"sim": SimEngine()})
    assert installed == {}
    assert any("engine sim 0.0.9 would reject llmgw's flags (--dist-init-addr)" in p for p in problems)
