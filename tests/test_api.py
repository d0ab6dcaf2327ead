"""docs/api.md is the public surface: every name of ``autotp.__all__`` with its own signature, and
nothing the examples, benchmarks or docs use beyond it but what the page lists as advanced."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

import autotp

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "api.md").read_text()
ENTRIES = re.findall(r"^- `([^`]+)`", PAGE, flags=re.M)
PUBLIC_PART, _, ADVANCED_PART = PAGE.partition("## Advanced")
PUBLIC = re.findall(r"^- `([^`]+)`", PUBLIC_PART, flags=re.M)
ADVANCED = {re.split(r"[(]", e)[0] for e in re.findall(r"^- `([^`]+)`", ADVANCED_PART, flags=re.M)}
HOLDERS = {"plan": autotp.Plan, "pmodel": autotp.ParallelModule}


def signature_text(obj) -> str:
    """A signature as the page writes it: names and defaults, no annotations, no ``self``."""
    params, star = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.name == "self":
            continue
        if p.kind == p.VAR_POSITIONAL:
            params.append("*" + p.name)
            star = True
        elif p.kind == p.VAR_KEYWORD:
            params.append("**" + p.name)
        else:
            if p.kind == p.KEYWORD_ONLY and not star:
                params.append("*")
                star = True
            params.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return "(" + ", ".join(params) + ")"


def resolve(dotted: str):
    head, *rest = dotted.split(".")
    if head in HOLDERS:
        obj = HOLDERS[head]
    else:
        obj, parts = None, [head, *rest]
        for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            rest = parts[i:]
            break
    for part in rest:
        if dataclasses.is_dataclass(obj) and isinstance(obj, type) and part in {f.name for f in dataclasses.fields(obj)}:
            obj = next(f for f in dataclasses.fields(obj) if f.name == part)  # a field with no class default
            continue
        obj = getattr(obj, part)
    return obj


def test_every_public_name_is_on_the_page_and_nothing_else_is_called_public():
    top = {e.split("(")[0].removeprefix("autotp.") for e in PUBLIC if e.startswith("autotp.")}
    top = {t for t in top if "." not in t}
    assert top == set(autotp.__all__)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if "(" in e], ids=lambda e: e.split("(")[0])
def test_each_signature_on_the_page_is_the_code_s(entry):
    name, _, args = entry.partition("(")
    assert signature_text(resolve(name)) == "(" + args


@pytest.mark.parametrize("entry", [e for e in ENTRIES if "(" not in e and " " not in e])
def test_each_name_without_a_signature_exists(entry):
    from autotp.runtime.module import _MODEL_ATTRIBUTES

    if entry.startswith("pmodel.") and entry.split(".")[1] in _MODEL_ATTRIBUTES:
        return  # set on each module from its model (test_parallelize_errors.py reads config)
    resolve(entry)


def test_the_signature_check_sees_a_wrong_default():
    assert signature_text(autotp.plan) != signature_text(autotp.parallelize)
    assert "mode='train'" in signature_text(autotp.plan) and "mode=None" in signature_text(autotp.parallelize)


def _reached(text: str, is_python: bool) -> set[str]:
    """``autotp.X.Y`` names a file reaches past ``autotp``'s own names: by import, or dotted."""
    found = set()
    if is_python:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autotp."):
                found |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("autotp.")}
    found |= set(re.findall(r"(?<![\w/.])autotp(?:\.[a-z_]+){2,}", text))
    return found


def _allowed(name: str) -> bool:
    parts = name.split(".")
    if parts[1] in autotp.__all__:  # autotp.checkpoint.save, autotp.Plan.from_json
        return True
    return any(name == a or name.startswith(a + ".") or a.startswith(name + ".") for a in ADVANCED)


FILES = sorted([*ROOT.glob("examples/*.py"), *ROOT.glob("benchmarks/*.py"), ROOT / "README.md", *ROOT.glob("docs/*.md")])


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_benchmarks_and_docs_use_the_public_surface(path):
    if path.name == "api.md":
        return
    text = path.read_text()
    if path.suffix == ".md":  # the docs may name a module by its path to say where something lives
        text = re.sub(r"`autotp/[^`]*`", "", text)
    assert sorted(n for n in _reached(text, path.suffix == ".py") if not _allowed(n)) == []


def test_the_surface_check_sees_a_private_name():
    assert not _allowed("autotp.runtime.rewrite.GraphRewrite")
    assert _allowed("autotp.checkpoint.save") and _allowed("autotp.placement.S")
