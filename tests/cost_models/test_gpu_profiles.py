"""The built-in GPU profiles: which device name picks which, and that each prices what it says.

The figures asserted here are the vendors' datasheet figures, written out by hand (dense, no
sparsity), and the share of them the profiles price at (0.7); PyTorch's own defaults decide which
float32 kernels run in TF32.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotp.parallel import default_hardware
from cost_models import builtin_profile_names, compute_time_s, load_profile, profile_for_device
from cost_models.devices import GPU_PROFILES

# datasheet, dense: (float32, TF32, bfloat16) FLOP/s
DATASHEET = {
    "h100-sxm": (67e12, 494.5e12, 989e12),
    "h200": (67e12, 494.5e12, 989e12),
    "h100-pcie": (51e12, 378e12, 756e12),
    "h100-nvl": (60e12, 417.5e12, 835.5e12),
    "b200": (75e12, 1125e12, 2250e12),
    "a100-sxm": (19.5e12, 156e12, 312e12),
    "a100-pcie": (19.5e12, 156e12, 312e12),
}
FRACTION = 0.7


@pytest.mark.parametrize("name, profile", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 SXM5 80GB", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm"),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie"),
])
def test_each_device_name_picks_its_profile(name, profile):
    assert profile_for_device("cuda", name) == profile
    assert default_hardware("cuda", name) == profile  # what autotp.parallelize prices a CUDA mesh with


@pytest.mark.parametrize("name", ["NVIDIA H200 NVL", "NVIDIA GH200 480GB", "Tesla V100-SXM2-16GB", "NVIDIA H800"])
def test_a_gpu_with_no_profile_is_an_error_that_names_it_and_says_what_to_do(name):
    with pytest.raises(ValueError) as err:
        profile_for_device("cuda", name)
    message = str(err.value)
    assert f"no built-in hardware profile for the CUDA device {name!r}" in message
    assert "built-in GPU profiles: a100-pcie, a100-sxm, b200, h100-nvl, h100-pcie, h100-sxm, h200" in message
    assert "autotp profile -o my.json" in message and 'hardware="my.json"' in message


@pytest.mark.parametrize("device_type, name, match", [
    ("cuda", None, r"chosen by its name \(torch\.cuda\.get_device_name\(\)\), got None"),
    ("cuda", "  ", r"chosen by its name .*got '  '"),
    ("xpu", "Intel Data Center GPU Max", r"no built-in hardware profile for the device type 'xpu'"),
])
def test_a_device_that_cannot_be_looked_up_is_a_clear_error(device_type, name, match):
    with pytest.raises(ValueError, match=match):
        profile_for_device(device_type, name)
    assert profile_for_device("cpu") == "cpu-gloo"


def test_every_row_names_a_builtin_profile_and_every_gpu_profile_has_a_row():
    rows = {row.profile for row in GPU_PROFILES}
    assert rows <= set(builtin_profile_names())
    assert rows == set(DATASHEET) == set(builtin_profile_names()) - {"cpu-gloo"}


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_a_large_matmul_is_priced_at_the_stated_share_of_the_datasheet_peak(name):
    profile = load_profile(name)
    fp32, _, bf16 = DATASHEET[name]
    device = profile.device
    assert device.achievable_fraction == FRACTION and "achievable_fraction 0.7" in profile.source
    assert device.peak_flops_for("bfloat16") == bf16 and device.peak_flops_for("float32") == fp32
    n = 8192  # compute-bound on every profile: 1.1e12 FLOPs against 4e8 bytes
    flops, moved = 2 * n**3, 3 * n * n * 2
    assert compute_time_s(device, flops, moved, "bfloat16") == pytest.approx(flops / (bf16 * FRACTION) + 5e-6)
    assert compute_time_s(device, flops, 2 * moved, "float32") == pytest.approx(flops / (fp32 * FRACTION) + 5e-6)


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_float32_convolutions_are_priced_in_tf32_and_float32_matmuls_are_not_as_pytorch_runs_them(name):
    # PyTorch's defaults, which the profiles follow: cuDNN convolutions in TF32, matmuls in full float32
    assert torch.backends.cudnn.allow_tf32 is True and torch.backends.cuda.matmul.allow_tf32 is False
    fp32, tf32, bf16 = DATASHEET[name]
    device = load_profile(name).device
    flops = 2 * 8192**3
    conv = compute_time_s(device, flops, 1e6, "float32", convolution=True)
    assert conv == pytest.approx(flops / (tf32 * FRACTION) + 5e-6)
    assert compute_time_s(device, flops, 1e6, "float32") == pytest.approx(flops / (fp32 * FRACTION) + 5e-6)
    # a bfloat16 convolution runs on the tensor cores as a bfloat16 matmul does
    assert compute_time_s(device, flops, 1e6, "bfloat16", convolution=True) == pytest.approx(
        flops / (bf16 * FRACTION) + 5e-6)


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_collective_latencies_are_those_eager_pytorch_sees(name):
    """Tens of microseconds: nccl-tests' 10-15 us within a node plus the host's side of each eager call."""
    profile = load_profile(name)
    for link in ("intra_node", "inter_node"):
        for kind, cost in profile.links[link].costs.items():
            assert 30e-6 <= cost.latency_s <= 70e-6, (link, kind, cost.latency_s)
    assert "as eager PyTorch sees them" in profile.source


class _Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(64, 64, 3, padding=1, bias=False)

    def forward(self, x):
        return self.conv(x)


def test_the_planner_prices_a_float32_convolution_at_the_tf32_rate():
    from autotp.mesh import MeshSpec
    from autotp.placement import R, Strategy
    from autotp.planning.costs.costing import CostModel
    from autotp.tracing.export import capture

    graph = capture(_Convs(), (torch.randn(8, 64, 56, 56),), dynamic_dims=False)
    conv = next(n for n in graph.nodes if "conv" in n.target)
    cost = CostModel(MeshSpec.of((1,)), load_profile("h100-sxm"), "inference")
    seconds = cost.node_forward_s(conv, Strategy(inputs=tuple((R,) for _ in conv.input_infos), output=(R,)))
    flops = 2 * 8 * 64 * 56 * 56 * 64 * 9  # 1.85e10: compute-bound (13 MB moved)
    assert conv.flops == flops
    assert seconds == pytest.approx(flops / (494.5e12 * FRACTION) + 5e-6)


@pytest.fixture(scope="module")
def llama_graph():
    from autotp.tracing.export import capture
    from examples import models

    model, inputs = models.hf_llama(n_layer=1, hidden=64, ffn=128, vocab=128, seq=16)
    return capture(model, inputs, dynamic_dims=False)


def test_a_plan_on_each_new_profile_is_priced_with_it(llama_graph):
    from autotp.planning.planner import plan_graph

    names = ("h100-sxm", "h200", "h100-pcie", "h100-nvl", "b200")
    times = {}
    for name in names:
        plan = plan_graph(llama_graph, (2,), name, "inference")
        assert plan.hardware.name == name
        times[name] = plan.predicted_time()
    # the H200 is an H100 SXM with faster memory: the same links, each op no slower
    assert times["h200"].compute_s < times["h100-sxm"].compute_s
    assert times["h200"].communication_s == pytest.approx(times["h100-sxm"].communication_s)
    # the H100 PCIe's memory (2 TB/s) is slower than the SXM's (3.35), the B200's (8 TB/s) faster
    assert times["b200"].total_s < times["h100-sxm"].total_s < times["h100-pcie"].total_s
