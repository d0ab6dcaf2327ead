"""Byte counts as a person reads them: the unit picked to fit, three significant digits.

>>> format_bytes(4_823_449), format_bytes(512), format_bytes(1.5 * 2**30), format_bytes(70e9)
('4.6 MiB', '512 B', '1.5 GiB', '65.2 GiB')
>>> format_bytes(1_044_480), format_bytes(1023 * 2**20)
('1020 KiB', '1023 MiB')
>>> format_bytes(20_971_520), format_bytes(21_000_000)
('20 MiB', '20 MiB')

Two figures that print alike (a budget just under a minimum) are told apart by
:func:`format_bytes_pair`, which adds the exact bytes where the short forms coincide:

>>> format_bytes_pair(20_971_520, 21_000_000)
('20 MiB (20971520 bytes)', '20 MiB (21000000 bytes)')
>>> format_bytes_pair(1 << 20, 3 << 20)
('1 MiB', '3 MiB')
"""

from __future__ import annotations

__all__ = ["format_bytes", "format_bytes_pair"]

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: float) -> str:
    """``n`` bytes with the largest binary unit it reaches, to three significant digits."""
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{_three_digits(n / size)} {unit}"
    return f"{n:.0f} B"


def _three_digits(v: float) -> str:
    text = f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_bytes_pair(a: float, b: float) -> tuple[str, str]:
    """Both figures short, or with their exact bytes where the short forms would read the same."""
    short_a, short_b = format_bytes(a), format_bytes(b)
    if short_a == short_b and round(a) != round(b):
        return f"{short_a} ({a:.0f} bytes)", f"{short_b} ({b:.0f} bytes)"
    return short_a, short_b
