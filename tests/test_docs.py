"""The docs say what the code does: docstring examples run and print what they say (cost_models'
are checked in tests/cost_models/test_cost_models.py), the README's and docs' runnable blocks run,
the README shows its example as the file is, and every example says how it is run."""

from __future__ import annotations

import ast
import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import autotp

_MODULES = sorted(m.name for m in pkgutil.walk_packages(autotp.__path__, "autotp.")
                  if m.name not in {"autotp.__main__"})


def test_every_module_is_listed():
    assert {"autotp.tracing.export", "autotp.planning.solve.solver", "autotp.planning.choices.tying", "autotp.profiling.fit"} <= set(_MODULES)


@pytest.mark.parametrize("name", _MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"


# -- README, docs/ and examples/ -----------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if "__main__" in p.read_text() or p.name == "train_hf.py")
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)


def blocks(text: str, info: str) -> list[str]:
    return [body for kind, body in _FENCE.findall(text) if kind.strip() == info]


def test_the_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    first = _FENCE.search(text)
    assert "make demo" in first.group(2) and "make test" in first.group(2)


def test_the_readme_example_is_the_file_it_names():
    """The README shows examples/train_hf.py as it is: the code after its docstring."""
    source = (ROOT / "examples" / "train_hf.py").read_text()
    code = source[len(ast.get_docstring(ast.parse(source), clean=False)) + 6:].strip("\n")
    readme = (ROOT / "README.md").read_text()
    assert "torchrun --nproc-per-node 2 examples/train_hf.py" in readme
    assert code in [b.strip("\n") for b in blocks(readme, "python")]
    assert len(code.splitlines()) <= 25


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_says_how_to_run_it_and_edits_no_path(path):
    text = path.read_text()
    doc = ast.get_docstring(ast.parse(text)) or ""
    name = path.stem
    assert re.search(rf"(python|torchrun --nproc-per-node \d+) -m examples\.{name}\b", doc) or (
        f"examples/{name}.py" in doc and "from examples" not in text), f"{path.name}: no run line in its docstring"
    assert "sys.path" not in text


def test_no_benchmark_edits_the_path():
    assert [p.name for p in (ROOT / "benchmarks").glob("*.py") if "sys.path" in p.read_text()] == []


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p.read_text(), "python run")], ids=lambda p: p.name)
def test_runnable_blocks_run(page, tmp_path, monkeypatch):
    """Every ```python run block of a page, in order, in one namespace, from an empty directory."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for i, code in enumerate(blocks(page.read_text(), "python run")):
        try:
            exec(compile(code, f"{page.name} block {i + 1}", "exec"), namespace)
        except Exception as err:  # the block and the error, not exec's frame
            raise AssertionError(f"{page.name}, runnable block {i + 1} fails: {type(err).__name__}: {err}\n{code}") from err


def test_the_block_finder_sees_a_runnable_block():
    assert blocks("x\n```python run\nprint(1)\n```\n```python\nno\n```\n", "python run") == ["print(1)\n"]
