"""The examples in autotp's docstrings run and print what they say (cost_models' are checked in
tests/test_cost_models.py)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import autotp

_MODULES = sorted(m.name for m in pkgutil.walk_packages(autotp.__path__, "autotp.")
                  if m.name not in {"autotp.__main__"})


def test_every_module_is_listed():
    assert {"autotp.tracing.export", "autotp.planning.solver", "autotp.planning.tying", "autotp.profiling.fit"} <= set(_MODULES)


@pytest.mark.parametrize("name", _MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
