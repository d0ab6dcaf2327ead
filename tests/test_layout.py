"""The package's layout holds: imports run one way down the pipeline, and every package says what it holds.

The order, from the bottom: the shared words (``placement``, ``ops``, ``mesh``, ``layout``, ``units``, ``words``,
``masks``), then
``tracing``, ``local`` (how an op runs on a rank's pieces, which the op families of planning import),
``planning``, ``runtime``, ``weights``; ``profiling`` stands beside them on the shared
words alone; the faces (``autotp/__init__.py``, ``parallel``, ``cli``) may import anything. Every
import counts, a function's own included (only a ``TYPE_CHECKING`` block is left out), and no two
modules may import each other, directly or around a loop.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autotp"
BASE = {"autotp.placement", "autotp.ops", "autotp.mesh", "autotp.layout", "autotp.units", "autotp.words",
        "autotp.masks"}
STAGES = {"tracing": 1, "local": 2, "planning": 3, "runtime": 4, "weights": 5, "profiling": 1}
FACE = 9


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    hidden = {id(n) for node in ast.walk(tree)
              if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "autotp"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                module = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "autotp":
                found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names}
    return found - {name}


GRAPH = nx.DiGraph([(m, t) for m, p in MODULES.items() for t in _imports(m, p)])


def stage(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in STAGES:
        return parts[1]
    return "base" if module in BASE else "face"


def _rank(s: str) -> int:
    return 0 if s == "base" else FACE if s == "face" else STAGES[s]


def test_every_import_names_a_module_of_the_package():
    assert not {t for t in GRAPH.nodes if t not in MODULES}


def test_no_module_imports_one_that_imports_it_back():
    assert list(nx.simple_cycles(GRAPH)) == []


def test_imports_run_down_the_pipeline():
    upward = []
    for a, b in GRAPH.edges:
        sa, sb = stage(a), stage(b)
        if (_rank(sb) > _rank(sa) or (sa == "profiling" and sb not in ("base", "profiling"))
                or (sb == "profiling" and sa not in ("face", "profiling"))):
            upward.append(f"{a} ({sa}) imports {b} ({sb})")
    assert upward == []


def test_the_check_sees_an_upward_import():
    """The rule above would catch a planning module that imported the runtime."""
    assert _rank(stage("autotp.runtime.rewrite")) > _rank(stage("autotp.planning.result.plan"))
    assert stage("autotp.placement") == "base" and stage("autotp.parallel") == "face"
    assert ("autotp.runtime.rewrite", "autotp.planning.result.plan") in GRAPH.edges  # the graph holds real edges


def test_the_shared_words_import_no_stage():
    assert [(m, t) for m in BASE if m in GRAPH for t in GRAPH.successors(m) if stage(t) != "base"] == []


PACKAGES = sorted(".".join(p.parent.relative_to(PACKAGE).parts) for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


def test_every_stage_is_a_package():
    assert set(STAGES) <= set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_says_what_goes_in_and_out_and_lists_its_modules(package):
    module = importlib.import_module(f"autotp.{package}")
    doc = module.__doc__ or ""
    assert len(doc.splitlines()) >= 3, f"autotp.{package} has no docstring"
    folder = PACKAGE / package.replace(".", "/")
    own = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__") + sorted(
        p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    missing = [m for m in own if f"``{m}``" not in doc and f"``{m}/``" not in doc and f":mod:`.{m}`" not in doc]
    assert missing == [], f"autotp.{package}'s docstring does not name {missing}"


def test_a_module_stays_a_few_hundred_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 550}
    assert long == {}, f"modules over 550 lines: {long}"


def test_planning_holds_its_steps_in_subpackages():
    """Beside the entry (``planner``) and its errors, planning's modules live in the subpackage of their step."""
    flat = sorted(p.stem for p in (PACKAGE / "planning").glob("*.py") if p.stem != "__init__")
    assert flat == ["errors", "planner"]
