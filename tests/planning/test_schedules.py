"""Pipeline schedules (autotp/planning/search/schedules.py): orders per rank, and the step they take,
checked against spans and held activations worked out by hand."""

import random

import pytest

from autotp.planning.search.schedules import held_bytes, orders, simulate, timeline


def test_one_f_one_b_by_hand():
    """2 stages, 4 micro-batches, forward 1 s, backward 2 s, instant sends: the first forward reaches
    the last stage at 1 s; the step is the stages' sum plus (m - 1) of the slowest, 3 + 3 + 3 * 3."""
    t = simulate(orders("1f1b", 2, 4), [1, 1], [2, 2], [0.0], [10.0, 10.0])
    assert t.span_s == 15.0
    assert t.busy_s == (12.0, 12.0)
    assert t.in_flight == (2, 1)  # rank r holds pp - r micro-batches' activations
    assert t.peak_activation_bytes == (20.0, 10.0)
    g = simulate(orders("gpipe", 2, 4), [1, 1], [2, 2], [0.0], [10.0, 10.0])
    assert g.span_s == 15.0 and g.in_flight == (4, 4)  # the same bubble; every micro-batch held


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (4, 3), (8, 16)])
def test_the_bubble_of_gpipe_and_1f1b_is_pp_minus_one_stage_times(pp, m):
    for schedule in ("gpipe", "1f1b"):
        t = simulate(orders(schedule, pp, m), [1.0] * pp, [2.0] * pp, [0.0] * (pp - 1))
        assert t.span_s == pytest.approx((m + pp - 1) * 3.0)
        assert t.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


def test_a_send_waits_on_the_link_each_way():
    """Each cut adds its send to the forward's way down and the gradient's way back."""
    t = simulate(orders("1f1b", 2, 1), [1, 1], [2, 2], [0.5])
    assert t.span_s == 1 + 0.5 + 1 + 2 + 0.5 + 2


def test_interleaving_divides_the_bubble_by_the_stages_per_rank_and_holds_more():
    pp, m = 4, 8
    plain = simulate(orders("1f1b", pp, m), [1.0] * pp, [2.0] * pp, [0.0] * (pp - 1), [1.0] * pp)
    for v in (2, 4):
        s = pp * v  # each stage a v-th of the work
        t = simulate(orders("interleaved_1f1b", pp, m, v), [1 / v] * s, [2 / v] * s, [0.0] * (s - 1), [1 / v] * s)
        assert t.span_s == pytest.approx(m * 3.0 + (pp - 1) * 3.0 / v)
        # Megatron-LM's figure: the first rank holds pp * (1 + (pp - 1) / (pp * v)) micro-batches' worth
        assert t.peak_activation_bytes[0] == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))
        assert t.peak_activation_bytes[0] > plain.peak_activation_bytes[0]


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)])
def test_every_rank_runs_each_of_its_stages_work_once_forward_first(schedule, v):
    pp, m = 3, 6
    for r, acts in enumerate(orders(schedule, pp, m, v)):
        mine = {s for s in range(pp * v) if s % pp == r}
        expected = {(k, s, i) for k in "FB" for s in mine for i in range(m)}
        assert sorted((a.kind, a.stage, a.micro_batch) for a in acts) == sorted(expected)
        seen = set()
        for a in acts:
            assert a.kind == "F" or ("F", a.stage, a.micro_batch) in seen
            seen.add((a.kind, a.stage, a.micro_batch))


def test_many_micro_batches_follow_the_replayed_line():
    """``timeline`` replays 2 * 4 * pp micro-batches at most and carries on along the line: within
    1% of replaying them all, on uneven stages and sends; held activations exact."""
    rng = random.Random(0)
    for _ in range(25):
        schedule, v = rng.choice([("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
        pp = rng.choice([2, 4])
        s = pp * v
        m = pp * rng.randint(9, 30)
        f = [rng.uniform(0.5, 2) for _ in range(s)]
        b = [2 * x * rng.uniform(0.8, 1.2) for x in f]
        sends = [rng.uniform(0, 0.3) for _ in range(s - 1)]
        act = [rng.uniform(1, 3) for _ in range(s)]
        full = simulate(orders(schedule, pp, m, v), f, b, sends, act)
        fast = timeline(schedule, pp, m, v, f, b, sends, act)
        assert fast.span_s == pytest.approx(full.span_s, rel=1e-2)
        assert fast.peak_activation_bytes == pytest.approx(full.peak_activation_bytes)


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="expected one of"):
        orders("zero_bubble", 2, 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        orders("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="one stage per rank"):
        orders("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="expected 2 backward times and 1 send times"):
        simulate(orders("1f1b", 2, 2), [1, 1], [1], [0.0])


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_held_bytes_need_no_seconds(schedule, v):
    """What a rank holds at once follows from its own order: the same as the replay's, for any m."""
    pp = 4
    act = [1.0 + k for k in range(pp * v)]
    for m in (4, 8, 40, 96):
        full = simulate(orders(schedule, pp, m, v), [1.0] * (pp * v), [2.0] * (pp * v), [0.1] * (pp * v - 1), act)
        assert held_bytes(schedule, pp, m, v, act) == pytest.approx(full.peak_activation_bytes)
