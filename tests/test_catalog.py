"""Catalog validation: ``llmgw ctl validate`` and ``load_catalog``."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw.catalog import MAX_CATALOG_BYTES, MAX_CATALOG_DEPTH, load_catalog, parse_catalog
from llmgw.cli import cli
from llmgw.engine import Engine
from llmgw.errors import CatalogError
from llmgw.models import Command, LaunchSpec

GOOD = """
profiles:
  tp2x2:
    engine: sim
    nodes: 2
    gpus_per_node: 2
    args: ["--time-to-first-token", "0.05"]
  single:
    engine: sim
models:
  llama-70b:
    source: /models/llama-70b
    profile: tp2x2
    replicas: 2
  small:
    source: /models/small
    profile: single
"""


#: a sidecar whose readiness check is neither tcp: nor http:
SIDECAR = 'sidecars:\n  - name: proxy\n    argv: ["envoy"]\n    ready: "port 9000"'


def validate(tmp_path: Path, text: str) -> tuple[int, str]:
    """Run ``llmgw ctl validate`` on ``text``; return its exit code and output."""
    path = tmp_path / "catalog.yaml"
    path.write_text(textwrap.dedent(text))
    result = CliRunner().invoke(cli, ["ctl", "validate", str(path)])
    return result.exit_code, result.output


def edit(**replacements: str) -> str:
    """The good catalog with some lines replaced (keys are the original lines, stripped)."""
    lines = []
    for line in GOOD.splitlines():
        key = line.strip()
        if key in replacements:
            indent = line[: len(line) - len(line.lstrip())]
            new = replacements[key]
            lines.extend(indent + part for part in new.splitlines() if new)
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


class TestValidateCommand:
    """Each kind of mistake is named by its path, and exits 1."""

    def test_valid_catalog_prints_a_summary(self, tmp_path):
        """A good catalog exits 0 with one line saying what it holds."""
        code, output = validate(tmp_path, GOOD)
        assert code == 0, output
        assert output.strip().endswith("valid: 2 models, 3 replicas, 2 profiles (engines: sim)")

    @pytest.mark.parametrize("value", ['"2"', "2.5", "true", "[2]"])
    def test_replicas_not_an_integer(self, tmp_path, value):
        """`replicas` given as a string, a float, a bool or a list is not an integer."""
        code, output = validate(tmp_path, edit(**{"replicas: 2": f"replicas: {value}"}))
        assert code == 1
        assert "models.llama-70b.replicas: expected an integer" in output

    @pytest.mark.parametrize(
        "text, messages",
        [
            pytest.param(
                edit(**{"replicas: 2": "replicas: -1"}),
                ["models.llama-70b.replicas: expected an integer >= 0, got -1"],
                id="a negative replica count names the field and the bound",
            ),
            pytest.param(
                GOOD + "#" * MAX_CATALOG_BYTES + "\n",
                [f"bytes: a catalog is at most {MAX_CATALOG_BYTES} bytes (llmgw's limit)"],
                id="a file over 1 MiB is refused by its size before it is parsed",
            ),
            pytest.param(
                edit(**{"small:": "s" * 64 + ":"}),
                [f"models.{'s' * 64}: invalid name; use letters, digits", "at most 63 characters"],
                id="a model name over 63 characters is an invalid name, naming the limit",
            ),
            pytest.param(
                edit(**{"nodes: 2": "nodes: 0"}),
                ["profiles.tp2x2.nodes: expected an integer >= 1, got 0"],
                id="a profile on zero nodes",
            ),
            pytest.param(
                edit(**{"replicas: 2": "replicas: 2\nreplica: 3"}),
                ["models.llama-70b.replica: unknown key (expected one of: source, profile, replicas"],
                id="a misspelt key in a model names it and the keys there are",
            ),
            pytest.param(
                edit(**{"nodes: 2": "nodes: 2\ntensor_parallel: 8"}),
                ["profiles.tp2x2.tensor_parallel: unknown key"],
                id="an unknown key in a profile",
            ),
            pytest.param(
                GOOD + "defaults:\n  replicas: 1\n",
                ["defaults: unknown key (expected one of: profiles, models)"],
                id="a top-level key other than profiles and models",
            ),
            pytest.param(
                edit(**{"source: /models/small": ""}),
                ["models.small.source: required, missing"],
                id="a model without a source names the missing field",
            ),
            pytest.param(
                edit(**{"profile: tp2x2": "profile: tp8x2"}),
                ["models.llama-70b.profile: no profile named 'tp8x2' (profiles: single, tp2x2)"],
                id="a model naming a missing profile lists the profiles there are",
            ),
            pytest.param(
                edit(**{"engine: sim": "engine: tgi"}),
                ["profiles.tp2x2.engine: no plugin provides engine 'tgi' (engines there are: "],
                id="an engine no plugin provides lists the engines there are",
            ),
            pytest.param(
                edit(**{'args: ["--time-to-first-token", "0.05"]': 'args: ["--time-to-first-token", 0.05]'}),
                ["profiles.tp2x2.args[1]: expected a string"],
                id="a non-string in args names its index",
            ),
            pytest.param(
                edit(**{'args: ["--time-to-first-token", "0.05"]': 'args: ["--port=9000"]'}),
                ["profiles.tp2x2.args[0]: --port is set by llmgw for engine 'sim'; remove it from args"],
                id="extra args may not set a flag llmgw sets itself",
            ),
            pytest.param(
                edit(**{"replicas: 2": "replicas: 2\nreplicas: 3"}),
                ["key 'replicas' appears twice (first at line 14)", "line 15"],
                id="a key given twice is an error with its line, not a silent last-one-wins",
            ),
            pytest.param(
                "models:" + " [" * 600 + "]" * 600 + "\n",
                [f"nested deeper than {MAX_CATALOG_DEPTH} levels"],
                id="600 levels of nesting name the depth limit, not a RecursionError",
            ),
            pytest.param(
                "models:\n  a: [unclosed\n",
                ["invalid YAML", "line 3"],
                id="broken YAML is reported with its line and column",
            ),
            pytest.param(
                "- a\n- b\n",
                ["(top level): expected a mapping with the keys profiles and models"],
                id="a list at the top is not a catalog",
            ),
            pytest.param(
                GOOD + "  broken: 3\n",
                ["models.broken: expected a mapping"],
                id="a model given as a plain value is named",
            ),
            pytest.param(
                edit(**{"source: /models/small": "source: /models/small\nserved_name: llama-70b"}),
                ["models.small.served_name: 'llama-70b' is already served by models.llama-70b"],
                id="two models served under one name",
            ),
            pytest.param(
                edit(**{"nodes: 2": "nodes: 2\n" + SIDECAR}),
                ["profiles.tp2x2.sidecars[0].ready: expected 'tcp:PORT' or 'http:PORT/PATH'"],
                id="a sidecar readiness check that is neither tcp: nor http:",
            ),
        ],
    )
    def test_a_mistake_is_named_by_its_path(self, tmp_path, text, messages):
        """Each mistake (the test's id says which) exits 1 with every one of ``messages`` in the output."""
        code, output = validate(tmp_path, text)
        assert code == 1
        for message in messages:
            assert message in output

    @pytest.mark.parametrize(
        "line, new, message",
        [
            (
                "replicas: 2",
                "replicas: 1000000",
                "models.llama-70b.replicas: expected an integer at most 10000",
            ),
            ("nodes: 2", "nodes: 65", "profiles.tp2x2.nodes: expected an integer at most 64"),
            (
                "gpus_per_node: 2",
                "gpus_per_node: 65",
                "profiles.tp2x2.gpus_per_node: expected an integer at most 64",
            ),
            (
                "source: /models/small",
                "source: /models/" + "x" * 5000,
                "models.small: source: at most 4096 characters",
            ),
            (
                'args: ["--time-to-first-token", "0.05"]',
                "args: [" + ", ".join(['"--x"'] * 2000) + "]",
                "profiles.tp2x2: args: at most 1024 entries",
            ),
        ],
        ids=["replicas", "nodes", "gpus_per_node", "source", "args"],
    )
    def test_absurd_sizes_are_refused_naming_the_limit(self, tmp_path, line, new, message):
        """A catalog asking for more than llmgw's limits is refused naming the limit, before it is stored."""
        code, output = validate(tmp_path, edit(**{line: new}))
        assert code == 1
        assert f"{message} (llmgw's limit), got " in output

    @pytest.mark.parametrize(
        "value, message",
        [
            ("ready_timeout: 0", "ready_timeout: expected a number of seconds above 0 to 86400, got 0"),
            (
                "ready_timeout: 90000",
                "ready_timeout: expected a number of seconds above 0 to 86400, got 90000",
            ),
            ("ready_timeout: '600'", "ready_timeout: expected a number, got '600'"),
            ("stop_grace: -1", "stop_grace: expected a number of seconds from 0 to 3600, got -1"),
            ("stop_grace: true", "stop_grace: expected a number, got True"),
            (
                "progress_deadline: 0",
                "progress_deadline: expected a number of seconds above 0 to 86400, got 0",
            ),
        ],
    )
    def test_bad_profile_timings_name_the_field_and_the_range(self, tmp_path, value, message):
        """ready_timeout and stop_grace outside their ranges, or not numbers, are refused with the range."""
        code, output = validate(tmp_path, edit(**{"engine: sim": f"engine: sim\n{value}"}))
        assert code == 1
        assert f"profiles.tp2x2.{message}" in output

    def test_profile_timings_are_read(self, tmp_path):
        """ready_timeout and stop_grace (integers or decimals) are kept as seconds; absent, None."""
        from llmgw_engine_sim import SimEngine

        timings = "ready_timeout: 1800\nstop_grace: 2.5\nprogress_deadline: 900"
        text = edit(**{"engine: sim": f"engine: sim\n{timings}"})
        catalog = parse_catalog(text, {"sim": SimEngine()})
        assert catalog.profiles["tp2x2"].progress_deadline == 900.0
        assert (catalog.profiles["tp2x2"].ready_timeout, catalog.profiles["tp2x2"].stop_grace) == (
            1800.0,
            2.5,
        )
        assert parse_catalog(GOOD, {"sim": SimEngine()}).profiles["single"].ready_timeout is None

    @pytest.mark.parametrize("key, kind", [("[a, b]", "a list"), ("{a: 1}", "a mapping")])
    def test_key_that_is_not_a_name(self, tmp_path, key, kind):
        """A YAML complex key (`? [a, b]`) is an error with its line, not a crash in the duplicate check."""
        code, output = validate(tmp_path, f"models:\n  ? {key}\n  : 1\n")
        assert code == 1
        assert f"line 2, column 5: invalid YAML: a key must be a name, not {kind}" in output

    def test_apply_of_a_file_that_is_not_utf8(self, tmp_path):
        """`ctl apply` reads the file as validate does: not UTF-8 is an error before any server is asked."""
        path = tmp_path / "catalog.yaml"
        path.write_bytes(b"models: \xff\n")
        result = CliRunner().invoke(cli, ["ctl", "--server", "https://127.0.0.1:1", "apply", str(path)])
        assert result.exit_code == 1
        assert f"{path}: 1 error\n  not UTF-8 text: invalid start byte at byte 8" in result.output

    def test_missing_file(self, tmp_path):
        """A catalog path that does not exist is named with the reason."""
        result = CliRunner().invoke(cli, ["ctl", "validate", str(tmp_path / "nope.yaml")])
        assert result.exit_code == 1
        assert "nope.yaml: 1 error" in result.output and "No such file or directory" in result.output

    def test_every_error_is_reported_at_once(self, tmp_path):
        """Several mistakes in one file are all listed, not only the first."""
        text = edit(
            **{
                "replicas: 2": 'replicas: "two"',
                "engine: sim": "engine: nope",
                "profile: single": "profile: missing",
                "nodes: 2": "nodes: 2\nbogus: 1",
            }
        )
        code, output = validate(tmp_path, text)
        assert code == 1
        assert "5 errors" in output
        for path in (
            "models.llama-70b.replicas",
            "profiles.tp2x2.engine",
            "profiles.single.engine",
            "models.small.profile",
            "profiles.tp2x2.bogus",
        ):
            assert path in output

    def test_console_script_exit_code(self, tmp_path, llmgw_exe, clean_env):
        """The installed `llmgw ctl validate` exits 1 and prints the path on stderr."""
        path = tmp_path / "catalog.yaml"
        path.write_text(edit(**{"replicas: 2": "replicas: many"}))
        result = subprocess.run(
            [llmgw_exe, "ctl", "validate", str(path)],
            capture_output=True,
            text=True,
            env=clean_env,
            timeout=60,
        )
        assert result.returncode == 1
        assert "models.llama-70b.replicas: expected an integer" in result.stderr


class _SingleNode(Engine):
    name = "solo"
    checked_versions = ("1",)
    multi_node = False
    programs = ("solo",)

    def build_command(self, spec: LaunchSpec) -> Command:
        return Command(argv=["solo", "--port", str(spec.port)])

    def widest_spec(self) -> LaunchSpec:
        return LaunchSpec(model_source="/m", served_name="m", host="h", port=1)


class TestLoadCatalog:
    """``load_catalog`` as ``ctl apply`` will call it."""

    def test_multi_node_on_a_single_node_engine(self):
        """nodes > 1 with an engine that cannot span nodes names the profile's nodes field."""
        text = "profiles:\n  p:\n    engine: solo\n    nodes: 2\nmodels: {}\n"
        with pytest.raises(CatalogError) as info:
            parse_catalog(text, {"solo": _SingleNode()})
        assert info.value.problems == [
            "profiles.p.nodes: engine 'solo' cannot run one replica on 2 nodes; "
            "use nodes: 1 or a multi-node engine"
        ]

    def test_returns_frozen_records(self, tmp_path):
        """A valid catalog gives frozen records with defaults filled in."""
        path = tmp_path / "c.yaml"
        path.write_text(GOOD)
        from llmgw_engine_sim import SimEngine

        catalog = load_catalog(path, {"sim": SimEngine()})
        assert catalog.models["small"].replicas == 1
        assert catalog.profiles["single"].gpus_per_node == 1
        assert catalog.profiles["tp2x2"].args == ("--time-to-first-token", "0.05")
        assert catalog.served_name("small") == "small"
        with pytest.raises(AttributeError):
            catalog.models["small"].replicas = 3  # type: ignore[misc]

    def test_empty_file_is_an_empty_catalog(self):
        """An empty catalog is valid and holds nothing."""
        catalog = parse_catalog("", {})
        assert catalog.models == {} and catalog.profiles == {}
