"""cost_models: every formula against a figure computed by hand here; profiles and their JSON."""

from __future__ import annotations

import ast
import copy
import dataclasses
import doctest
import json
import pickle
from pathlib import Path

import pytest

import cost_models
from cost_models import (
    COLLECTIVE_KINDS,
    CollectiveCost,
    DeviceSpec,
    HardwareProfile,
    LinkSpec,
    ModelStateBytes,
    OptimizerSpec,
    ProfileError,
    axis_collective_time_s,
    axis_link_name,
    builtin_profile_names,
    collective_factor,
    collective_time_s,
    communication,
    compute,
    compute_time_s,
    device,
    hardware,
    links,
    load_profile,
    memory,
    model_state_bytes,
    optimizer_spec,
)

PACKAGE_DIR = Path(cost_models.__file__).parent
GiB = 2**30


def uniform_link(latency_s: float, busbw: float) -> LinkSpec:
    return LinkSpec({k: CollectiveCost(latency_s, busbw) for k in COLLECTIVE_KINDS})


def profile_dict() -> dict:
    """A valid profile as plain JSON data, for tests that break one field at a time."""
    def link(lat, bw):
        return {k: {"latency_s": lat, "bus_bandwidth_bytes_per_s": bw} for k in COLLECTIVE_KINDS}

    return {
        "schema": "autotp.hardware/1",
        "name": "test",
        "source": "made up in the test",
        "device": {
            "peak_flops": {"float32": 1e12, "bfloat16": 4e12},
            "memory_bandwidth_bytes_per_s": 1e11,
            "memory_bytes": 8e10,
            "kernel_overhead_s": 5e-6,
        },
        "devices_per_node": 8,
        "links": {"intra_node": link(1e-5, 1e11), "inter_node": link(3e-5, 1e10)},
    }


# --- communication -------------------------------------------------------------------


def test_all_reduce_one_gib_on_eight_ranks():
    link = uniform_link(1e-5, 1e11)
    expected = 1e-5 + 2**30 * 2 * 7 / 8 / 1e11  # 2(n-1)/n of the full tensor
    assert collective_time_s(link, "all_reduce", GiB, 8) == pytest.approx(expected, rel=1e-12)
    # written out: 2**30 * 1.75 = 1,879,048,192 bytes on the bus; / 1e11 B/s = 18.79 ms
    assert expected == pytest.approx(1e-5 + 1_879_048_192 / 1e11)
    assert expected == pytest.approx(0.01880048192)


@pytest.mark.parametrize(
    "kind, size_bytes, n, expected_s",
    [
        ("all_gather", 2**20, 4, 2e-5 + 2**20 * 3 / 4 / 5e10),  # gathered output, (n-1)/n
        ("reduce_scatter", 2**20, 4, 2e-5 + 2**20 * 3 / 4 / 5e10),  # unreduced input, (n-1)/n
        ("all_to_all", 2**24, 2, 2e-5 + 2**24 * 1 / 2 / 5e10),  # per-rank buffer, (n-1)/n
        ("broadcast", 2**24, 16, 2e-5 + 2**24 * 1 / 5e10),  # factor 1 whatever n
        ("all_reduce", 1000, 2, 2e-5 + 1000 * 1 / 5e10),  # 2(2-1)/2 = 1
    ],
)
def test_collective_time_by_kind(kind, size_bytes, n, expected_s):
    link = uniform_link(2e-5, 5e10)
    assert collective_time_s(link, kind, size_bytes, n) == pytest.approx(expected_s, rel=1e-12)


def test_collective_time_uses_the_kinds_own_figures():
    costs = {k: CollectiveCost(1e-6 * (i + 1), 1e9 * (i + 1)) for i, k in enumerate(COLLECTIVE_KINDS)}
    link = LinkSpec(costs)
    # reduce_scatter is the third kind: latency 3e-6, busbw 3e9
    assert collective_time_s(link, "reduce_scatter", 3e9, 3) == pytest.approx(3e-6 + 3e9 * 2 / 3 / 3e9)


def test_collective_factors():
    assert collective_factor("all_reduce", 8) == 2 * 7 / 8
    assert collective_factor("all_gather", 8) == 7 / 8
    assert collective_factor("reduce_scatter", 4) == 3 / 4
    assert collective_factor("all_to_all", 2) == 1 / 2
    assert collective_factor("broadcast", 8) == 1.0
    for kind in COLLECTIVE_KINDS:
        assert collective_factor(kind, 1) == 0.0


def test_one_rank_or_zero_bytes_cost_nothing_not_even_latency():
    link = uniform_link(1e-3, 1e9)
    for kind in COLLECTIVE_KINDS:
        assert collective_time_s(link, kind, GiB, 1) == 0.0
        assert collective_time_s(link, kind, 0, 8) == 0.0


def test_bad_collective_arguments():
    link = uniform_link(1e-5, 1e11)
    with pytest.raises(ValueError, match=r"'all_sum'.*all_reduce, all_gather, reduce_scatter, all_to_all, broadcast"):
        collective_factor("all_sum", 4)
    with pytest.raises(ValueError, match="n_ranks"):
        collective_time_s(link, "all_reduce", 10, 0)
    with pytest.raises(ValueError, match="size_bytes"):
        collective_time_s(link, "all_reduce", -1, 2)


@pytest.mark.parametrize(
    "mesh_shape, axis, expected",
    [
        ((8,), 0, "intra_node"),  # stride 1, 8 ranks: one node
        ((16,), 0, "inter_node"),  # 16 ranks > 8 per node
        ((2, 8), 0, "inter_node"),  # stride 8: ranks {i, i+8} on two nodes
        ((2, 8), 1, "intra_node"),  # stride 1: ranks 8k..8k+7, one node each
        ((8, 8), 0, "inter_node"),  # stride 8, 64 ranks
        ((8, 8), 1, "intra_node"),
        ((4, 2), 0, "intra_node"),  # stride 2 * 4 = 8 ranks: still one node
        ((2, 2, 4), 1, "intra_node"),  # stride 4 * 2 = 8
        ((2, 2, 4), 0, "inter_node"),  # stride 8 * 2 = 16
        ((3, 3), 1, "inter_node"),  # group {6, 7, 8} straddles nodes 0 and 1
        ((3,), 0, "intra_node"),  # all 3 ranks in node 0
    ],
)
def test_axis_link_name(mesh_shape, axis, expected):
    assert axis_link_name(mesh_shape, axis, devices_per_node=8) == expected


def test_axis_link_name_rejects_bad_axis():
    with pytest.raises(ValueError, match="axis"):
        axis_link_name((2, 8), 2, 8)


def test_axis_collective_time_picks_the_axis_link_and_group_size():
    p = HardwareProfile.from_dict(profile_dict())
    # (2, 8) axis 0: 2 ranks across nodes -> inter_node (3e-5, 1e10)
    assert axis_collective_time_s(p, (2, 8), 0, "all_reduce", 1e8) == pytest.approx(3e-5 + 1e8 * 1 / 1e10)
    # axis 1: 8 ranks inside a node -> intra_node (1e-5, 1e11)
    assert axis_collective_time_s(p, (2, 8), 1, "all_gather", 1e8) == pytest.approx(1e-5 + 1e8 * 7 / 8 / 1e11)
    assert p.link_for_axis((2, 8), 0) is p.links["inter_node"]


# --- compute -------------------------------------------------------------------------


def make_device() -> DeviceSpec:
    return DeviceSpec({"float32": 1e12, "bfloat16": 4e12}, 1e11, 8e10, 5e-6)


def test_compute_bound_roofline():
    # bf16 matmul 4096^3: 1.37e11 FLOPs / 4e12 = 34.4 ms; bytes 3 * 4096^2 * 2 / 1e11 = 1.0 ms
    t = compute_time_s(make_device(), 2 * 4096**3, 3 * 4096**2 * 2, "bfloat16")
    assert t == pytest.approx(2 * 4096**3 / 4e12 + 5e-6, rel=1e-12)


def test_memory_bound_roofline():
    # elementwise add of 2^24 floats: 2^24 FLOPs / 1e12 = 17 us; 3 * 2^26 bytes / 1e11 = 2.0 ms
    t = compute_time_s(make_device(), 2**24, 3 * 2**24 * 4, "float32")
    assert t == pytest.approx(3 * 2**24 * 4 / 1e11 + 5e-6, rel=1e-12)


def test_compute_dtype_fallback_and_no_kernel():
    dev = make_device()
    # float16 not listed -> float32 figure
    assert compute_time_s(dev, 1e12, 0, "float16") == pytest.approx(1.0 + 5e-6)
    assert compute_time_s(dev, 1e12, 0, "torch.bfloat16") == pytest.approx(0.25 + 5e-6)
    assert dev.peak_flops_for("int8") == 1e12
    assert compute_time_s(dev, 0, 0, "float32") == 0.0
    with pytest.raises(ValueError, match="flops"):
        compute_time_s(dev, -1, 0, "float32")


def curved_device() -> DeviceSpec:
    return DeviceSpec({"float32": 1e12, "bfloat16": 4e12}, 1e11, 8e10, 5e-6,
                      matmul_curve={"float32": ((1e6, 1e11), (1e8, 3e11), (1e10, 4e11))},
                      memory_curve=((3e6, 2e10), (3e8, 6e10)))


def test_matmul_curve_prices_a_matmul_by_its_flops():
    dev = curved_device()
    # on a point: 1e8 FLOPs at 3e11 FLOP/s = 333 us (the roofline's peak would say 100 us)
    assert compute_time_s(dev, 1e8, 0, "float32") == pytest.approx(1e8 / 3e11 + 5e-6, rel=1e-12)
    # between points, linear in log(flops): 1e9 is halfway from 1e8 to 1e10 -> 3.5e11 FLOP/s
    assert compute_time_s(dev, 1e9, 0, "float32") == pytest.approx(1e9 / 3.5e11 + 5e-6, rel=1e-12)
    # 1e7 is halfway from 1e6 to 1e8 -> 2e11; beyond either end, the end point's rate
    assert compute_time_s(dev, 1e7, 0, "float32") == pytest.approx(1e7 / 2e11 + 5e-6, rel=1e-12)
    assert compute_time_s(dev, 1e3, 0, "float32") == pytest.approx(1e3 / 1e11 + 5e-6, rel=1e-12)
    assert compute_time_s(dev, 1e12, 0, "float32") == pytest.approx(1e12 / 4e11 + 5e-6, rel=1e-12)
    # bfloat16 has no curve: its peak; float16 is not listed: the float32 curve, as the peak falls back
    assert compute_time_s(dev, 1e9, 0, "bfloat16") == pytest.approx(1e9 / 4e12 + 5e-6, rel=1e-12)
    assert dev.flops_per_s_for("float16", 1e9) == pytest.approx(3.5e11)


def test_memory_curve_prices_a_memory_bound_kernel_by_its_bytes():
    dev = curved_device()
    # 3e7 bytes: halfway from 3e6 to 3e8 in log -> 4e10 B/s = 750 us (the flat 1e11 would say 300 us)
    assert compute_time_s(dev, 0, 3e7, "float32") == pytest.approx(3e7 / 4e10 + 5e-6, rel=1e-12)
    assert compute_time_s(dev, 0, 3e9, "float32") == pytest.approx(3e9 / 6e10 + 5e-6, rel=1e-12)
    assert compute_time_s(dev, 0, 3e3, "float32") == pytest.approx(3e3 / 2e10 + 5e-6, rel=1e-12)
    # the roofline still takes the slower side: 1e6 FLOPs (10 us at 1e11) against 3e7 bytes (750 us)
    assert compute_time_s(dev, 1e6, 3e7, "float32") == pytest.approx(3e7 / 4e10 + 5e-6, rel=1e-12)


def test_profiles_without_curves_price_as_before():
    """No curve (every built-in profile, every profile written before them): the peak times the profile's
    achievable fraction, and flat bandwidth."""
    for name in builtin_profile_names():
        dev = load_profile(name).device
        assert dev.matmul_curve is None and dev.memory_curve is None and dev.memory_overlap == 1.0
        assert not {"matmul_curve", "memory_curve", "memory_overlap"} & set(dev.to_dict())
        flops, moved = 2 * 4096**3, 3 * 4096**2 * 2
        expected = max(flops / (dev.peak_flops["bfloat16"] * dev.achievable_fraction),
                       moved / dev.memory_bandwidth_bytes_per_s)
        assert compute_time_s(dev, flops, moved, "bfloat16") == pytest.approx(expected + dev.kernel_overhead_s,
                                                                              rel=1e-12)
    h100 = load_profile("h100-sxm").device
    # 2 * 4096^3 = 1.374e11 FLOPs at 0.7 of the datasheet's 9.89e14 (6.92e14) = 199 us; + 5 us overhead
    assert compute_time_s(h100, 2 * 4096**3, 1e6, "bfloat16") == pytest.approx(2 * 4096**3 / 6.923e14 + 5e-6)


def test_memory_overlap_between_max_and_sum():
    """1 (the default): the roofline's max; 0: compute plus memory; between: the shorter time partly hidden."""
    base = dict(peak_flops={"float32": 1e11}, memory_bandwidth_bytes_per_s=1e10, memory_bytes=8e10,
                kernel_overhead_s=1e-6)
    # 1e9 FLOPs at 1e11 = 10 ms; 5e7 bytes at 1e10 = 5 ms
    assert compute_time_s(DeviceSpec(**base), 1e9, 5e7, "float32") == pytest.approx(10e-3 + 1e-6, rel=1e-12)
    assert compute_time_s(DeviceSpec(**base, memory_overlap=0.0), 1e9, 5e7, "float32") == pytest.approx(
        15e-3 + 1e-6, rel=1e-12)
    assert compute_time_s(DeviceSpec(**base, memory_overlap=0.4), 1e9, 5e7, "float32") == pytest.approx(
        10e-3 + 0.6 * 5e-3 + 1e-6, rel=1e-12)
    # a memory-bound kernel with no FLOPs is its memory time, whatever the overlap
    assert compute_time_s(DeviceSpec(**base, memory_overlap=0.0), 0, 5e7, "float32") == pytest.approx(5e-3 + 1e-6)
    d = profile_dict()
    d["device"]["memory_overlap"] = 0.25
    p = HardwareProfile.from_json(json.dumps(d))
    assert p.device.memory_overlap == 0.25 and json.loads(p.to_json())["device"]["memory_overlap"] == 0.25
    assert "memory_overlap" not in HardwareProfile.from_dict(profile_dict()).device.to_dict()
    for bad, match in ((1.5, r"^device\.memory_overlap: expected a number from 0 to 1, got 1\.5"),
                       (-0.1, r"^device\.memory_overlap: expected a number >= 0, got -0\.1"),
                       ("all", r"^device\.memory_overlap: expected a number >= 0, got 'all'")):
        d["device"]["memory_overlap"] = bad
        with pytest.raises(ProfileError, match=match):
            HardwareProfile.from_json(json.dumps(d))


def test_curves_round_trip_through_json():
    d = profile_dict()
    d["device"]["matmul_curve"] = {"float32": [{"flops": 1e6, "flops_per_s": 1e11},
                                               {"flops": 1e9, "flops_per_s": 5e11}]}
    d["device"]["memory_curve"] = [{"bytes": 3e6, "bytes_per_s": 2e10}, {"bytes": 3e8, "bytes_per_s": 6e10}]
    p = HardwareProfile.from_json(json.dumps(d))
    assert p.device.matmul_curve == {"float32": ((1e6, 1e11), (1e9, 5e11))}
    assert p.device.memory_curve == ((3e6, 2e10), (3e8, 6e10))
    assert json.loads(p.to_json())["device"] == d["device"]
    assert HardwareProfile.from_json(p.to_json()) == p
    assert hash(p) == hash(HardwareProfile.from_json(p.to_json()))


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("matmul_curve", {"float32": [{"flops": 1e6, "flops_per_s": 0}]},
         r"^device\.matmul_curve\.float32\[0\]\.flops_per_s: expected a number > 0, got 0"),
        ("matmul_curve", {"float32": [{"flops": 1e9, "flops_per_s": 1e11}, {"flops": 1e6, "flops_per_s": 1e11}]},
         r"^device\.matmul_curve\.float32\[1\]\.flops: expected more than matmul_curve\.float32\[0\]\.flops"),
        ("matmul_curve", {"torch.float32": [{"flops": 1e6, "flops_per_s": 1e11}]},
         r"^device\.matmul_curve\.torch\.float32: expected a dtype name"),
        ("matmul_curve", [1, 2], r"^device\.matmul_curve: expected a JSON object of dtype name to a curve"),
        ("memory_curve", [], r"^device\.memory_curve: expected a non-empty list"),
        ("memory_curve", [{"bytes": 1e6, "rate": 1e10}],
         r"^device\.memory_curve\[0\]\.bytes_per_s: missing; expected fields bytes, bytes_per_s"),
        ("memory_curve", [{"bytes": 1e6, "bytes_per_s": 1e10, "rate": 1e10}],
         r"^device\.memory_curve\[0\]\.rate: unknown field; expected one of bytes, bytes_per_s"),
        ("memory_curve", [{"bytes": -1, "bytes_per_s": 1e10}],
         r"^device\.memory_curve\[0\]\.bytes: expected a number > 0, got -1"),
        ("memory_kurve", [], r"^device\.memory_kurve: unknown field"),
    ],
)
def test_bad_curve_rejected_with_its_path(key, value, match):
    d = profile_dict()
    d["device"][key] = value
    with pytest.raises(ProfileError, match=match):
        HardwareProfile.from_json(json.dumps(d))


def test_backward_of_a_memory_bound_op_is_priced_on_its_bytes():
    """autotp's costing: the backward of an op without FLOPs moves the output's gradient, each float
    input twice (saved input read, gradient written) and each integer input once; one with FLOPs
    is BACKWARD_FLOP_RATIO kernels like its forward."""
    from autotp.mesh import MeshSpec
    from autotp.placement import R, Strategy
    from autotp.planning.costs.costing import BACKWARD_FLOP_RATIO, CostModel
    from autotp.tracing.graph import OP, OpNode, TensorInfo

    profile = HardwareProfile.from_dict(profile_dict())  # 1e11 B/s, 5 us per kernel
    cost = CostModel(MeshSpec.of((1,)), profile, "train")
    x = TensorInfo((1024, 1024), "float32")  # 4 MiB
    gelu = OpNode("gelu", OP, "aten.gelu.default", ("x",), (x,), (x,), requires_grad=True)
    rep = Strategy(((R,),), (R,))
    # forward 8 MiB; backward 4 MiB (grad out) + 2 * 4 MiB (input read, its gradient written) = 12 MiB
    assert cost.node_compute_s(gelu, rep) == pytest.approx(8 * 2**20 / 1e11 + 12 * 2**20 / 1e11 + 2 * 5e-6)
    ids = TensorInfo((1024,), "int64")
    emb = OpNode("emb", OP, "aten.embedding.default", ("w", "i"), (x, ids), (TensorInfo((1024, 1024), "float32"),),
                 requires_grad=True)
    both = Strategy(((R,), (R,)), (R,))
    fwd = 4 * 2**20 + 8192 + 4 * 2**20
    bwd = 4 * 2**20 + 2 * 4 * 2**20 + 8192
    assert cost.node_compute_s(emb, both) == pytest.approx(fwd / 1e11 + bwd / 1e11 + 2 * 5e-6)
    mm = dataclasses.replace(gelu, name="mm", target="aten.mm.default", flops=2 * 1024**3)
    forward = 2 * 1024**3 / 1e12 + 5e-6  # compute-bound: 2.1 ms of FLOPs beat 84 us of bytes
    assert cost.node_compute_s(mm, rep) == pytest.approx(forward * (1 + BACKWARD_FLOP_RATIO))
    inference = CostModel(MeshSpec.of((1,)), profile, "inference")
    assert inference.node_compute_s(gelu, rep) == pytest.approx(8 * 2**20 / 1e11 + 5e-6)


# --- memory --------------------------------------------------------------------------


def test_memory_train_adamw():
    s = model_state_bytes(numel=1_000_000, param_dtype_bytes=2, shard_fraction=1 / 4)
    assert s == ModelStateBytes(
        parameters_bytes=1_000_000 / 4 * 2,  # bf16 shard
        gradients_bytes=1_000_000 / 4 * 2,  # same as parameters
        optimizer_bytes=1_000_000 / 4 * 2 * 2,  # two moments in the parameter's dtype, as torch.optim keeps them
        step_temporary_bytes=1_000_000 / 4 * 2,  # the multi-tensor step's one list of intermediates
    )
    assert s.total_bytes == 500_000 + 500_000 + 1_000_000
    # mixed precision: bf16 weights and gradients, an fp32 master copy and fp32 moments
    mixed = model_state_bytes(1_000_000, 2, 1 / 4, optimizer=OptimizerSpec("adamw", master_dtype_bytes=4))
    assert mixed.optimizer_bytes == 250_000 * (4 + 2 * 4)
    fp32_state = model_state_bytes(1_000_000, 2, 1 / 4, optimizer=OptimizerSpec("adam", state_dtype_bytes=4))
    assert fp32_state.optimizer_bytes == 250_000 * 8


def test_memory_inference_and_other_optimizers():
    s = model_state_bytes(1_000_000, 4, 1.0, mode="inference")
    assert (s.parameters_bytes, s.gradients_bytes, s.optimizer_bytes) == (4_000_000, 0, 0)
    assert model_state_bytes(1000, 4, 0.5, optimizer=None).total_bytes == 2000 + 2000
    assert model_state_bytes(1000, 4, 0.5, optimizer="sgd_momentum").optimizer_bytes == 500 * 4
    assert model_state_bytes(1000, 2, 0.5, optimizer="sgd_momentum").optimizer_bytes == 500 * 2
    assert model_state_bytes(1000, 4, 0.5, optimizer="adafactor").optimizer_bytes == 0
    assert optimizer_spec("AdamW") == OptimizerSpec("adamw") and optimizer_spec("none") == OptimizerSpec("sgd")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"shard_fraction": 0.0}, "shard_fraction"),
        ({"shard_fraction": 1.5}, "shard_fraction"),
        ({"mode": "eval"}, "mode"),
        ({"optimizer": "lion"}, "optimizer"),
        ({"optimizer": 3}, "optimizer"),
    ],
)
def test_memory_rejects(kwargs, match):
    args = {"numel": 10, "param_dtype_bytes": 4, "shard_fraction": 1.0} | kwargs
    with pytest.raises(ValueError, match=match):
        model_state_bytes(**args)


# --- profiles ------------------------------------------------------------------------


def test_builtin_profiles_load_and_round_trip():
    names = builtin_profile_names()
    assert set(names) >= {"h100-sxm", "h100-pcie", "h100-nvl", "h200", "b200", "a100-sxm", "a100-pcie", "cpu-gloo"}
    for name in names:
        p = load_profile(name)
        assert p.name == name
        assert p.source.strip()
        assert HardwareProfile.from_json(p.to_json()) == p
        assert p.to_json() == HardwareProfile.from_json(p.to_json()).to_json()
        assert json.loads((PACKAGE_DIR / "profiles" / f"{name}.json").read_text()) == p.to_dict()


def test_builtin_profile_figures():
    h100 = load_profile("h100-sxm")
    assert h100.devices_per_node == 8
    assert h100.device.peak_flops_for("bfloat16") == 9.89e14
    assert h100.device.peak_flops_for("float32") == 6.7e13
    intra = h100.links["intra_node"].cost("all_reduce").bus_bandwidth_bytes_per_s
    inter = h100.links["inter_node"].cost("all_reduce").bus_bandwidth_bytes_per_s
    assert 3.0e11 <= intra <= 5.0e11 and inter < intra
    cpu = load_profile("cpu-gloo")
    assert cpu.devices_per_node == 2
    assert cpu.links["intra_node"] == cpu.links["inter_node"]
    assert cpu.measurements["backend"] == "gloo" and cpu.measurements["world_size"] == 2


def test_load_profile_path_and_passthrough(tmp_path):
    p = HardwareProfile.from_dict(profile_dict())
    assert load_profile(p) is p
    f = tmp_path / "mine.json"
    f.write_text(p.to_json())
    assert load_profile(f) == p
    assert load_profile(str(f)) == p


def test_load_profile_unknown_name_lists_builtins():
    with pytest.raises(ProfileError, match=r"'no-such-gpu' is neither a built-in profile") as info:
        load_profile("no-such-gpu")
    assert ", ".join(builtin_profile_names()) in str(info.value)
    assert "a100-pcie, a100-sxm, b200, cpu-gloo, h100-nvl, h100-pcie, h100-sxm, h200" in str(info.value)


def test_load_profile_error_names_file_and_field(tmp_path):
    d = profile_dict()
    d["device"]["memory_bytes"] = -1
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"device\.memory_bytes: .*-1.*bad\.json"):
        load_profile(f)


def test_missing_field_rejected_with_its_path():
    d = profile_dict()
    del d["links"]["intra_node"]["all_gather"]["bus_bandwidth_bytes_per_s"]
    with pytest.raises(ProfileError, match=r"^links\.intra_node\.all_gather\.bus_bandwidth_bytes_per_s: missing"):
        HardwareProfile.from_dict(d)
    d = profile_dict()
    del d["device"]
    with pytest.raises(ProfileError, match=r"^device: missing"):
        HardwareProfile.from_dict(d)
    d = profile_dict()
    del d["links"]["inter_node"]["broadcast"]
    with pytest.raises(ProfileError, match=r"^links\.inter_node\.broadcast: missing"):
        HardwareProfile.from_dict(d)


@pytest.mark.parametrize(
    "path, value, match",
    [
        (("links", "intra_node", "all_gather", "latency_s"), -1e-5,
         r"^links\.intra_node\.all_gather\.latency_s: expected a number >= 0, got -1e-05"),
        (("links", "inter_node", "all_reduce", "bus_bandwidth_bytes_per_s"), 0,
         r"^links\.inter_node\.all_reduce\.bus_bandwidth_bytes_per_s: expected a number > 0, got 0"),
        (("device", "peak_flops", "bfloat16"), 0, r"^device\.peak_flops\.bfloat16: expected a number > 0"),
        (("device", "memory_bandwidth_bytes_per_s"), "fast",
         r"^device\.memory_bandwidth_bytes_per_s: expected a number > 0, got 'fast'"),
        (("device", "kernel_overhead_s"), -5e-6, r"^device\.kernel_overhead_s: expected a number >= 0"),
        (("device", "achievable_fraction"), 1.2,
         r"^device\.achievable_fraction: expected a share of the peak, above 0 and at most 1, got 1\.2"),
        (("device", "achievable_fraction"), 0, r"^device\.achievable_fraction: expected a number > 0, got 0"),
        (("device", "convolution_peak_flops"), {"torch.float32": 1e12},
         r"^device\.convolution_peak_flops\.torch\.float32: expected a dtype name"),
        (("device", "convolution_peak_flops"), {"float32": -1},
         r"^device\.convolution_peak_flops\.float32: expected a number > 0, got -1"),
        (("device", "convolution_peak_flops"), 5e14,
         r"^device\.convolution_peak_flops: expected a mapping of dtype name to FLOP/s, got 5"),
        (("devices_per_node",), 0, r"^devices_per_node: expected an integer >= 1, got 0"),
        (("devices_per_node",), True, r"^devices_per_node: expected an integer >= 1"),
    ],
)
def test_bad_value_rejected_with_its_path(path, value, match):
    d = profile_dict()
    target = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ProfileError, match=match):
        HardwareProfile.from_json(json.dumps(d))


def test_unknown_names_rejected():
    d = profile_dict()
    d["links"]["intra_node"]["all_sum"] = {"latency_s": 0, "bus_bandwidth_bytes_per_s": 1}
    with pytest.raises(ProfileError, match=r"^links\.intra_node\.all_sum: unknown field"):
        HardwareProfile.from_dict(d)
    d = profile_dict()
    d["links"]["rack"] = d["links"]["inter_node"]
    with pytest.raises(ProfileError, match=r"^links\.rack: unknown field"):
        HardwareProfile.from_dict(d)
    d = profile_dict()
    d["measurment"] = {}
    with pytest.raises(ProfileError, match=r"^measurment: unknown field"):
        HardwareProfile.from_dict(d)
    d = profile_dict()
    del d["device"]["peak_flops"]["float32"]
    with pytest.raises(ProfileError, match=r"^device\.peak_flops\.float32: missing"):
        HardwareProfile.from_dict(d)


@pytest.mark.parametrize("schema", ["autotp.hardware/2", None, 1])
def test_wrong_schema_rejected(schema):
    d = profile_dict()
    d["schema"] = schema
    with pytest.raises(ProfileError, match=r"^schema: expected 'autotp\.hardware/1', got"):
        HardwareProfile.from_dict(d)
    del d["schema"]
    with pytest.raises(ProfileError, match=r"^schema: missing"):
        HardwareProfile.from_dict(d)


def test_invalid_json_rejected():
    with pytest.raises(ProfileError, match="not valid JSON"):
        HardwareProfile.from_json("{")


def test_direct_construction_is_validated_too():
    with pytest.raises(ProfileError, match="bus_bandwidth_bytes_per_s"):
        CollectiveCost(1e-5, 0.0)
    with pytest.raises(ProfileError, match="reduce_scatter: missing"):
        LinkSpec({k: CollectiveCost(0, 1) for k in COLLECTIVE_KINDS if k != "reduce_scatter"})


def test_profiles_are_frozen_hashable_and_picklable():
    p = HardwareProfile.from_dict(profile_dict() | {"measurements": {"sizes": [1, 2], "backend": "nccl"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.name = "other"
    with pytest.raises(TypeError):
        p.links["intra_node"] = p.links["inter_node"]
    with pytest.raises(TypeError):
        p.device.peak_flops["float32"] = 1.0
    with pytest.raises(TypeError):
        p.measurements["backend"] = "gloo"
    assert hash(p) == hash(HardwareProfile.from_json(p.to_json()))
    assert pickle.loads(pickle.dumps(p)) == p
    assert copy.deepcopy(p) == p
    assert json.loads(p.to_json())["measurements"] == {"sizes": [1, 2], "backend": "nccl"}
    assert "measurements" not in json.loads(HardwareProfile.from_dict(profile_dict()).to_json())


def test_scaled_links():
    p = HardwareProfile.from_dict(profile_dict())
    slow = p.scaled_links(1e-4, name="slow")
    assert slow.name == "slow" and slow.device == p.device
    for link_name in ("intra_node", "inter_node"):
        for kind in COLLECTIVE_KINDS:
            old, new = p.links[link_name].cost(kind), slow.links[link_name].cost(kind)
            assert new.latency_s == old.latency_s
            assert new.bus_bandwidth_bytes_per_s == pytest.approx(old.bus_bandwidth_bytes_per_s * 1e-4)
    # 1 GiB all_reduce over 8 ranks inside a node: bandwidth term 10,000 times longer
    assert axis_collective_time_s(slow, (8,), 0, "all_reduce", GiB) == pytest.approx(1e-5 + GiB * 2 * 7 / 8 / 1e7)
    assert HardwareProfile.from_json(slow.to_json()) == slow
    with pytest.raises(ProfileError, match="factor"):
        p.scaled_links(0)


# --- size ranges (segments) ----------------------------------------------------------

MiB = 2**20
SEGMENTS_JSON = [
    {"from_bytes": MiB, "latency_s": 5e-5, "bus_bandwidth_bytes_per_s": 2e10},
    {"from_bytes": 32 * MiB, "latency_s": 0.0, "bus_bandwidth_bytes_per_s": 5e9},
]


def segmented_profile_dict() -> dict:
    d = profile_dict()
    d["links"]["intra_node"]["all_gather"]["segments"] = copy.deepcopy(SEGMENTS_JSON)
    return d


def test_collective_time_picks_the_size_range():
    from cost_models import CostSegment

    cost = CollectiveCost(1e-5, 1e11, (CostSegment(MiB, 5e-5, 2e10), CostSegment(32 * MiB, 0.0, 5e9)))
    link = LinkSpec({k: cost for k in COLLECTIVE_KINDS})
    # all_gather over 4 ranks: factor 3/4. Below 1 MiB the base line, from 1 MiB the second,
    # from 32 MiB the third; the bus factor applies in every range.
    assert collective_time_s(link, "all_gather", MiB - 4, 4) == pytest.approx(1e-5 + (MiB - 4) * 0.75 / 1e11, rel=1e-12)
    assert collective_time_s(link, "all_gather", MiB, 4) == pytest.approx(5e-5 + MiB * 0.75 / 2e10, rel=1e-12)
    assert collective_time_s(link, "all_gather", 16 * MiB, 4) == pytest.approx(5e-5 + 16 * MiB * 0.75 / 2e10, rel=1e-12)
    assert collective_time_s(link, "all_gather", 32 * MiB, 4) == pytest.approx(32 * MiB * 0.75 / 5e9, rel=1e-12)
    assert collective_time_s(link, "all_gather", GiB, 4) == pytest.approx(GiB * 0.75 / 5e9, rel=1e-12)
    assert collective_time_s(link, "all_reduce", 64 * MiB, 8) == pytest.approx(64 * MiB * 2 * 7 / 8 / 5e9, rel=1e-12)
    assert collective_time_s(link, "all_gather", 32 * MiB, 1) == 0.0  # one rank: nothing, as before


def test_segments_round_trip_and_stay_optional():
    p = HardwareProfile.from_dict(segmented_profile_dict())
    cost = p.links["intra_node"].cost("all_gather")
    assert [(s.from_bytes, s.latency_s, s.bus_bandwidth_bytes_per_s) for s in cost.segments] == [
        (MiB, 5e-5, 2e10), (32 * MiB, 0.0, 5e9)]
    assert cost.figures_for(32 * MiB) == (0.0, 5e9)
    text = p.to_json()
    assert json.loads(text)["links"]["intra_node"]["all_gather"]["segments"] == SEGMENTS_JSON
    assert HardwareProfile.from_json(text) == p and hash(HardwareProfile.from_json(text)) == hash(p)
    assert pickle.loads(pickle.dumps(p)) == p
    # A collective without segments is written as before: the two figures, no "segments" key.
    plain = {"latency_s": 1e-5, "bus_bandwidth_bytes_per_s": 1e11}
    assert json.loads(text)["links"]["intra_node"]["all_reduce"] == plain
    assert "segments" not in HardwareProfile.from_dict(profile_dict()).to_json()
    # scaled_links scales every range's bandwidth.
    slow = p.scaled_links(0.5).links["intra_node"].cost("all_gather")
    assert [s.bus_bandwidth_bytes_per_s for s in slow.segments] == [1e10, 2.5e9]
    assert [s.latency_s for s in slow.segments] == [5e-5, 0.0]


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda segs: segs.reverse(),
         r"^links\.intra_node\.all_gather\.segments\[1\]\.from_bytes: expected more than "
         r"segments\[0\]\.from_bytes \(33554432\).*, got 1048576"),
        (lambda segs: segs[1].update(from_bytes=MiB),
         r"^links\.intra_node\.all_gather\.segments\[1\]\.from_bytes: expected more than"),
        (lambda segs: segs[0].update(bus_bandwidth_bytes_per_s=-1e9),
         r"^links\.intra_node\.all_gather\.segments\[0\]\.bus_bandwidth_bytes_per_s: expected a number > 0, got -1"),
        (lambda segs: segs[1].update(latency_s=-1e-6),
         r"^links\.intra_node\.all_gather\.segments\[1\]\.latency_s: expected a number >= 0"),
        (lambda segs: segs[0].update(from_bytes=0),
         r"^links\.intra_node\.all_gather\.segments\[0\]\.from_bytes: expected an integer number of bytes >= 1, got 0"),
        (lambda segs: segs[0].update(from_bytes=1.5e6),
         r"^links\.intra_node\.all_gather\.segments\[0\]\.from_bytes: expected an integer"),
        (lambda segs: segs[0].pop("latency_s"),
         r"^links\.intra_node\.all_gather\.segments\[0\]\.latency_s: missing"),
        (lambda segs: segs[0].update(until_bytes=5),
         r"^links\.intra_node\.all_gather\.segments\[0\]\.until_bytes: unknown field"),
    ],
)
def test_bad_segment_rejected_with_its_path(change, match):
    d = segmented_profile_dict()
    change(d["links"]["intra_node"]["all_gather"]["segments"])
    with pytest.raises(ProfileError, match=match):
        HardwareProfile.from_json(json.dumps(d))


def test_segments_must_be_a_list():
    d = profile_dict()
    d["links"]["inter_node"]["broadcast"]["segments"] = {"from_bytes": 1}
    with pytest.raises(ProfileError, match=r"^links\.inter_node\.broadcast\.segments: expected a JSON array"):
        HardwareProfile.from_dict(d)
    from cost_models import CostSegment

    with pytest.raises(ProfileError, match=r"^segments\[1\]\.from_bytes: expected more than"):
        CollectiveCost(1e-5, 1e9, (CostSegment(8, 0.0, 1e9), CostSegment(4, 0.0, 1e9)))


# --- hygiene -------------------------------------------------------------------------


def test_cost_models_never_imports_autotp():
    for path in PACKAGE_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in {"autotp", "torch"}, f"{path.name} imports {name}"


@pytest.mark.parametrize("module", [cost_models, communication, compute, device, hardware, links, memory])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_a_send_is_one_copy_over_the_link():
    """A pipeline stage's send: the link's latency plus the bytes at its bus bandwidth, once."""
    from cost_models import send_time_s

    link = load_profile("h100-sxm").links["inter_node"]
    latency_s, bus_bytes_per_s = link.cost("broadcast").figures_for(2**26)
    assert send_time_s(link, 2**26) == pytest.approx(latency_s + 2**26 / bus_bytes_per_s)
    assert send_time_s(link, 0) == 0.0
