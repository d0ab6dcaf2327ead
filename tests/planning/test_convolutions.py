"""Convnet ops: convolutions (grouped, transposed, patch embeddings), batch/group/instance norm,
pooling, upsampling, pixel shuffles, im2col. Every strategy is checked exact on pieces on (2,)
and (2, 2) (the op run on each rank's pieces alone, the outputs put back together, against the op
on whole tensors); the lists are checked to hold the expert's options and nothing that a window
crossing a piece's edge would make wrong; and a ResNet is planned data parallel at a large batch
and split by channels at batch 1, from the costs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autotp
from autotp import ops
from autotp.mesh import MeshSpec
from autotp.placement import R, S
from autotp.planning.choices.check import check_rule
from autotp.planning.choices.strategies import node_strategies
from autotp.planning.costs.program import collectives
from autotp.planning.planner import plan_graph
from tests.helpers.local_exactness import capture_graph, check_every_strategy, full_values, nodes_of, strategy_texts
from tests.helpers.profiles import h100_without_tf32

aten = torch.ops.aten


class ConvOps(nn.Module):
    """Each convnet op once; channels of 8 (4 groups) so every split divides on 2 and 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(8, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.same = nn.Conv2d(8, 4, 1, padding="same", bias=False)
        self.patch = nn.Conv2d(8, 8, 2, stride=2)
        self.c3 = nn.Conv3d(8, 4, 1)
        self.t2 = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.t1 = nn.ConvTranspose1d(8, 4, 3, groups=4)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=4)
        self.bn = nn.BatchNorm2d(8)
        self.bn_eval = nn.BatchNorm2d(8).eval()
        self.gn = nn.GroupNorm(4, 8)
        self.inorm = nn.InstanceNorm2d(8, affine=True)

    def forward(self, x1, x2, x3):  # (4, 8, 8), (4, 8, 8, 8), (4, 8, 4, 4, 4)
        return (self.c1(x1), self.c2(x2), self.same(x2), self.patch(x2), self.c3(x3), self.t2(x2), self.t1(x1),
                self.depthwise(x2), self.grouped(x2), self.bn(x2), self.bn_eval(x2), self.gn(x2), self.inorm(x2),
                F.max_pool2d(x2, 2), F.avg_pool2d(x2, 2), F.avg_pool2d(x2, 3, stride=1, padding=1),
                F.adaptive_avg_pool2d(x2, 1), F.adaptive_max_pool2d(x2, 2)[0], F.max_pool1d(x1, 2),
                F.interpolate(x2, scale_factor=2), F.interpolate(x2, scale_factor=2, mode="bilinear"),
                F.pixel_shuffle(x2, 2), F.pixel_unshuffle(x2, 2), F.unfold(x2, 2, stride=2),
                F.fold(F.unfold(x2, 2, stride=2), (8, 8), 2, stride=2))


@pytest.fixture(scope="module")
def conv_graph():
    torch.manual_seed(0)
    inputs = (torch.randn(4, 8, 8), torch.randn(4, 8, 8, 8), torch.randn(4, 8, 4, 4, 4))
    model = ConvOps().train()
    model.bn_eval.eval()
    with torch.no_grad():  # statistics that are not the defaults, so eval batch norm reads them
        model.bn_eval.running_mean.normal_()
        model.bn_eval.running_var.uniform_(0.5, 2.0)
    graph = capture_graph(model, inputs)
    return graph, full_values(graph, inputs)


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_every_convnet_strategy_is_exact_on_pieces(conv_graph, mesh):
    graph, values = conv_graph
    targets = {n.target for n in graph.ops()} - {"aten.add_.Tensor", "getitem"}
    assert {"aten.conv2d.default", "aten.conv_transpose1d.default", "aten.batch_norm.default",
            "aten.group_norm.default", "aten.im2col.default", "aten.col2im.default"} <= targets
    checked = check_every_strategy(graph, values, mesh, targets)
    assert checked >= (100 if mesh == (2,) else 400), checked


def test_no_convnet_op_is_left_without_a_rule(conv_graph, caplog):
    graph, _ = conv_graph
    with caplog.at_level("WARNING"):
        autotp.plan(ConvOps(), (2,), (torch.randn(4, 8, 8), torch.randn(4, 8, 8, 8), torch.randn(4, 8, 4, 4, 4)),
                    hardware="cpu-gloo")
    assert "no sharding rule" not in caplog.text, caplog.text


def _conv(graph, module_path):
    return next(n for n in graph.ops() if n.module_path == module_path)


def test_a_convolution_splits_as_a_linear_layer(conv_graph):
    graph, _ = conv_graph
    texts = strategy_texts(graph, _conv(graph, "c2"), (2,))
    assert texts == ["(R, R, R) -> R", "(P, R, P) -> P", "(S(0), R, R) -> S(0)",  # batch
                     "(R, S(0), S(0)) -> S(1)",  # colwise: output channels
                     "(S(1), S(1), P) -> P"]  # rowwise: input channels, the bias added once
    # a transposed convolution keeps its weight as (in, out / groups, ...): colwise is its dim 1
    assert "(R, S(1), S(0)) -> S(1)" in strategy_texts(graph, _conv(graph, "t2"), (2,))


def test_grouped_convolutions_split_by_whole_groups_only(conv_graph):
    graph, _ = conv_graph
    for path, ranks in [("depthwise", 8), ("grouped", 4), ("t1", 4)]:
        node = _conv(graph, path)
        splits = {t for t in strategy_texts(graph, node, (ranks,)) if "S(1)" in t}
        assert splits == {"(S(1), S(0), S(0)) -> S(1)"}, (path, splits)
        assert not any("S(1)" in t for t in strategy_texts(graph, node, (8 if path != "depthwise" else 16,))) \
            or path == "depthwise"
    # 4 groups on 8 ranks: a group would straddle two ranks
    assert not any("S(1)" in t for t in strategy_texts(graph, _conv(graph, "grouped"), (8,)))
    assert check_rule(aten.conv2d.default, (torch.randn(2, 8, 6, 6), torch.randn(8, 2, 3, 3), None, (1, 1), (1, 1),
                                            (1, 1), 4), n=4)  # the public check runs it with 1 group a rank


def test_space_splits_only_where_no_window_crosses_a_piece(conv_graph):
    graph, _ = conv_graph
    assert not any("S(2)" in t or "S(3)" in t for t in strategy_texts(graph, _conv(graph, "c2"), (2,)))  # 3x3, pad 1
    assert {"(S(2), R, R) -> S(2)", "(S(3), R, R) -> S(3)"} <= set(strategy_texts(graph, _conv(graph, "patch"), (2,)))
    assert "(S(2), R) -> S(2)" in strategy_texts(graph, _conv(graph, "same"), (2,))  # 1x1: pointwise in space
    # 8 wide in patches of 2 on 8 ranks: pieces of one pixel, not whole patches
    assert not any("S(2)" in t for t in strategy_texts(graph, _conv(graph, "patch"), (8,)))
    pools = nodes_of(graph, "aten.avg_pool2d.default")
    assert "(S(2)) -> S(2)" in strategy_texts(graph, pools[0], (2,))  # 2x2 windows stepping by 2
    assert "(S(2)) -> S(2)" not in strategy_texts(graph, pools[1], (2,))  # 3x3, stride 1: windows overlap


def test_batch_norm_splits_channels_or_the_batch_with_its_statistics_summed(conv_graph):
    graph, _ = conv_graph
    train, evaluating = nodes_of(graph, "aten.batch_norm.default")
    assert train.args["training"] and not evaluating.args["training"]
    # in training the running statistics are read whole (every rank updates every channel)
    assert "(S(1), S(0), S(0), R, R) -> S(1)" in strategy_texts(graph, train, (2,))
    assert "(S(1), S(0), S(0), S(0), S(0)) -> S(1)" in strategy_texts(graph, evaluating, (2,))
    batch = next(s for s in node_strategies(graph, train, (2, 2)) if str(s) == "(S(0)S(1), RS(0), RS(0), RR, RR) -> S(0)S(1)")
    chosen = {n.name: node_strategies(graph, n, (2, 2))[0] for n in graph.nodes}
    chosen[train.name] = batch
    seen = [c for c in collectives(graph, chosen, MeshSpec.of((2, 2)), train=True)
            if c.at == train.name and c.kind == "all_reduce"]  # (its output gathered whole for the graph's output)
    local, whole = 8 // 2, 8  # channels a rank holds (split over the second axis), all channels
    assert [(c.phase, c.kind, c.mesh_axis, c.bytes) for c in seen] == [
        ("forward", "all_reduce", "dp", (local + 1) * 4),  # the sums and the count, over the batch axis
        ("forward", "all_reduce", "dp", local * 4),  # the centred sums of squares
        ("forward", "all_reduce", "tp", 2 * whole * 4),  # the running statistics, over the channel axis
        ("backward", "all_reduce", "dp", 2 * local * 4),  # the input gradient's two sums
    ], [str(c) for c in seen]


def _resnet(batch: int, size: int):
    from transformers import ResNetConfig, ResNetForImageClassification

    # ResNet-50's widths (bottleneck blocks of 256 to 2048 channels), one block per stage; float32
    # convolutions priced without TF32 (in TF32 they are cheap enough to leave whole at these sizes)
    config = ResNetConfig(depths=[1, 1, 1, 1])
    with torch.device("meta"):
        model = ResNetForImageClassification(config).train()
    graph = autotp.capture(model, (torch.randn(batch, 3, size, size, device="meta"),))
    return graph, plan_graph(graph, (8,), h100_without_tf32())


def test_a_resnet_at_a_large_batch_is_planned_data_parallel():
    # at 256 images the last block split by channels (its input gathered, its output moved back to
    # the batch split by one all-to-all) prices within 0.1% of the batch split; 512 is past the tie
    graph, plan = _resnet(512, 224)
    convs = [n for n in graph.ops() if n.target in ops.CONVOLUTIONS]
    norms = nodes_of(graph, "aten.batch_norm.default")
    assert len(convs) == len(norms) == 17
    for node in convs + norms:  # every convolution and batch norm works on its piece of the batch
        assert plan.strategy(node.name).inputs[0] == (S(0),), (node.name, plan.strategy(node.name))
    assert set(plan.module_styles()[n.module_path] for n in convs) == {"batch"}
    # one gradient reduction per weight read by a batch-split op; nothing activation-sized moves
    weights = {n.name for n in graph.nodes if n.role == "parameter"}
    reduced = [c for c in plan.collectives() if c.phase == "backward" and c.at in weights]
    assert len(reduced) == len({c.at for c in reduced}) and len(reduced) >= 3 * 17, len(reduced)
    smallest = min(n.output.nbytes for n in convs) / 8  # a rank's piece of the smallest activation
    moved = [c for c in plan.collectives() if c.at not in weights]
    assert all(c.bytes < smallest for c in moved), [str(c) for c in moved if c.bytes >= smallest]


def test_a_resnet_at_batch_one_on_large_images_splits_channels():
    graph, plan = _resnet(1, 1024)
    convs = [n for n in graph.ops() if n.target in ops.CONVOLUTIONS]
    split = [n for n in convs if any(p is not None and p != (R,) for p in plan.strategy(n.name).inputs)]
    flops = sum(n.flops for n in convs)
    assert sum(n.flops for n in split) > 0.5 * flops, [(n.module_path, str(plan.strategy(n.name))) for n in convs]
    assert {plan.module_styles()[n.module_path] for n in split} & {"colwise", "rowwise"}


def test_a_unet_at_batch_one_on_large_images_splits_its_convolutions_and_attention():
    """Stable Diffusion 1.5's UNet, its first two widths (one layer per block: a cross-attention block
    at 320 channels, a plain one at 640, the attending middle block) on a 1024² image (128² latents),
    batch 1: no batch to split, weights the planner may split. Nearly every FLOP runs on a piece
    (channels of the convolutions, heads or rows of attention), and the step is under half that of the
    best plan that keeps every weight whole (which can still split rows and space). Float32
    convolutions are priced without TF32, as a program that turns it off runs them. (The two deeper
    widths repeat these blocks at a quarter of the space and doubled the test's time.)"""
    diffusers = pytest.importorskip("diffusers")
    with torch.device("meta"):
        model = diffusers.UNet2DConditionModel(
            cross_attention_dim=768, layers_per_block=1, block_out_channels=(320, 640),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D")).train()
    inputs = {"sample": torch.randn(1, 4, 128, 128, device="meta"), "timestep": torch.tensor([10], device="meta"),
              "encoder_hidden_states": torch.randn(1, 77, 768, device="meta")}
    graph = autotp.capture(model, inputs)
    plan = plan_graph(graph, (8,), h100_without_tf32())
    whole = plan_graph(graph, (8,), h100_without_tf32(), pin={p.fqn: "R" for p in graph.parameters})
    convs = [n for n in graph.ops() if n.target in ops.CONVOLUTIONS]
    split = [n for n in convs if any(p is not None and p != (R,) for p in plan.strategy(n.name).inputs)]
    assert sum(n.flops for n in split) > 0.95 * sum(n.flops for n in convs)
    assert {plan.module_styles()[n.module_path] for n in split} >= {"colwise", "rowwise"}
    on_pieces = sum(n.flops for n in graph.ops() if any(p is not None and p != (R,) for p in plan.strategy(n.name).inputs))
    assert on_pieces > 0.99 * sum(n.flops for n in graph.ops())
    assert plan.predicted_time().total_s < 0.5 * whole.predicted_time().total_s


def test_a_segmentation_model_at_batch_one_splits_attention_by_query_rows():
    """SegFormer-B0's widths (one layer per stage, B0 has two alike) on a 1024² image, batch 1: its
    first stage attends with one head over 65536 query rows (keys spatially reduced): no batch or
    heads to split, so the rows are, and the step comes in well under one device's."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, depths=[1, 1, 1, 1])
    with torch.device("meta"):
        model = SegformerForSemanticSegmentation(config).train()
    graph = autotp.capture(model, {"pixel_values": torch.randn(1, 3, 1024, 1024, device="meta")})
    plan = plan_graph(graph, (8,), h100_without_tf32())
    one = plan_graph(graph, (1,), h100_without_tf32())
    attention = nodes_of(graph, "aten.scaled_dot_product_attention.default")
    single_head = [n for n in attention if n.input_infos[0].shape[1] == 1]
    assert single_head and all(plan.strategy(n.name).inputs[:3] == ((S(2),), (R,), (R,)) for n in single_head), [
        str(plan.strategy(n.name)) for n in single_head]
    assert plan.predicted_time().total_s < 0.85 * one.predicted_time().total_s
