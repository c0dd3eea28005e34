"""For tests of what llmgw exports and what ``deploy/`` reads: metric names on both sides, and promtool.

:func:`deployed_names` lists every metric name the Grafana dashboard and the
alert rules query; :func:`exported_names` every sample name an exposition
declares (``# TYPE`` lines included, so a labelled counter that counted
nothing yet is there too). A test scrapes real processes and compares them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import yaml

from llmgw.testing.require import require

__all__ = [
    "DEPLOY",
    "promql_names",
    "deployed_names",
    "exported_names",
    "require_tool",
    "promtool_check_metrics",
    "samples",
]

#: the repository's ``deploy/`` folder
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
#: set to 1 (CI does) to fail, not skip, the tests that need promtool when it is missing
REQUIRE_PROMTOOL = "LLMGW_REQUIRE_PROMTOOL"

_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_WORD = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"})
_KEYWORDS |= {"bool", "offset", "inf", "nan", "Inf", "NaN"}
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def promql_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, keywords, labels and durations left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = _GROUPING.sub("", expr)
    names = set()
    for match in _WORD.finditer(expr):
        word = match.group(0)
        if word in _KEYWORDS or expr[match.end() :].lstrip().startswith("("):
            continue
        if match.start() and expr[match.start() - 1] in "0123456789.$":
            continue  # a number's exponent or a variable
        names.add(word)
    return names


def _dashboard_exprs(node: object) -> Iterable[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "definition" and isinstance(value, str):
                match = re.match(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", value)
                if match:
                    yield match.group(1)
            else:
                yield from _dashboard_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _dashboard_exprs(item)


def deployed_names(deploy: Path = DEPLOY) -> dict[str, set[str]]:
    """Metric name -> where it is read (``dashboard``, ``alert NAME``), over the dashboard and the rules."""
    where: dict[str, set[str]] = {}
    dashboard = json.loads((deploy / "grafana" / "llmgw.json").read_text())
    for expr in _dashboard_exprs(dashboard):
        for name in promql_names(expr):
            where.setdefault(name, set()).add("dashboard")
    rules = yaml.safe_load((deploy / "prometheus" / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            for name in promql_names(rule["expr"]):
                where.setdefault(name, set()).add(f"alert {rule.get('alert') or rule.get('record')}")
    return where


def exported_names(text: str) -> set[str]:
    """Every sample name of an exposition: those present, and those its ``# TYPE`` lines declare."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            if kind.strip() == "counter":  # declared with its _total when it has no sample yet
                family = family.removesuffix("_total")
            names |= {family + suffix for suffix in _SUFFIXES.get(kind.strip(), ("",))}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample named ``name`` in the exposition ``text``; called by tests that
    check what a process counted."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def require_tool(name: str, package: str) -> str:
    """The path of program ``name``; skips the test without it (fails with ``LLMGW_REQUIRE_PROMTOOL=1``)."""
    path = shutil.which(name)
    message = f"{name} is not installed (Debian: apt-get install {package})"
    require(path is not None, REQUIRE_PROMTOOL, message)
    return path


def promtool_check_metrics(text: str, *, allow_colons: bool = False) -> list[str]:
    """The problems ``promtool check metrics`` finds in an exposition (empty: it passes).

    :param allow_colons: leave out "should not contain ':'" (vLLM's names, ``vllm:...``, have them).
    """
    promtool = require_tool("promtool", "prometheus")
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    if allow_colons:
        lines = [line for line in lines if "should not contain ':'" not in line]
    if done.returncode not in (0, 3):  # 3: lint problems, listed; anything else: promtool failed
        return lines or [f"promtool exited with {done.returncode}"]
    return lines
