"""``autotp profile``: sizes and options, mesh groups, result checks, the alpha-beta fit,
and real 2-process gloo runs (a sweep with --check, a failing check, a rank that hangs,
a rank that dies).

The multi-process tests run the command as a user would (``python -m autotp.cli``) with
tiny sweeps: 1 KiB..64 KiB, 3 timed runs, one block per size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autotp.profiling import collectives, command
from autotp.profiling.collectives import CollectiveCall, bus_factor, expected, fill_for_check
from autotp.profiling.config import parse_mesh, parse_size, size_sweep
from autotp.profiling.fit import TimedPoint, fit_alpha_beta, fit_collective
from autotp.profiling.mesh import mesh_axes
from autotp.profiling.sizes import MAX_REFINED

REPO = Path(__file__).resolve().parents[2]
TINY = ["--backend", "gloo", "-b", "1K", "-e", "64K", "-n", "3", "-w", "1", "--min-time-s", "0", "--rounds", "1"]


# --- sizes, options --------------------------------------------------------------------------


def test_parse_size_reads_binary_suffixes():
    assert parse_size("1K") == 1024
    assert parse_size("256M") == 256 * 2**20
    assert parse_size("1g") == 2**30
    assert parse_size("4096") == 4096
    assert parse_size("64MiB") == 64 * 2**20
    assert size_sweep(1024, 8192, 2) == (1024, 2048, 4096, 8192)
    assert size_sweep(1024, 5000, 4) == (1024, 4096)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autotp profile")
    command.add_arguments(parser)
    return parser


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-b", "1Q"], "invalid size '1Q'"),
        (["-e", "-5"], "invalid size '-5'"),
        (["--mesh", "2xa"], "invalid mesh '2xa'"),
        (["-f", "1"], "must be at least 2"),
        (["--nproc", "0"], "must be at least 1"),
        (["--timeout-s", "0"], "must be > 0 seconds"),
        (["--device-budget-s", "-1"], "must be > 0 seconds, got -1"),
        (["--device-budget-s", "soon"], "invalid number of seconds 'soon'"),
        (["--dtypes", "float32,fp8"], "unknown dtype 'fp8' in 'float32,fp8'"),
        (["--dtypes", "int8"], "expected names among float32, bfloat16, float16"),
    ],
)
def test_parser_rejects_bad_values_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_run_rejects_options_that_disagree(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    args = _parser().parse_args(["--nproc", "3", "--mesh", "2x2"])
    assert command.run(args) == 2
    assert "mesh 2x2 has 4 ranks but --nproc is 3" in capsys.readouterr().err
    args = _parser().parse_args(["-b", "1M", "-e", "1K"])
    assert command.run(args) == 2
    assert "min_bytes <= max_bytes" in capsys.readouterr().err


# --- mesh groups ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8,), (2, 4), (4, 2), (2, 2, 2)])
def test_mesh_axis_groups_match_device_mesh_layout(shape):
    # DeviceMesh's groups along dim d: the mesh tensor with d moved last, rows of it.
    mesh = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for axis in mesh_axes(shape):
        reference = mesh.movedim(axis.index, -1).reshape(-1, shape[axis.index]).tolist()
        assert [list(g) for g in axis.groups] == reference
    assert parse_mesh("2x4") == (2, 4)


# --- collective checks ---------------------------------------------------------------------------


def _simulate(kind: str, inputs: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """Each collective's textbook result, computed directly from all ranks' inputs."""
    if kind == "all_reduce":
        return [sum(inputs)] * n
    if kind == "all_gather":
        return [torch.cat(inputs)] * n
    if kind == "reduce_scatter":
        return list(sum(inputs).chunk(n))
    if kind == "all_to_all":
        return [torch.cat([inputs[src].chunk(n)[dst] for src in range(n)]) for dst in range(n)]
    if kind == "broadcast":
        return [inputs[0].clone()] * n
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", collectives.KINDS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_check_values_equal_a_direct_simulation(kind, n):
    size_bytes = 4 * 60  # 60 elements: 30, 20, 15 per rank
    count = collectives.element_count(size_bytes, n)
    calls = []
    for g in range(n):
        in_numel = count // n if kind == "all_gather" else count
        out_numel = count // n if kind == "reduce_scatter" else count
        inp = torch.zeros(in_numel)
        out = inp if kind in ("all_reduce", "broadcast") else torch.zeros(out_numel)
        call = CollectiveCall(kind, count, g, n, inp, out, run=lambda: None)
        fill_for_check(call)
        calls.append(call)
    results = _simulate(kind, [c.input.clone() for c in calls], n)
    for g, call in enumerate(calls):
        torch.testing.assert_close(expected(call), results[g], rtol=0, atol=0)
        call.output.copy_(results[g])
        assert collectives.count_wrong(call) == 0
        call.output.view(-1)[-1] += 1
        assert collectives.count_wrong(call) == 1


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 4) == pytest.approx(3 / 4)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(1 / 2)
    assert bus_factor("all_to_all", 4) == pytest.approx(3 / 4)
    assert bus_factor("broadcast", 8) == 1.0


# --- fit -----------------------------------------------------------------------------------------

SIZES = [2**k for k in range(10, 27)]  # 1 KiB .. 64 MiB


@pytest.mark.parametrize("kind, n", [("all_reduce", 2), ("all_gather", 4), ("broadcast", 8)])
def test_fit_recovers_known_latency_and_bandwidth(kind, n):
    latency_s, busbw = 2e-5, 3e9
    factor = bus_factor(kind, n)
    points = [TimedPoint(s, latency_s + s * factor / busbw) for s in SIZES]
    fit = fit_collective(kind, n, points)
    assert fit.latency_s == pytest.approx(latency_s, rel=0.01)
    assert fit.bus_bandwidth_bytes_per_s == pytest.approx(busbw, rel=0.01)
    assert [e.size_bytes for e in fit.leave_one_out] == [s for s in SIZES if s >= 2**20]
    assert fit.max_leave_one_out_error < 1e-6
    assert fit.held_out == () and fit.max_held_out_error is None  # no held-out sizes given
    assert len(fit.segments) == 1  # one line fits: no breakpoint


def test_fit_with_noise_stays_close_and_reports_held_out_errors():
    rng = random.Random(0)
    latency_s, busbw = 2e-5, 3e9
    points = [TimedPoint(s, (latency_s + s / busbw) * (1 + rng.uniform(-0.03, 0.03))) for s in SIZES]
    fit = fit_collective("broadcast", 2, points)
    assert fit.latency_s == pytest.approx(latency_s, rel=0.05)
    assert fit.bus_bandwidth_bytes_per_s == pytest.approx(busbw, rel=0.05)
    assert 0 < fit.max_leave_one_out_error < 0.08
    assert len(fit.segments) == 1  # a few percent of noise never buys a breakpoint


def _two_lines(kind, n, sizes, break_bytes, low, high):
    """Exact times of ``low`` = (latency_s, busbw) below ``break_bytes`` and ``high`` from it."""
    factor = bus_factor(kind, n)
    return [TimedPoint(s, (low if s < break_bytes else high)[0] + s * factor / (low if s < break_bytes else high)[1])
            for s in sizes]


@pytest.mark.parametrize("break_bytes", [2**17, 2**22, 2**25])
def test_fit_recovers_a_breakpoint_and_both_lines(break_bytes):
    # A protocol switch (NCCL) or a page-faulting step (gloo): the busbw drops from break_bytes.
    low, high = (2e-5, 3e9), (1e-4, 0.8e9)
    fit = fit_collective("all_gather", 4, _two_lines("all_gather", 4, SIZES, break_bytes, low, high))
    assert [seg.from_bytes for seg in fit.segments] == [0, break_bytes]
    for seg, (latency_s, busbw) in zip(fit.segments, (low, high)):
        assert seg.latency_s == pytest.approx(latency_s, rel=1e-6)
        assert seg.bus_bandwidth_bytes_per_s == pytest.approx(busbw, rel=1e-6)
    assert max(abs(e.relative_error) for e in fit.residuals) < 1e-9
    assert fit.predict_s(break_bytes - 1) == pytest.approx(low[0] + (break_bytes - 1) * 0.75 / low[1])
    assert fit.predict_s(2 * SIZES[-1]) == pytest.approx(high[0] + 2 * SIZES[-1] * 0.75 / high[1])


def test_fit_with_noise_still_finds_the_step():
    rng = random.Random(1)
    exact = _two_lines("all_reduce", 2, SIZES, 2**25, (1.5e-3, 2e9), (0.0, 0.35e9))
    points = [TimedPoint(p.size_bytes, p.time_s * (1 + rng.uniform(-0.03, 0.03))) for p in exact]
    fit = fit_collective("all_reduce", 2, points)
    assert [seg.from_bytes for seg in fit.segments] == [0, 2**25]
    assert fit.segments[1].bus_bandwidth_bytes_per_s == pytest.approx(0.35e9, rel=0.05)


def test_leave_one_out_redoes_the_choice_of_ranges():
    # The step at 32 MiB is seen by two sizes, 32 and 64 MiB. Left out, either one is alone
    # above the step, a range needs two sizes, so the honest prediction is (close to) the
    # lower line's: far off. Reusing the full fit's ranges would hide that (~0% error).
    low, high = (2e-5, 3e9), (0.0, 0.5e9)
    points = _two_lines("broadcast", 2, SIZES, 2**25, low, high)
    fit = fit_collective("broadcast", 2, points)
    assert [seg.from_bytes for seg in fit.segments] == [0, 2**25]
    held = {e.size_bytes: e for e in fit.leave_one_out}
    for size in (2**25, 2**26):
        assert held[size].predicted_s == pytest.approx(low[0] + size / low[1], rel=0.05)
        assert held[size].relative_error < -0.8
    assert all(abs(held[s].relative_error) < 1e-6 for s in held if s < 2**25)


def test_fit_is_deterministic_and_order_free():
    rng = random.Random(2)
    points = [TimedPoint(s, (2e-5 + s / 3e9) * (1 + rng.uniform(-0.3, 0.3))) for s in SIZES]
    fits = [fit_collective("all_to_all", 2, order) for order in (points, points[::-1], sorted(points, key=id))]
    assert fits[0] == fits[1] == fits[2]
    assert 1 <= len(fits[0].segments) <= 3
    starts = [seg.from_bytes for seg in fits[0].segments]
    assert starts == sorted(starts) and all(seg.points >= 2 for seg in fits[0].segments)


def test_fit_bridges_a_gap_where_the_times_rise_and_lets_the_next_range_hold_where_they_drop():
    """Between the last size of one range (2 MiB) and the first of the next (4 MiB) no line was
    fitted: a rise is bridged straight from one line to the other, a drop hands the gap to the
    upper line, so no size in it is predicted slower than 4 MiB; the fitted ranges are unchanged."""
    lo, hi = 2**21, 2**22
    mid = int((lo * hi) ** 0.5)
    rise = fit_collective("broadcast", 2, _two_lines("broadcast", 2, SIZES, hi, (1e-3, 1e9), (2e-3, 2e9)))
    assert [(seg.from_bytes, seg.points) for seg in rise.segments] == [(0, 12), (lo + 1, 0), (hi, 5)]
    low_s, high_s = 1e-3 + lo / 1e9, 2e-3 + hi / 2e9
    assert rise.predict_s(lo + 1) == pytest.approx(low_s, rel=1e-6)
    assert rise.predict_s(hi - 1) == pytest.approx(high_s, rel=1e-6)
    assert rise.predict_s(mid) == pytest.approx(low_s + (high_s - low_s) * (mid - lo) / (hi - lo), rel=1e-9)
    assert max(abs(e.relative_error) for e in rise.residuals) < 1e-9  # the fit sizes keep their lines

    drop = fit_collective("broadcast", 2, _two_lines("broadcast", 2, SIZES, hi, (1e-3, 1e9), (0.0, 3e9)))
    assert [(seg.from_bytes, seg.points) for seg in drop.segments] == [(0, 12), (lo + 1, 5)]
    assert drop.predict_s(mid) == pytest.approx(mid / 3e9) and drop.predict_s(mid) < drop.predict_s(hi)
    assert drop.predict_s(lo) == pytest.approx(1e-3 + lo / 1e9)


def test_fit_clamps_latency_and_bandwidth():
    # Time proportional to size with a slight negative intercept: latency clamps to 0.
    a, b = fit_alpha_beta([1e3, 1e6, 1e9], [0.9e-6, 0.999e-3, 0.999999])
    assert a == 0.0 and b > 0
    # Time falling with size: no bandwidth to fit; it stays positive and finite.
    a, b = fit_alpha_beta([1e3, 1e6], [2e-3, 1e-3])
    assert a >= 0 and 0 < b < float("inf")


def _midpoints(sizes):
    return [round((a * b) ** 0.5 / 8) * 8 for a, b in zip(sizes, sizes[1:])]


def test_fit_summary_prints_every_range_and_held_out_errors_per_kind():
    from autotp.profiling.table import format_fits

    lines_of = {"low": (2e-5, 3e9), "high": (0.0, 0.5e9)}
    step = fit_collective(
        "broadcast", 2, _two_lines("broadcast", 2, SIZES, 2**25, lines_of["low"], lines_of["high"]),
        test_points=_two_lines("broadcast", 2, _midpoints(SIZES), 2**25, lines_of["low"], lines_of["high"]),
    )
    line = fit_collective("all_reduce", 2, _two_lines("all_reduce", 2, SIZES, 2**40, (2e-5, 3e9), (0.0, 1.0)),
                          test_points=_two_lines("all_reduce", 2, _midpoints(SIZES), 2**40, (2e-5, 3e9), (0.0, 1.0)))
    text = format_fits([("axis0", line), ("axis0", step)])
    lines = text.splitlines()
    assert all(l.startswith("#") for l in lines)
    kind_lines = [l for l in lines if "held-out max |err|" in l]
    assert [l.split()[2] for l in kind_lines] == ["all_reduce", "broadcast"]
    assert "held-out max |err| 0.0% (leave-one-out 0.0%)" in kind_lines[0]
    range_lines = [l for l in lines if "from 32 MiB" in l]
    assert len(range_lines) == 1 and "busbw    0.500 GB/s" in range_lines[0]
    # Midpoints >= 1 MiB: 1.4, 2.8, 5.7, 11, 23, 45 MiB per kind; all on their lines (the step lies
    # between 23 and 32 MiB), so all are predicted exactly: the headline is 12 of 12.
    assert "# Held-out summary: 12 of 12 held-out sizes within 25%, worst 0.0%" in text
    # Leave-one-out of 32 or 64 MiB leaves one size above the step: those two miss.
    assert "within 25%, worst" in text and "# Leave-one-out (stricter" in text
    assert "12 of 14 within 25%" in text
    assert "# note" not in text  # notes follow the held-out sizes, which all fit


def test_summary_counts_held_out_sizes_within_25_percent():
    from autotp.profiling.table import format_fits, held_out_summary

    exact = [TimedPoint(s, 2e-5 + s / 3e9) for s in SIZES]
    mids = [2**20 * 3 // 2, 2**22 * 3 // 2, 2**24 * 3 // 2, 2**10 * 3 // 2]
    errors = [0.10, -0.30, 0.50, 5.0]  # the last is below 1 MiB: measured, never counted
    # measured = predicted / (1 + error), so (predicted - measured) / measured = error
    tests = [TimedPoint(s, (2e-5 + s / 3e9) / (1 + e)) for s, e in zip(mids, errors)]
    fit = fit_collective("broadcast", 2, exact, test_points=tests)
    assert [e.size_bytes for e in fit.held_out] == mids[:3]
    assert [round(e.relative_error, 6) for e in fit.held_out] == errors[:3]
    within, total, worst = held_out_summary([fit])
    assert (within, total) == (1, 3) and worst == pytest.approx(0.5)
    text = format_fits([("axis0", fit)])
    assert "# Held-out summary: 1 of 3 held-out sizes within 25%, worst 50.0%" in text
    assert "# note: broadcast on axis0: held-out sizes off by up to 50%" in text
    # Without held-out sizes there is no headline, only the leave-one-out line.
    text = format_fits([("axis0", fit_collective("broadcast", 2, exact))])
    assert "Held-out summary" not in text and "7 of 7 within 25%, worst 0.0%" in text


def test_held_out_measurements_never_change_the_fit():
    rng = random.Random(3)
    points = [TimedPoint(s, (2e-5 + s / 3e9) * (1 + rng.uniform(-0.2, 0.2))) for s in SIZES]
    tests = [TimedPoint(s, 2e-5 + s / 3e9) for s in _midpoints(SIZES)]
    base = fit_collective("all_gather", 2, points, test_points=tests)
    assert len(base.held_out) == 6
    for factor in (0.1, 3.0):
        spoiled = fit_collective("all_gather", 2, points,
                                 test_points=[TimedPoint(p.size_bytes, p.time_s * factor) for p in tests])
        assert (spoiled.segments, spoiled.residuals, spoiled.leave_one_out) == (
            base.segments, base.residuals, base.leave_one_out)
        assert [e.predicted_s for e in spoiled.held_out] == [e.predicted_s for e in base.held_out]
        assert spoiled.held_out != base.held_out
    assert fit_collective("all_gather", 2, points).segments == base.segments


def test_a_point_follows_the_mix_of_two_clusters_of_blocks_and_ignores_a_rare_stall():
    """Blocks of a small gloo collective on a shared 2-core host fall in two clusters (both ranks
    running, or one waiting for a core). A point's figure must move with the mix, not jump from one
    cluster to the other as a median does; one block hit by a long stall must not move it."""
    from autotp.profiling.sweep import trimmed_mean

    def blocks(fast_share: float) -> list[float]:
        n_fast = round(20 * fast_share)
        return [1e-3] * n_fast + [4e-3] * (20 - n_fast)

    a, b = trimmed_mean(blocks(0.55)), trimmed_mean(blocks(0.45))
    assert b / a == pytest.approx((0.45 * 1 + 0.55 * 4) / (0.55 * 1 + 0.45 * 4), rel=0.05)  # +13%, not 4x
    assert trimmed_mean([1e-3] * 19 + [1.0]) == pytest.approx(1e-3)
    assert trimmed_mean([2e-3]) == 2e-3  # one block: nccl-tests' figure


# --- held-out sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8, 16])
@pytest.mark.parametrize("sweep_args", [(1024, 2**26, 2), (4, 2**20, 2), (1000, 10**7, 3), (1024, 2**26, 4)])
def test_held_out_sizes_lie_strictly_between_and_suit_every_collective(n, sweep_args):
    from autotp.profiling.sizes import SHARD_ALIGN_BYTES, held_out_sizes, planned_sizes

    sizes = size_sweep(*sweep_args)
    measured = sorted({collectives.element_count(s, n) * collectives.DTYPE_BYTES for s in sizes})
    held = held_out_sizes(sizes, n)
    assert held == tuple(sorted(held))
    for h in held:
        count = collectives.element_count(h, n)
        assert count * collectives.DTYPE_BYTES == h  # measured exactly as asked
        assert count % n == 0 and count >= n  # every rank's shard is whole: valid for all five kinds
        assert h not in measured and h not in sizes  # never a fit size
        below = max(m for m in measured if m < h)
        above = min(m for m in measured if m > h)
        assert measured.index(above) == measured.index(below) + 1  # between two neighbours
        mid = (below * above) ** 0.5
        aligned = [m for m in range(0, above, SHARD_ALIGN_BYTES * n) if below < m]
        if aligned:  # room for whole cache lines per shard: the nearest such size to the midpoint
            assert (h // n) % SHARD_ALIGN_BYTES == 0
            assert abs(h - mid) <= min(abs(m - mid) for m in aligned) + 1e-6
        else:  # whole elements per shard, the nearest to the midpoint
            assert abs(h - mid) <= n * collectives.DTYPE_BYTES / 2 + 1e-6
    # one between each two neighbours, unless rounding leaves no room (tiny sizes, big groups)
    gaps = [hi - lo for lo, hi in zip(measured, measured[1:])]
    if all(gap >= 4 * n * collectives.DTYPE_BYTES for gap in gaps):
        assert len(held) == len(measured) - 1
    assert len(held) <= len(measured) - 1
    if sweep_args == (1024, 2**26, 2):
        assert len(held) == len(sizes) - 1 == 16
    planned = planned_sizes(sizes, n, held_out=True)
    assert [s for s, h in planned if h] == list(held) and [s for s, h in planned if not h] == list(sizes)
    assert [s for s, _ in planned] == sorted(s for s, _ in planned)  # interleaved: each next to its neighbours
    assert planned_sizes(sizes, n, held_out=False) == tuple((s, False) for s in sizes)


def _step_times(sizes, break_bytes=2**25):
    """Times of a collective whose bandwidth drops 3x from ``break_bytes`` on."""
    return [2e-5 + s / (3e9 if s < break_bytes else 1e9) for s in sizes]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_refinement_adds_two_sizes_inside_the_gap_where_a_range_starts(n):
    from autotp.profiling.sizes import SHARD_ALIGN_BYTES, held_out_sizes, refinement_sizes

    sizes = [collectives.element_count(s, n) * 4 for s in size_sweep(1024, 2**26, 2)]
    held = held_out_sizes(sizes, n)
    added = refinement_sizes("all_gather", n, sizes, _step_times(sizes), avoid=held)
    assert len(added) == 2 and 2**24 < added[0] < held[-2] < added[1] < 2**25  # both sides of the midpoint
    assert added[0] == pytest.approx(2**24.25, rel=1e-3) and added[1] == pytest.approx(2**24.75, rel=1e-3)
    assert all((a // n) % SHARD_ALIGN_BYTES == 0 for a in added)
    # one straight line: no range starts, nothing to add; a range per step: two sizes per gap
    assert refinement_sizes("all_gather", n, sizes, [2e-5 + s / 3e9 for s in sizes]) == ()
    two_steps = [t * (2.0 if s >= 2**16 else 1.0) for s, t in zip(sizes, _step_times(sizes))]
    added = refinement_sizes("all_gather", n, sizes, two_steps, avoid=held)
    assert len(added) == 4 and 2**15 < added[0] < added[1] < 2**16 and 2**24 < added[2] < added[3] < 2**25
    assert not set(added) & (set(sizes) | set(held))


def test_refinement_adds_sizes_around_the_bandwidth_bound_size_the_fit_misses_most():
    """A dip too narrow to buy a size range of its own (one size 20% fast) gets sizes in both
    gaps next to it; latency-bound sizes that scatter by 30% get none, and a miss under
    ``REFINE_MISS`` gets none."""
    from autotp.profiling.fit import SIZES_1K_TO_64M, fit_collective
    from autotp.profiling.sizes import REFINE_MISS, refinement_sizes

    sizes = list(SIZES_1K_TO_64M)
    jitter = {1 << 10: 1.3, 1 << 11: 0.7, 1 << 12: 1.3, 1 << 13: 0.7, 1 << 14: 1.3}  # latency-bound
    base = [(1e-4 + s / 1e9) * jitter.get(s, 1.0) for s in sizes]
    dip = [t * (0.8 if s == 1 << 23 else 1.0) for s, t in zip(sizes, base)]
    fitted = fit_collective("broadcast", 2, [TimedPoint(s, t) for s, t in zip(sizes, dip)])
    assert len(fitted.segments) == 1  # the dip alone does not buy a range
    worst = max(fitted.residuals, key=lambda e: abs(e.relative_error))
    assert worst.size_bytes < 1 << 15 and abs(worst.relative_error) > 0.2  # the largest miss is jitter
    added = refinement_sizes("broadcast", 2, sizes, dip)
    assert len(added) == 4 and 1 << 22 < added[0] < added[1] < 1 << 23 < added[2] < added[3] < 1 << 24
    assert refinement_sizes("broadcast", 2, sizes, base) == ()
    small = [t * (1 - REFINE_MISS / 2 if s == 1 << 23 else 1.0) for s, t in zip(sizes, base)]
    assert refinement_sizes("broadcast", 2, sizes, small) == ()


def test_a_refining_sweep_times_the_added_sizes_and_fits_them(tmp_path, monkeypatch):
    """One gloo rank, synthetic timings with a step between 16 and 32 MiB: after the first round
    the sweep adds sizes in that gap, times them in the remaining rounds, and marks them."""
    import torch.distributed as dist

    from autotp.profiling import sweep as sweep_mod
    from autotp.profiling.fit import fit_collective

    calls_timed = []

    def fake_blocks(call, iters, device, min_time_s=0.0, max_blocks=100_000):
        calls_timed.append((call.size_bytes, min_time_s))
        return _step_times([call.size_bytes], break_bytes=(2**24 + 2**25) // 2)

    monkeypatch.setattr(sweep_mod, "time_blocks", fake_blocks)
    monkeypatch.setattr(sweep_mod.collectives, "prepare", lambda kind, size, *a, **k: collectives.CollectiveCall(
        kind, size // 4, 0, 1, torch.zeros(1), torch.zeros(1), lambda: None))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        group = sweep_mod.AxisGroup(axis=mesh_axes((1,))[0], handle=None, ranks=(0,))
        sizes = size_sweep(2**20, 2**26, 2)
        planned = sweep_mod.planned_sizes(sizes, 1, held_out=True)
        steps = []
        timing = sweep_mod.Timing(iters=1, warmup_iters=0, min_time_s=0.3, rounds=3)
        points = sweep_mod.sweep_kind(
            group, "broadcast", [s for s, _ in planned], timing, rank=0, device=torch.device("cpu"), check=False,
            reduce_scatter_native=True, on_point=lambda step, *rest: steps.append(step),
            held_out=[h for _, h in planned], refine=True)
    finally:
        dist.destroy_process_group()
    refined = [p for p in points if p.refined]
    assert [p.size_bytes for p in refined] == [19951616, 28215808]  # 2^24.25 and 2^24.75, aligned
    assert not any(p.held_out for p in refined) and [p.size_bytes for p in points] == sorted(p.size_bytes for p in points)
    # timed in rounds 2 and 3 only, with the whole per-size time over those two rounds
    assert [t for s, t in calls_timed if s == 19951616] == [pytest.approx(0.15)] * 2
    assert [t for s, t in calls_timed if s == 2**20] == [pytest.approx(0.1)] * 3
    assert steps == list(range(1, len(steps) + 1))  # one step each, none twice
    unused = sweep_mod.MAX_REFINED - 2
    assert len(steps) == sweep_mod.steps_per_kind(len(planned), timing, refine=True) - unused * timing.rounds
    # the refined sizes join the fit and pin the step: the size range starts inside the gap
    fit = fit_collective("broadcast", 1, [TimedPoint(p.size_bytes, p.time_s) for p in points if not p.held_out])
    assert 2**24 < fit.segments[-1].from_bytes < 2**25


def test_no_refine_flag_turns_refinement_off_and_the_progress_reserves_room_for_it():
    from autotp.profiling.sizes import MAX_REFINED
    from autotp.profiling.sweep import Timing, total_steps

    assert command.config_from_args(_parser().parse_args([]), 2).refine is True
    config = command.config_from_args(_parser().parse_args(["--no-refine"]), 2)
    assert config.refine is False and type(config).from_json(config.to_json()) == config
    groups, sizes = _groups((2,)), size_sweep(1024, 2**26, 2)
    plain = total_steps(groups, 5, sizes, Timing(rounds=3), held_out=True)
    assert total_steps(groups, 5, sizes, Timing(rounds=3), held_out=True, refine=True) == plain + 5 * MAX_REFINED * 3
    assert total_steps(groups, 5, sizes, Timing(rounds=1), held_out=True, refine=True) == (17 + 16) * 2 * 5


def test_no_held_out_flag_turns_them_off():
    from autotp.profiling.sweep import Timing, total_steps

    assert command.config_from_args(_parser().parse_args([]), 2).held_out is True
    config = command.config_from_args(_parser().parse_args(["--no-held-out"]), 2)
    assert config.held_out is False
    assert type(config).from_json(config.to_json()) == config
    groups = _groups((2,))
    sizes = size_sweep(1024, 2**26, 2)
    timing = Timing(rounds=3)
    assert total_steps(groups, 5, sizes, timing, held_out=False) == 5 * 17 * 4
    assert total_steps(groups, 5, sizes, timing, held_out=True) == 5 * (17 + 16) * 4


def test_profile_json_keeps_held_out_measurements_and_errors():
    from autotp.profiling.config import ProfileConfig
    from autotp.profiling.hardware import RunInfo, fit_sweep, measurements_dict
    from autotp.profiling.sizes import held_out_sizes
    from autotp.profiling.sweep import SweepPoint

    sizes = size_sweep(2**18, 2**24, 2)
    held = held_out_sizes(sizes, 2)
    points = []
    for kind in collectives.KINDS:
        for s in sizes:
            points.append(SweepPoint(0, kind, 2, s, s // 4, 1e-4 + s / 1e9, 0, 30))
        for h in held:
            points.append(SweepPoint(0, kind, 2, h, h // 4, (1e-4 + h / 1e9) * 1.1, 0, 30, held_out=True))
    config = ProfileConfig("gloo", None, sizes[0], sizes[-1], 2, 10, 3, True, 60.0, None, 0.2, 3)
    info = RunInfo("gloo", 2, 2, (2,), ("host",), "native")

    class Device:
        def to_dict(self):
            return {}

    fits = fit_sweep(points)
    m = json.loads(json.dumps(measurements_dict(config, info, _groups((2,)), points, fits, {"intra_node": 0}, Device())))
    axis = m["axes"]["axis0"]
    for kind in collectives.KINDS:
        assert [p["size_bytes"] for p in axis["sweep"][kind]] == list(sizes)
        assert [p["size_bytes"] for p in axis["held_out_sweep"][kind]] == list(held)
        fit = axis["fit"][kind]
        big = [h for h in held if h >= 2**20]
        assert [e["size_bytes"] for e in fit["held_out"]] == big
        # measured 10% slower than the line the fit sizes lie on: predicted / measured - 1 = 1/1.1 - 1
        assert all(e["relative_error"] == pytest.approx(1 / 1.1 - 1, abs=1e-6) for e in fit["held_out"])
        assert [e["size_bytes"] for e in fit["leave_one_out"]] == [s for s in sizes if s >= 2**20]
        assert fit["segments"][0]["latency_s"] == pytest.approx(1e-4)  # fitted on the fit sizes only
    assert m["held_out_summary"] == {"tolerance": 0.25, "within": 5 * len(big), "of": 5 * len(big),
                                     "worst": pytest.approx(1 - 1 / 1.1)}
    assert m["leave_one_out_summary"]["of"] == 5 * 5 and "midpoints" in m["held_out"]


# --- device --------------------------------------------------------------------------------------


def test_device_curves_measure_what_they_say():
    from cost_models import DeviceSpec
    from autotp.profiling import device as dev

    cpu = torch.device("cpu")
    flops, rate = dev.measure_matmul_training("float32", 32, cpu, min_time_s=0.001)
    assert flops == 8 * 32**3 and rate > 0  # (32 x 32) tokens x in, 128 out: 2 * 32 * 32 * 128 per product
    moved, bw = dev.measure_memory_curve_point(4096, cpu, ring_bytes=1 << 16, min_time_s=0.001)
    assert moved == 3 * 4096 and bw > 0  # a + b: two operands read, one output written
    m = dev.measure_device(cpu, matmul_sizes=(32,), copy_bytes=1 << 16, min_time_s=0.001,
                           matmul_curve_sizes=(32, 16), memory_curve_bytes=(1 << 14, 1 << 12), ring_bytes=1 << 16,
                           overlap_bytes=1 << 16, dtypes=("float32", "bfloat16"))
    assert 0.0 <= m.memory_overlap <= 1.0
    assert sorted(m.matmul_curve) == ["bfloat16", "float32"]
    assert [f for f, _ in m.matmul_curve["float32"]] == [8 * 16**3, 8 * 32**3]  # sizes rising
    assert [b for b, _ in m.memory_curve] == [3 * 2**12, 3 * 2**14]
    d = m.to_dict()
    spec = DeviceSpec.from_dict({"peak_flops": d["peak_flops"], "memory_bytes": d["memory_bytes"],
                                 "memory_bandwidth_bytes_per_s": d["memory_bandwidth_bytes_per_s"],
                                 "kernel_overhead_s": d["kernel_overhead_s"],
                                 "matmul_curve": d["matmul_curve"], "memory_curve": d["memory_curve"],
                                 "memory_overlap": d["memory_overlap"]})
    assert spec.memory_overlap == m.memory_overlap
    assert spec.memory_curve == m.memory_curve and spec.matmul_curve["float32"] == m.matmul_curve["float32"]


def test_slowest_rank_takes_each_curve_point_from_the_slowest_rank(monkeypatch):
    import dataclasses

    import torch.distributed as dist

    from autotp.profiling.device import DeviceMeasurement, slowest_rank

    mine = DeviceMeasurement("cpu", "cpu", 1, {"float32": 2e11}, 1e10, 2**30, 3e-6,
                             matmul_curve={"float32": ((1e6, 1e11), (1e9, 2e11))},
                             memory_curve=((3e6, 9e9), (3e8, 5e9)), memory_overlap=0.6)
    other = dataclasses.replace(mine, peak_flops={"float32": 1.5e11}, memory_bandwidth_bytes_per_s=2e10,
                                matmul_curve={"float32": ((1e6, 1.2e11), (1e9, 1.5e11))},
                                memory_curve=((3e6, 8e9), (3e8, 6e9)), memory_overlap=0.2)

    def all_gather_object(out, obj):
        out[:] = [obj, other]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    slow = slowest_rank(mine, 2)
    assert slow.peak_flops == {"float32": 1.5e11} and slow.memory_bandwidth_bytes_per_s == 1e10
    assert slow.matmul_curve == {"float32": ((1e6, 1e11), (1e9, 1.5e11))}
    assert slow.memory_curve == ((3e6, 8e9), (3e8, 5e9))
    assert slow.memory_overlap == 0.2  # the least overlap: the slowest kernels


# --- device: dtypes, emulation, time budget ------------------------------------------------------


def test_dtypes_option_always_measures_float32_and_reaches_the_config():
    from autotp.profiling.config import ProfileConfig
    from autotp.profiling.dtypes import parse_dtypes

    assert parse_dtypes("bfloat16") == ("float32", "bfloat16")
    assert parse_dtypes(" BF16, fp32 ,torch.float16,bf16") == ("float32", "bfloat16", "float16")
    args = _parser().parse_args(["--dtypes", "float32,bfloat16", "--device-budget-s", "2.5"])
    config = command.config_from_args(args, 2)
    assert config.dtypes == ("float32", "bfloat16") and config.device_budget_s == 2.5
    assert ProfileConfig.from_json(config.to_json()) == config  # what the launcher hands every rank
    default = command.config_from_args(_parser().parse_args([]), 2)
    assert default.dtypes is None and default.device_budget_s is None  # chosen on the device
    with pytest.raises(ValueError, match=r"unknown dtype 'double'"):
        parse_dtypes("float32,double")


def _fake_rates(monkeypatch, rates: dict[str, float], calls: list | None = None):
    """``device.measure_matmul`` reporting ``rates[dtype]`` FLOP/s (and the curve likewise), instantly."""
    from autotp.profiling import device as dev

    def measure_matmul(dtype, n, device, min_time_s=0.2):
        if calls is not None:
            calls.append((dtype, n))
        return dev.MatmulMeasurement(dtype, n, 2.0 * n**3 / rates[dtype], rates[dtype])

    monkeypatch.setattr(dev, "measure_matmul", measure_matmul)
    monkeypatch.setattr(dev, "measure_matmul_training",
                        lambda dtype, n, *a, **k: (8.0 * n**3, rates[dtype] / 2))


@pytest.mark.parametrize("bf16_ratio, emulated", [(0.2, True), (0.3, False), (1.5, False)])
def test_a_dtype_under_a_quarter_of_float32s_rate_is_marked_emulated_in_the_profile(monkeypatch, bf16_ratio, emulated):
    from cost_models import HardwareProfile
    from autotp.profiling import device as dev
    from autotp.profiling.dtypes import EMULATED_BELOW, choose_dtypes
    from autotp.profiling.hardware import device_spec

    assert EMULATED_BELOW == 0.25
    calls = []
    _fake_rates(monkeypatch, {"float32": 1e11, "bfloat16": bf16_ratio * 1e11, "float16": 1e9}, calls)
    cpu = torch.device("cpu")
    probes = dev.probe_dtypes(cpu, ("bfloat16", "float16"))
    assert calls == [("float32", 256), ("bfloat16", 256), ("float16", 256)]  # all at the same small n
    assert [(p.dtype, p.emulated) for p in probes] == [("float32", False), ("bfloat16", emulated), ("float16", True)]
    # default: float32, bfloat16 always (marked if emulated), float16 only where native: left out, said so
    choice = choose_dtypes(None, probes)
    assert choice.measured == ("float32", "bfloat16") and choice.skipped == ("float16",)
    assert choice.emulated == (("bfloat16",) if emulated else ())
    notes = "\n".join(choice.notes(probes))
    assert "float16 is emulated" in notes and "not measured" in notes
    assert ("bfloat16 is emulated" in notes) == emulated
    # asked for explicitly, an emulated dtype is measured and marked
    assert choose_dtypes(("float32", "float16"), probes).emulated == ("float16",)
    assert choose_dtypes(("float32", "float16"), probes).skipped == ()

    m = dev.measure_device(cpu, copy_bytes=1 << 16, min_time_s=0.001, memory_curve_bytes=(1 << 12,),
                           ring_bytes=1 << 16, overlap_bytes=1 << 16, budget_s=5.0)
    assert sorted(m.peak_flops) == ["bfloat16", "float32"] and m.skipped_dtypes == ("float16",)
    assert m.peak_flops["bfloat16"] == bf16_ratio * 1e11
    spec = device_spec(m).to_dict()
    assert spec.get("emulated_dtypes") == (["bfloat16"] if emulated else None)
    raw = json.loads(json.dumps(m.to_dict()))
    assert raw["emulated_dtypes"] == (["bfloat16"] if emulated else []) and raw["skipped_dtypes"] == ["float16"]
    assert [p["ratio"] for p in raw["dtype_probes"]] == pytest.approx([1.0, bf16_ratio, 0.01])
    assert raw["reach"]["bfloat16"]["emulated"] == emulated and raw["reach"]["float32"]["matmul_n"] == 2048
    profile = HardwareProfile.from_json(json.dumps(
        {**HardwareProfile.from_dict(_profile_dict()).to_dict(), "device": spec}))
    assert profile.device.emulated_dtypes == (("bfloat16",) if emulated else ())


@pytest.fixture
def one_thread():
    """One torch thread, as a rank on a shared host has: steadier small products."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_budget_stops_growing_n_on_a_slow_dtype_and_records_the_size_reached(monkeypatch, one_thread):
    """bfloat16 products that take 5 ms at n=64 and 8x more per doubling, a 1 s budget: the
    peak sizes stop at 128 (256 would take ~1 s), the curve's ring is shortened and it stops at 64."""
    from autotp.profiling import device as dev
    from autotp.profiling.dtypes import DtypeProbe

    real_mm = torch.mm

    def slow_mm(a, b):
        if a.dtype == torch.bfloat16:
            time.sleep(0.005 * (a.shape[0] / 64) ** 3)
        return real_mm(a, b)

    curve_calls = []

    def slow_training(dtype, n, device, min_time_s=0.2, ring_bytes=64 << 20, max_sets=None):
        sets = min(dev._ring_sets(dtype, n, ring_bytes), max_sets)
        rate = 1e8 if dtype == "bfloat16" else 1e11
        time.sleep(3 * sets * 3 * 8.0 * n**3 / rate)  # a warm-up pass and two timed ones
        curve_calls.append((dtype, n, sets, dev._ring_sets(dtype, n, ring_bytes)))
        return 8.0 * n**3, rate

    monkeypatch.setattr(torch, "mm", slow_mm)
    monkeypatch.setattr(dev, "measure_matmul_training", slow_training)
    progress, reached = [], []
    probes = (DtypeProbe("float32", 64, 1e11, 1e11), DtypeProbe("bfloat16", 64, 1e8, 1e11))
    m = dev.measure_device(torch.device("cpu"), matmul_sizes=(64, 128, 256, 512), matmul_curve_sizes=(32, 64, 128, 256),
                           copy_bytes=1 << 16, min_time_s=0.0, memory_curve_bytes=(1 << 12,), ring_bytes=1 << 22,
                           overlap_bytes=1 << 16, dtypes=("float32", "bfloat16"), budget_s=1.0, probes=probes,
                           on_progress=progress.append, on_dtype=reached.append)
    fp32, bf16 = m.reach
    assert reached == [fp32, bf16] and bf16.emulated and m.emulated_dtypes == ("bfloat16",)
    assert (fp32.matmul_n, fp32.curve_n, fp32.cut) == (512, 256, False)  # a fast dtype: every size
    assert (bf16.matmul_n, bf16.curve_n, bf16.cut) == (128, 64, True)
    assert bf16.spent_s < bf16.budget_s == 1.0
    assert [w for w in progress if w.startswith("bfloat16")] == [
        "bfloat16 matmul n=64", "bfloat16 matmul n=128", "bfloat16 matmul curve n=32", "bfloat16 matmul curve n=64"]
    assert [mm.n for mm in m.matmuls if mm.dtype == "bfloat16"] == [64, 128]
    assert [f for f, _ in m.matmul_curve["bfloat16"]] == [8.0 * 32**3, 8.0 * 64**3]
    first = next(c for c in curve_calls if c[0] == "bfloat16")
    assert first[2] < first[3]  # fewer operand sets than the ring holds: one pass fits the budget
    assert progress[-3:] == ["memory curve 4096 B", "memory bandwidth, kernel overhead", "memory overlap"]


def test_the_worker_beats_the_heartbeat_at_each_measured_size_and_prints_a_line_per_dtype(monkeypatch, capsys):
    import torch.distributed as dist

    from autotp.profiling import device as dev
    from autotp.profiling import worker
    from autotp.profiling.config import ProfileConfig

    _fake_rates(monkeypatch, {"float32": 1e11, "bfloat16": 2e10, "float16": 2e11})
    monkeypatch.setattr(dev, "measure_memory_curve_point", lambda size, *a, **k: (3.0 * size, 1e10))
    monkeypatch.setattr(dev, "measure_memory_bandwidth", lambda *a, **k: 1e10)
    monkeypatch.setattr(dev, "measure_kernel_overhead", lambda *a, **k: 1e-6)
    monkeypatch.setattr(dev, "measure_memory_overlap", lambda *a, **k: 0.5)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj]))

    class Beats:
        def __init__(self):
            self.beats = []

        def beat(self, step, where):
            self.beats.append((step, where))

    heartbeat = Beats()
    config = ProfileConfig("gloo", None, 1024, 2048, 2, 1, 0, False, 60.0, None, device_budget_s=100.0)
    m = worker._measure_device(config, True, 1, torch.device("cpu"), heartbeat, first_step=7)
    steps = [s for s, _ in heartbeat.beats]
    assert steps[0] == 7 and steps == sorted(set(steps))  # a new step each time: the watchdog sees progress
    assert heartbeat.beats[-1] == (7 + worker.DEVICE_STEPS, "measured the device; waiting for the other ranks")
    wheres = [w for _, w in heartbeat.beats]
    assert "measuring the device: bfloat16 matmul n=2048" in wheres
    assert "measuring the device: float16 matmul curve n=1024" in wheres  # native here: measured by default
    assert sum(w.startswith("measuring the device: ") and " n=" in w for w in wheres) == 3 + 3 * (4 + 4)
    err = capsys.readouterr().err
    assert [line.split(" (")[0] for line in err.splitlines() if line.startswith("device: ")] == [
        "device: float32", "device: bfloat16", "device: float16"]
    assert "note: bfloat16 is emulated" in err and "note: float16 runs natively" in err
    assert m.emulated_dtypes == ("bfloat16",) and m.skipped_dtypes == ()
    assert [r.budget_s for r in m.reach] == [100.0] * 3 and not any(r.cut for r in m.reach)  # --device-budget-s


def test_one_rank_measures_the_device_alone_and_borrows_the_links_of_its_builtin_profile(monkeypatch, tmp_path, capsys):
    """World size 1 (one GPU, or --nproc 1): no collective is timed; the profile holds the device as
    measured and the links of the device's built-in profile (here the CPU's, cpu-gloo)."""
    import torch.distributed as dist

    from cost_models import load_profile
    from autotp.profiling import device as dev
    from autotp.profiling import worker
    from autotp.profiling.config import ProfileConfig

    _fake_rates(monkeypatch, {"float32": 1e11, "bfloat16": 4e11, "float16": 4e11})
    monkeypatch.setattr(dev, "measure_memory_curve_point", lambda size, *a, **k: (3.0 * size, 1e10))
    monkeypatch.setattr(dev, "measure_memory_bandwidth", lambda *a, **k: 2e10)
    monkeypatch.setattr(dev, "measure_kernel_overhead", lambda *a, **k: 1e-6)
    monkeypatch.setattr(dev, "measure_memory_overlap", lambda *a, **k: 0.5)

    def no_collectives(*a, **k):
        raise AssertionError("one rank has no collective to time")

    monkeypatch.setattr(worker, "sweep", no_collectives)
    monkeypatch.setattr(worker.collectives, "probe_reduce_scatter", no_collectives)

    class Beats:
        def beat(self, step, where):
            pass

    out = tmp_path / "one.json"
    config = ProfileConfig("gloo", None, 1024, 2048, 2, 1, 0, False, 60.0, str(out), device_budget_s=100.0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        code = worker._profile(config, 0, 1, 1, (1,), torch.device("cpu"), Beats())
    finally:
        dist.destroy_process_group()
    assert code == 0
    text = capsys.readouterr().out
    assert "world size 1: the device alone, no collectives to time" in text
    assert "taken from the built-in profile cpu-gloo" in text
    profile = load_profile(out)
    assert profile.device.peak_flops == {"float32": 1e11, "bfloat16": 4e11, "float16": 4e11}
    assert profile.device.memory_bandwidth_bytes_per_s == 2e10 and profile.device.kernel_overhead_s == 1e-6
    assert profile.links == load_profile("cpu-gloo").links and profile.devices_per_node == 1
    assert profile.measurements["world_size"] == 1 and profile.measurements["links_from"] == "cpu-gloo"
    assert "intra_node and inter_node are the built-in profile cpu-gloo's" in profile.source


def test_a_gpu_host_starts_one_rank_per_gpu_and_a_cpu_host_two(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = _parser().parse_args([])
    assert command._nproc(args) == 1 and command.config_from_args(args, 1).backend == "nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert command._nproc(args) == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert command._nproc(args) == 2 and command.config_from_args(args, 2).backend == "gloo"
    assert command._nproc(_parser().parse_args(["--nproc", "1"])) == 1


def test_the_links_of_a_one_device_profile_follow_the_device(monkeypatch):
    from cost_models import load_profile
    from autotp.profiling.device import DeviceMeasurement
    from autotp.profiling.hardware import borrowed_links

    def measured(device_type, name):
        return DeviceMeasurement(device_type, name, 1, {"float32": 1e12}, 1e11, 2**30, 1e-6)

    assert borrowed_links(measured("cuda", "NVIDIA H200"))[0] == "h200"
    name, links = borrowed_links(measured("cuda", "NVIDIA GH200 480GB"))  # no profile: the stated fallback
    assert name == "h100-sxm" and links == dict(load_profile("h100-sxm").links)


def test_slowest_rank_keeps_what_every_rank_measured_and_marks_what_any_found_emulated():
    import dataclasses

    from autotp.profiling.device import DeviceMeasurement, DtypeReach, slowest
    from autotp.profiling.dtypes import DtypeProbe

    a = DeviceMeasurement("cpu", "cpu", 1, {"float32": 2e11, "bfloat16": 4e11}, 1e10, 2**30, 3e-6,
                          matmul_curve={"float32": ((1e6, 1e11),), "bfloat16": ((1e6, 2e11),)},
                          memory_curve=((3e6, 9e9),), memory_overlap=0.5,
                          probes=(DtypeProbe("float32", 256, 2e11, 2e11), DtypeProbe("bfloat16", 256, 4e11, 2e11)),
                          reach=(DtypeReach("float32", 8.0, 3.0, 2048, 1024, False),
                                 DtypeReach("bfloat16", 8.0, 2.0, 2048, 1024, False)))
    b = dataclasses.replace(a, peak_flops={"float32": 2e11, "bfloat16": 4e9}, emulated_dtypes=("bfloat16",),
                            probes=(DtypeProbe("float32", 256, 2e11, 2e11), DtypeProbe("bfloat16", 256, 4e9, 2e11)),
                            reach=(DtypeReach("float32", 8.0, 3.5, 2048, 1024, False),
                                   DtypeReach("bfloat16", 8.0, 7.0, 512, 256, True, True)))
    slow = slowest([a, b])
    assert slow.emulated_dtypes == ("bfloat16",) and slow.peak_flops["bfloat16"] == 4e9
    assert [p.emulated for p in slow.probes] == [False, True]
    assert slow.reach[1] == DtypeReach("bfloat16", 8.0, 7.0, 512, 256, True, True)
    assert slow.reach[0].spent_s == 3.5


def _profile_dict() -> dict:
    from cost_models import load_profile

    return load_profile("cpu-gloo").to_dict()


def test_emulated_dtypes_round_trip_and_bad_values_name_the_field():
    from cost_models import HardwareProfile, ProfileError

    d = _profile_dict()
    assert "emulated_dtypes" not in d["device"]  # optional: absent from profiles without it
    d["device"]["emulated_dtypes"] = ["bfloat16"]
    profile = HardwareProfile.from_dict(d)
    assert profile.device.emulated_dtypes == ("bfloat16",)
    assert json.loads(profile.to_json())["device"]["emulated_dtypes"] == ["bfloat16"]
    assert HardwareProfile.from_json(profile.to_json()) == profile
    for bad, message in (("bfloat16", "device.emulated_dtypes: expected a list of dtype names, got 'bfloat16'"),
                         (["int4"], "device.emulated_dtypes[0]: 'int4' has no peak_flops figure"),
                         (["bfloat16", "bfloat16"], "device.emulated_dtypes[1]: 'bfloat16' is listed twice"),
                         (["torch.bfloat16"], "device.emulated_dtypes[0]: expected a dtype name")):
        d["device"]["emulated_dtypes"] = bad
        with pytest.raises(ProfileError) as exc:
            HardwareProfile.from_dict(d)
        assert str(exc.value).startswith(message), str(exc.value)


# the default run takes the capability furthest from the host's (most of the time is importing torch);
# the same path under another capability is in the slow suite
@pytest.mark.parametrize("capability", ["default", pytest.param("avx2", marks=pytest.mark.slow)])
def test_the_probe_measures_under_aten_cpu_capability(capability):
    """PyTorch honours ATEN_CPU_CAPABILITY; the probe times what runs, so it needs no CPU flags."""
    code = ("import json, torch; from autotp.profiling.device import probe_dtypes; "
            "torch.set_num_threads(1); "
            "probes = probe_dtypes(torch.device('cpu'), ('bfloat16',), min_time_s=0.01); "
            "print(json.dumps([torch.backends.cpu.get_cpu_capability(), [p.to_dict() for p in probes]]))")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability,
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    used, probes = json.loads(proc.stdout)
    assert used == "DEFAULT" if capability == "default" else "AVX512" not in used
    assert [p["dtype"] for p in probes] == ["float32", "bfloat16"] and all(p["flops_per_s"] > 0 for p in probes)
    assert probes[1]["emulated"] == (probes[1]["flops_per_s"] < 0.25 * probes[1]["float32_flops_per_s"])


# --- links, fault hook ---------------------------------------------------------------------------


def _groups(shape):
    from autotp.profiling.sweep import AxisGroup

    return [AxisGroup(axis=a, handle=None, ranks=a.groups[0]) for a in mesh_axes(shape)]


def test_axes_map_to_links_by_where_their_groups_live():
    from autotp.profiling.hardware import axis_links

    # 2 hosts of 4 ranks, mesh 2x4: axis 1 (rows) stays on a host, axis 0 (columns) spans both.
    links, note = axis_links(_groups((2, 4)), ["a"] * 4 + ["b"] * 4)
    assert links == {"intra_node": 1, "inter_node": 0}
    # One host: both links take the largest axis, and the note says no inter-node link was measured.
    links, note = axis_links(_groups((2, 4)), ["a"] * 8)
    assert links == {"intra_node": 1, "inter_node": 1} and "no inter-node link" in note
    # Every axis spans hosts (one rank per host): intra_node is copied, and said to be.
    links, note = axis_links(_groups((4,)), ["a", "b", "c", "d"])
    assert links == {"intra_node": 0, "inter_node": 0} and "intra_node not measured" in note


def test_fault_hook_parses_and_rejects():
    from autotp.profiling.heartbeat import Fault

    assert Fault.parse("hang:1") == Fault("hang", 1, 1)
    assert Fault.parse("die:2:5") == Fault("die", 2, 5)
    assert Fault.parse("corrupt:1").corrupts(1) and not Fault.parse("corrupt:1").corrupts(0)
    with pytest.raises(ValueError, match="AUTOTP_PROFILE_FAULT"):
        Fault.parse("explode:1")


# --- real runs (2 gloo processes) ----------------------------------------------------------------


def _profile(args: list[str], tmp_path: Path, fault: str | None = None, timeout_s: float = 120):
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("AUTOTP_PROFILE_FAULT", None)
    if fault:
        env["AUTOTP_PROFILE_FAULT"] = fault
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "autotp.cli", "profile", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return proc, time.monotonic() - start


def _table_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line and not line.startswith("#")]


@pytest.mark.slow  # 2 processes; the default suite measures one rank in process and launches ranks that fail
def test_two_process_sweep_writes_table_and_loadable_profile(tmp_path):
    from cost_models import HardwareProfile

    out = tmp_path / "profile.json"
    proc, _ = _profile(["--nproc", "2", *TINY, "--check", "--device-budget-s", "2", "-o", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # nccl-tests style tables: one per kind, 7 fit sizes and 6 held-out sizes (marked *) each,
    # interleaved, every row checked and right.
    assert proc.stdout.count("#       size         count      type     time   algbw   busbw #wrong") == 5
    assert proc.stdout.count("# Avg bus bandwidth") == 5
    assert proc.stdout.count("# * held-out size: timed in the same rounds, never used by the fit") == 5
    rows = _table_rows(proc.stdout)
    assert len(rows) == 5 * 13
    assert [row[-1] == "*" for row in rows[:13]] == [False, True] * 6 + [False]
    for size, count, dtype, time_us, algbw, busbw, wrong, *mark in rows:
        assert int(count) * 4 == int(size) and dtype == "float"
        assert float(time_us) > 0 and wrong == "0" and mark in ([], ["*"])
    assert "# Check: 0 wrong elements in total: OK" in proc.stdout
    assert "reduce_scatter" in proc.stderr and "all_reduce" in proc.stderr  # the gloo warning

    profile = HardwareProfile.from_json(out.read_text())
    for link in ("intra_node", "inter_node"):
        costs = profile.links[link].costs
        assert sorted(costs) == sorted(collectives.KINDS)
        for kind in collectives.KINDS:
            assert costs[kind].latency_s >= 0 and costs[kind].bus_bandwidth_bytes_per_s > 0
    assert profile.devices_per_node == 2
    # the device: float32 and bfloat16 always (bfloat16 marked where the probe found it emulated, as on
    # a CPU without AVX-512-BF16), float16 where native; each dtype's sizes grown within its budget
    dev = json.loads(out.read_text())["measurements"]["device"]
    probes = {p["dtype"]: p for p in dev["dtype_probes"]}
    assert sorted(probes) == ["bfloat16", "float16", "float32"]
    measured = ["float32", "bfloat16"] + (["float16"] if not probes["float16"]["emulated"] else [])
    assert list(profile.device.peak_flops) == measured and sorted(profile.device.matmul_curve) == sorted(measured)
    assert profile.device.emulated_dtypes == tuple(d for d in measured if probes[d]["emulated"])
    assert all(p["emulated"] == (p["ratio"] < 0.25) for p in probes.values())
    for dtype in measured:
        reach = dev["reach"][dtype]
        assert reach["budget_s"] == 2 and reach["matmul_n"] >= 256 and reach["curve_n"] >= 128
        assert reach["emulated"] == probes[dtype]["emulated"]
        assert f"device: {dtype} (" in proc.stderr  # a line per dtype
    assert ("note: bfloat16 is emulated" in proc.stderr) == probes["bfloat16"]["emulated"]
    assert profile.device.memory_bandwidth_bytes_per_s > 0 and profile.device.kernel_overhead_s > 0
    assert all(rate > 0 for points in profile.device.matmul_curve.values() for _, rate in points)
    assert [size for size, _ in profile.device.memory_curve] == [3 * 2**18, 3 * 2**21, 3 * 2**24, 3 * 2**27]
    assert 0.0 <= profile.device.memory_overlap <= 1.0
    assert "# Device curves: matmul TFLOP/s by size: float32 " in proc.stdout

    m = json.loads(out.read_text())["measurements"]
    assert m["backend"] == "gloo" and m["world_size"] == 2 and m["mesh"] == [2]
    assert m["torch_version"] == torch.__version__ and m["wrong"] == 0
    sweep = m["axes"]["axis0"]["sweep"]["all_reduce"]
    assert [p["size_bytes"] for p in sweep] == [1024 * 2**k for k in range(7)]
    assert all(p["time_s"] > 0 for p in sweep)
    held = m["axes"]["axis0"]["held_out_sweep"]["all_reduce"]
    assert [p["size_bytes"] for p in held] == [1408, 2944, 5760, 11648, 23168, 46336]  # ~1.41x, shards whole cache lines
    assert all(p["time_s"] > 0 for p in held) and "midpoints" in m["held_out"]
    # All below 1 MiB: measured and kept, but no error is reported on them; nor leave-one-out.
    assert m["axes"]["axis0"]["fit"]["all_reduce"]["held_out"] == [] and "held_out_summary" not in m
    # The profile's figures are the fit of exactly these points.
    fit = fit_collective("all_reduce", 2, [TimedPoint(p["size_bytes"], p["time_s"]) for p in sweep])
    cost = profile.links["intra_node"].costs["all_reduce"]
    assert cost.latency_s == pytest.approx(fit.latency_s)
    assert [s.from_bytes for s in cost.segments] == [s.from_bytes for s in fit.segments[1:]]
    assert m["axes"]["axis0"]["fit"]["all_reduce"]["segments"][0]["from_bytes"] == 0


@pytest.mark.slow  # the refinement itself is tested in one process above
def test_two_ranks_refine_in_step_and_write_the_added_sizes_as_fit_points(tmp_path):
    """With two rounds the ranks fit after the first and may add sizes: they must agree on them
    (or the run would hang or fail), and every added size joins the fit and the JSON."""
    out = tmp_path / "p.json"
    args = ["--backend", "gloo", "-b", "1K", "-e", "1M", "-n", "3", "-w", "1", "--min-time-s", "0", "--rounds", "2"]
    device_args = ["--dtypes", "bf16", "--device-budget-s", "1"]
    proc, _ = _profile(["--nproc", "2", *args, *device_args, "--check", "-o", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = json.loads(out.read_text())["measurements"]
    assert list(m["device"]["peak_flops"]) == ["float32", "bfloat16"] and m["device"]["skipped_dtypes"] == []
    assert [p["dtype"] for p in m["device"]["dtype_probes"]] == ["float32", "bfloat16"]  # only what was asked
    assert "quarter" in m["refine"]
    rows = _table_rows(proc.stdout)
    assert rows and all(row[6] == "0" for row in rows)  # checked and right, added sizes too
    total_added = 0
    for kind in collectives.KINDS:
        sweep = m["axes"]["axis0"]["sweep"][kind]
        grid = [p["size_bytes"] for p in sweep if not p.get("refined")]
        added = [p["size_bytes"] for p in sweep if p.get("refined")]
        assert grid == [1024 * 2**k for k in range(11)] and len(added) <= MAX_REFINED
        held = {p["size_bytes"] for p in m["axes"]["axis0"]["held_out_sweep"][kind]}
        assert not set(added) & (held | set(grid))
        total_added += len(added)
        fit = fit_collective(kind, 2, [TimedPoint(p["size_bytes"], p["time_s"]) for p in sweep])
        assert [s["from_bytes"] for s in m["axes"]["axis0"]["fit"][kind]["segments"]] == [
            s.from_bytes for s in fit.segments]  # the added sizes are fitted with the grid
    assert sum(row[-1] == "+" for row in rows) == total_added


@pytest.mark.slow
def test_check_failure_is_reported_and_sets_exit_code_1(tmp_path):
    out = tmp_path / "p.json"
    args = ["--nproc", "2", "--backend", "gloo", "-b", "1K", "-e", "2K", "-n", "2", "-w", "0", "--min-time-s", "0", "--rounds", "1"]
    proc, _ = _profile([*args, "--check", "-o", str(out)], tmp_path, fault="corrupt:1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    wrong = [int(row[6]) for row in _table_rows(proc.stdout)]
    assert len(wrong) == 5 * 3 and sum(wrong) > 0  # 1 KiB, 1408 B (held out), 2 KiB
    assert "FAILED" in proc.stdout


@pytest.mark.parametrize(
    "fault, expected_message",
    [  # a hang takes the watchdog's 6 s to be seen: slow; a death, the same watchdog, is seen at once
        pytest.param("hang:1", "rank 1 hung: no progress for 6 s", marks=pytest.mark.slow),
        ("die:1", "rank 1 exited with code 17"),
    ],
)
def test_a_rank_that_hangs_or_dies_ends_the_run_with_its_name(fault, expected_message, tmp_path):
    timeout_s = 6
    proc, elapsed_s = _profile(
        ["--nproc", "2", *TINY, "--timeout-s", str(timeout_s), "-o", str(tmp_path / "p.json")],
        tmp_path,
        fault=fault,
        timeout_s=90,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected_message in proc.stderr, proc.stderr
    assert "autotp profile: error:" in proc.stderr
    assert elapsed_s < timeout_s + 40  # startup (imports) plus the timeout, never a hang
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_under_torchrun_uses_the_group_it_is_given(tmp_path):
    out = tmp_path / "p.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("AUTOTP_PROFILE_FAULT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "autotp.cli", "profile", *TINY, "--mesh", "2", "--no-held-out", "-o", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = json.loads(out.read_text())["measurements"]
    assert m["world_size"] == 2
    # --no-held-out: only the fit sizes are timed
    assert len(_table_rows(proc.stdout)) == 5 * 7 and "held-out size" not in proc.stdout
    assert m["held_out"] is None and all(v == [] for v in m["axes"]["axis0"]["held_out_sweep"].values())
