"""Checking profile JSON: the error that names a field by its dotted path, and the small readers
every part of a profile uses (numbers, objects with known fields, frozen copies of free-form data)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any


class ProfileError(ValueError):
    """A profile field is missing or wrong; ``field`` is its dotted path ("" for the whole)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.field = field
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.field}: {self.problem}" if self.field else self.problem

    def within(self, prefix: str) -> ProfileError:
        """The same error seen from the enclosing object: the path gains ``prefix.``."""
        return ProfileError(f"{prefix}.{self.field}" if self.field else prefix, self.problem)


class _FrozenMap(Mapping):
    """A read-only, hashable mapping that compares equal to a dict with the same items."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping | None = None) -> None:
        self._items = dict(items or {})

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


@contextmanager
def _within(prefix: str) -> Iterator[None]:
    try:
        yield
    except ProfileError as e:
        raise e.within(prefix) from None


def _number(value: Any, field: str, *, positive: bool) -> float:
    want = "a number > 0" if positive else "a number >= 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ProfileError(field, f"expected {want}, got {value!r}")
    out = float(value)
    if not math.isfinite(out) or out < 0 or (positive and out == 0):
        raise ProfileError(field, f"expected {want}, got {value!r}")
    return out


def _object(value: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Mapping:
    """Check that ``value`` is a JSON object with exactly the ``required`` (+ optional) keys."""
    if not isinstance(value, Mapping):
        fields = ", ".join(required)
        raise ProfileError("", f"expected a JSON object with fields {fields}, got {value!r}")
    for key in required:
        if key not in value:
            raise ProfileError(str(key), f"missing; expected fields {', '.join(required)}")
    for key in value:
        if key not in required and key not in optional:
            allowed = ", ".join(required + optional)
            raise ProfileError(str(key), f"unknown field; expected one of {allowed}")
    return value


def _freeze_json(value: Any, field: str) -> Any:
    """Deep copy of JSON-like data as immutable values: objects -> _FrozenMap, arrays -> tuple."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ProfileError(field, f"expected a finite number (or null), got {value!r}")
        return value
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise ProfileError(field, f"expected string keys, got {key!r}")
        return _FrozenMap({k: _freeze_json(v, f"{field}.{k}") for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze_json(v, f"{field}[{i}]") for i, v in enumerate(value))
    want = "JSON data (object, array, string, number, bool, null)"
    raise ProfileError(field, f"expected {want}, got {value!r}")


def _thaw_json(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw_json(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw_json(v) for v in value]
    return value
