"""The public surface is what ``__all__`` says, and nothing leaks by accident."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "llmgw": ["__version__", "hookimpl"],
    "llmgw.models": [
        "Adapter", "AdapterPort", "AdapterReport", "Autoscale", "Catalog", "Command", "DiscoverySettings",
        "Fabric", "GPU", "GpuReport", "LaunchSpec", "LoraSpec", "Model", "ModelCopy", "NodeFacts", "Profile",
        "Rollout", "ScaleTarget", "Sidecar",
    ],
    "llmgw.engine": [
        "Engine", "HelpAndVersion", "HttpCall", "LivenessProbe", "LoadMetrics", "ProgressMetrics",
        "help_and_version_of", "old_api_uses", "openai_canary", "parse_argparse_flags", "rendezvous_args",
        "serving_args", "version_at_least",
    ],
    "llmgw.errors": [
        "CatalogError", "DuplicateEngineError", "FabricError", "LlmgwError", "PluginError",
        "UnknownEngineError",
    ],
    "llmgw.testing": ["make_adapters", "make_gpus", "write_fake_nvidia_smi", "write_ib_sysfs"],
    "llmgw.testing.contract": [
        "EngineContract", "flags_of", "flag_value", "command_program", "read_help_files",
    ],
    "llmgw.testing.pytest_plugin": [
        "HELP_DIR_ENV", "engine_help_dir", "find_engine_help_dir", "missing_engine_help",
    ],
    "llmgw.provision": [
        "Provisioner", "MachineRequest", "Step", "CommandResult", "ExistingMachine", "StepFailure",
        "ProvisionError", "MachineExistsError",
    ],
    "llmgw.enginecheck": [
        "ACCEPTED", "MISSING", "UNCHECKED", "PROFILE_ARGS", "CheckReport", "CollectedHelp", "FlagCheck",
        "HelpCommandError", "HelpRun", "ProgramHelp", "check_engine", "check_installed", "collect_help",
        "command_program", "completeness_warnings", "option_flags", "run_help", "widest_commands",
    ],
    "llmgw.version": [
        "BuildInfo", "build_info", "distribution_version", "version_info", "version", "UNKNOWN",
    ],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_all_is_pinned(module):
    """Each public module exports exactly the names pinned here; change both on purpose."""
    assert sorted(importlib.import_module(module).__all__) == sorted(PUBLIC[module])


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_exported_name_exists(module):
    """Every name in __all__ can be imported."""
    mod = importlib.import_module(module)
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.__all__ lists {name} but it does not exist"


def test_importing_llmgw_builds_no_plugin_manager():
    """Importing llmgw registers nothing: the plugin manager is built by a function."""
    import llmgw.plugins

    assert not any(isinstance(v, llmgw.plugins.Plugins) for v in vars(llmgw.plugins).values())
