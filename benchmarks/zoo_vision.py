"""autotp beyond language models: convnets, vision and audio transformers, a state-space model and
diffusion models, one row per model (the companion of benchmarks/zoo.py, which covers language
models).

Each model is built from its config class (``transformers``, or ``diffusers`` for the diffusion
rows: ``pip install diffusers``; without it those rows say "skipped") at the widths of a well-known
checkpoint, written out below, on the meta device; nothing comes from the hub. It is planned for a
(8,) mesh of ``h100-sxm`` in train mode (float32, the device's memory as the budget) on the example
batch of its entry. Per row:

* ``autotp``: the plan's module styles, counted (``batch`` is data parallel, ``colwise`` /
  ``rowwise`` split a weight, ``grouped`` a grouped convolution by whole groups), and its
  predicted step;
* ``/ data parallel``: autotp's predicted step over the step of the same graph with every weight
  pinned whole (``R``), the activations then placed by the planner: data parallelism, the layout
  everyone starts from, priced by the same cost model;
* ``/ hand TP``: over the step with the family's hand-written tensor-parallel layout pinned: for
  a transformer, Megatron's (attention's q, k, v and the MLP's first layer colwise, the attention
  output and the MLP's second layer rowwise); for a convnet, a block's first convolution split by
  output channels and its second by input channels, as Megatron splits an MLP; goal <= 1.0 on both;
* ``plan s``: capture and planning time on this machine;
* ``2 ranks``: the model at tiny widths (the entry's ``tiny`` config) in float64 (a deep convnet's
  float32 rounding alone comes near the tolerance: MobileNetV2's 35 batch norms), in train mode with
  dropout and random label drops off, planned for 2 ``cpu-gloo`` ranks under a budget 5% above the least one without recompute (so
  the plan must shard), one step on 2 threaded ranks against one process: the output, every
  parameter's gradient of ``(output - target).pow(2).mean()`` (a fixed random target) and every
  buffer after the step (batch norm's running statistics), rtol 1e-4 and atol 1e-5 x the largest
  reference value.

wav2vec2 is traced with ``mask_time_prob=0`` and ``layerdrop=0``: in training it draws the masked
time spans on the host (numpy) and decides on the host whether to skip a layer, neither of which a
trace can hold. Mamba runs its reference scan (no CUDA kernels here): a Python loop over the
sequence, unrolled into the graph, hence its sequence of 128 and its planning time. Progress goes to stderr, the table to
stdout.

    .venv/bin/python -m benchmarks.zoo_vision [--models resnet50,vit,...] [--no-exact] [--markdown]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import re
import sys
import time
from collections import Counter
from typing import Any, Callable, Optional

import torch

from benchmarks.zoo import TINY_BUDGET_SCALE, compare, full_gradients, short_error, table
from examples.models import output_tensor
from examples.ranks import run_threads

MESH = (8,)
HARDWARE = "h100-sxm"
TINY_DTYPE = torch.float64  # the exactness check: rounding far below its tolerance, so a miss is a bug


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str  # the --models key
    checkpoint: str  # whose widths ``real`` are
    kind: str  # convnet, vision, multimodal, audio, dense, ssm, diffusion
    package: str  # transformers or diffusers
    model: str  # the model class
    real: dict  # its config at the checkpoint's widths
    tiny: dict  # its config for the exactness check
    inputs: Callable[[bool, Any], dict]  # (tiny, config) -> example keyword inputs (on meta where not tiny)
    config: Optional[str] = None  # transformers' config class (diffusers models take the config as keywords)
    layout: Optional[dict] = None  # the hand TP layout: {module name pattern: "colwise" | "rowwise"}
    output: Callable[[Any], torch.Tensor] = output_tensor


def _images(batch: int, size: int, tiny_batch: int = 4, tiny_size: int = 32, channels: int = 3):
    def make(tiny: bool, config: Any) -> dict:
        b, s = (tiny_batch, tiny_size) if tiny else (batch, size)
        return {"pixel_values": _randn(tiny, b, channels, s, s)}
    return make


def _randn(tiny: bool, *shape: int) -> torch.Tensor:
    if tiny:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=TINY_DTYPE)
    return torch.randn(*shape, device="meta")


def _randint(tiny: bool, high: int, *shape: int) -> torch.Tensor:
    if tiny:
        return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(2))
    return torch.randint(0, high, shape, device="meta")


def _clip_inputs(tiny: bool, config: Any) -> dict:
    b, size = (4, config.vision_config.image_size) if tiny else (256, config.vision_config.image_size)
    tokens = 8 if tiny else 77
    return {"input_ids": _randint(tiny, config.text_config.vocab_size, b, tokens),
            "pixel_values": _randn(tiny, b, 3, size, size), "return_loss": True}


def _whisper_inputs(tiny: bool, config: Any) -> dict:
    b, tokens = (2, 6) if tiny else (32, 448)
    frames = 2 * config.max_source_positions
    return {"input_features": _randn(tiny, b, config.num_mel_bins, frames),
            "decoder_input_ids": _randint(tiny, config.vocab_size, b, tokens)}


def _unet_inputs(tiny: bool, config: Any) -> dict:
    b, size = (2, 16) if tiny else (8, 64)  # 512 x 512 pixels in Stable Diffusion's latents
    return {"sample": _randn(tiny, b, 4, size, size), "timestep": _randint(tiny, 1000, b),
            "encoder_hidden_states": _randn(tiny, b, 77 if not tiny else 7, config["cross_attention_dim"])}


def _dit_inputs(tiny: bool, config: Any) -> dict:
    b = 2 if tiny else 32
    return {"hidden_states": _randn(tiny, b, config["in_channels"], config["sample_size"], config["sample_size"]),
            "timestep": _randint(tiny, 1000, b), "class_labels": _randint(tiny, config["num_embeds_ada_norm"], b)}


_VIT_LAYOUT = {"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
               "attention.o_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
_CLIP_LAYOUT = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                "self_attn.out_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
_BART_LIKE = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
              "self_attn.out_proj": "rowwise", "encoder_attn.q_proj": "colwise", "encoder_attn.k_proj": "colwise",
              "encoder_attn.v_proj": "colwise", "encoder_attn.out_proj": "rowwise", "fc1": "colwise", "fc2": "rowwise"}
_DIFFUSERS_ATTENTION = {"attn1.to_q": "colwise", "attn1.to_k": "colwise", "attn1.to_v": "colwise",
                        "attn1.to_out.0": "rowwise", "attn2.to_q": "colwise", "attn2.to_k": "colwise",
                        "attn2.to_v": "colwise", "attn2.to_out.0": "rowwise", "ff.net.0.proj": "colwise",
                        "ff.net.2": "rowwise"}
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

ENTRIES = (
    Entry("resnet50", "ResNet-50", "convnet", "transformers", "ResNetForImageClassification", {},
          dict(embedding_size=16, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1], num_labels=10),
          _images(256, 224), "ResNetConfig",
          layout={"layer.0.convolution": "colwise", "layer.1.convolution": "rowwise"}),
    Entry("convnext", "ConvNeXt-T", "convnet", "transformers", "ConvNextForImageClassification",
          dict(hidden_sizes=[96, 192, 384, 768], depths=[3, 3, 9, 3]),
          dict(hidden_sizes=[16, 16, 32, 32], depths=[1, 1, 1, 1], num_labels=10),
          _images(256, 224), "ConvNextConfig", layout={"pwconv1": "colwise", "pwconv2": "rowwise"}),
    Entry("mobilenet_v2", "MobileNetV2-1.0", "convnet", "transformers", "MobileNetV2ForImageClassification",
          dict(classifier_dropout_prob=0.0), dict(depth_multiplier=0.35, image_size=32, num_labels=10,
                                                  classifier_dropout_prob=0.0),
          _images(256, 224), "MobileNetV2Config",
          layout={"expand_1x1.convolution": "colwise", "reduce_1x1.convolution": "rowwise"}),
    Entry("vit", "ViT-B/16", "vision", "transformers", "ViTForImageClassification", dict(_NO_DROPOUT),
          dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
               patch_size=8, num_labels=10, **_NO_DROPOUT),
          _images(256, 224), "ViTConfig", layout=_VIT_LAYOUT),
    Entry("swin", "Swin-T", "vision", "transformers", "SwinForImageClassification", dict(_NO_DROPOUT),
          dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
               num_labels=10, drop_path_rate=0.0, **_NO_DROPOUT),
          _images(256, 224), "SwinConfig", layout=_VIT_LAYOUT),
    Entry("clip", "CLIP ViT-B/32 (both towers, contrastive loss)", "multimodal", "transformers", "CLIPModel", {},
          dict(text_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=1,
                                vocab_size=100, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
                                pad_token_id=1),
               vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=1,
                                  image_size=16, patch_size=4), projection_dim=16),
          _clip_inputs, "CLIPConfig", layout=_CLIP_LAYOUT, output=lambda out: out.loss),
    Entry("whisper", "Whisper-base", "audio", "transformers", "WhisperForConditionalGeneration",
          dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
               encoder_ffn_dim=2048, decoder_ffn_dim=2048),
          dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=8, vocab_size=100,
               max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
               suppress_tokens=None, begin_suppress_tokens=None),
          _whisper_inputs, "WhisperConfig", layout=_BART_LIKE),
    Entry("wav2vec2", "wav2vec2-base", "audio", "transformers", "Wav2Vec2Model",
          dict(mask_time_prob=0.0, layerdrop=0.0, **_NO_DROPOUT),
          dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
               conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
               mask_time_prob=0.0, layerdrop=0.0, attention_dropout=0.0),
          lambda tiny, config: {"input_values": _randn(tiny, *((2, 400) if tiny else (16, 160000)))},
          "Wav2Vec2Config",
          layout={"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
                  "attention.out_proj": "rowwise", "feed_forward.intermediate_dense": "colwise",
                  "feed_forward.output_dense": "rowwise"}),
    Entry("segformer", "SegFormer-B0 (512 x 512)", "dense", "transformers", "SegformerForSemanticSegmentation",
          dict(num_labels=150, **_NO_DROPOUT),
          dict(hidden_sizes=[8, 16, 16, 32], num_attention_heads=[1, 2, 2, 4], depths=[1, 1, 1, 1],
               decoder_hidden_size=16, num_labels=4, classifier_dropout_prob=0.0, drop_path_rate=0.0, **_NO_DROPOUT),
          _images(16, 512), "SegformerConfig", layout=_VIT_LAYOUT),
    Entry("mamba", "Mamba-130m", "ssm", "transformers", "MambaModel",
          dict(hidden_size=768, num_hidden_layers=24, state_size=16, vocab_size=50280),
          dict(hidden_size=32, num_hidden_layers=2, state_size=4, vocab_size=64, expand=2, conv_kernel=4),
          lambda tiny, config: {"input_ids": _randint(tiny, config.vocab_size, *((2, 8) if tiny else (8, 128)))},
          "MambaConfig", layout={"mixer.in_proj": "colwise", "mixer.out_proj": "rowwise"}),
    Entry("unet", "Stable Diffusion 1.5 UNet", "diffusion", "diffusers", "UNet2DConditionModel",
          dict(cross_attention_dim=768),
          dict(sample_size=16, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
               down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), attention_head_dim=8,
               up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=8),
          _unet_inputs, layout=_DIFFUSERS_ATTENTION, output=lambda out: out.sample),
    Entry("dit", "DiT-XL/2 (256 x 256)", "diffusion", "diffusers", "DiTTransformer2DModel",
          dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
               sample_size=32, patch_size=2, num_embeds_ada_norm=1000),
          dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
               sample_size=8, patch_size=2, num_embeds_ada_norm=10),
          _dit_inputs, layout=_DIFFUSERS_ATTENTION, output=lambda out: out.sample),
)


# ------------------------------------------------------------------------------------ building

def missing(entry: Entry) -> Optional[str]:
    try:
        module = importlib.import_module(entry.package)
    except ImportError:
        return f"{entry.package} is not installed"
    lacking = [c for c in (entry.model, entry.config) if c and not hasattr(module, c)]
    return f"{entry.package} has no {lacking[0]}" if lacking else None


def build(entry: Entry, tiny: bool, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    """``(model in train mode, example kwargs)``: on meta at the checkpoint's widths, or seeded on CPU
    at tiny ones with every dropout off (the check compares values)."""
    module = importlib.import_module(entry.package)
    kwargs = entry.tiny if tiny else entry.real
    if tiny:
        torch.manual_seed(seed)
    with torch.device("cpu" if tiny else "meta"):
        cls = getattr(module, entry.model)
        if entry.config:
            config = getattr(module, entry.config)(**kwargs)
            model = cls(config)
        else:
            model = cls(**kwargs)
            config = dict(model.config)
    if tiny:
        model = model.to(TINY_DTYPE)
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
            if isinstance(getattr(m, "dropout_prob", None), float):  # a label dropped at random (DiT)
                m.dropout_prob = 0.0
    return model.train(), entry.inputs(tiny, config)


# ------------------------------------------------------------------------------ reference layouts

def _pattern(text: str) -> re.Pattern:
    return re.compile(r"(^|\.)" + r"\.".join(re.escape(p) for p in text.split(".")) + "$")


def hand_pin(entry: Entry, model: torch.nn.Module) -> dict[str, str]:
    """``{parameter fqn: placement}`` of the entry's hand layout on a 1-axis mesh: a linear or
    convolution weight colwise ``S(0)`` (its bias ``S(0)``), rowwise ``S(1)``."""
    rules = [(_pattern(k), v) for k, v in (entry.layout or {}).items()]
    pin: dict[str, str] = {}
    for owner, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            continue
        style = next((s for rx, s in rules if rx.search(owner)), None)
        if style is None or getattr(module, "groups", 1) != 1:
            continue
        pin[f"{owner}.weight"] = "S(0)" if style == "colwise" else "S(1)"
        if style == "colwise" and module.bias is not None:
            pin[f"{owner}.bias"] = "S(0)"
    names = {n for n, _ in model.named_parameters()}  # a tied weight is pinned under its first name
    return {k: v for k, v in pin.items() if k in names}


def plan_real(entry: Entry, row: dict) -> None:
    import autotp
    from autotp.planning.planner import plan_graph

    t0 = time.perf_counter()
    model, inputs = build(entry, tiny=False)
    graph = autotp.capture(model, inputs)
    plan = plan_graph(graph, MESH, HARDWARE, "train")
    row["plan_s"] = f"{time.perf_counter() - t0:.1f}"
    styles = Counter(plan.module_styles().values())
    step = plan.predicted_time().total_s
    row["status"] = ", ".join(f"{k} {v}" for k, v in styles.most_common()) + f"; {step * 1e3:.1f} ms"
    row["ok"] = True
    whole = {p.fqn: "R" for p in graph.parameters}
    for key, pin in (("dp", whole), ("hand", hand_pin(entry, model))):
        if not pin:
            row[key] = "-"
            continue
        try:
            ref = plan_graph(graph, MESH, HARDWARE, "train", pin=pin).predicted_time().total_s
        except Exception as err:  # noqa: BLE001 - a layout that does not fit is that cell
            row[key] = short_error(err, 60)
            continue
        ratio = step / ref
        row[key] = f"{ratio:.3f} ({ref * 1e3:.1f} ms" + (f", {len(pin)} pinned)" if key == "hand" else ")")
        row["ok"] = row["ok"] and ratio <= 1.0 + 1e-9


# ---------------------------------------------------------------------------------- exactness

def _step(model: torch.nn.Module, inputs: dict, output: Callable) -> tuple[dict, dict, dict]:
    out = output(model(**inputs))
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out - target).pow(2).mean().backward()
    grads = full_gradients(model)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()
               if not name.startswith("_autotp") and b.is_floating_point()}
    return {"output": out.detach()}, grads, buffers


def _rank(rank: int, world: int, graph, plan, model, inputs, output) -> tuple[dict, dict, dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return _step(build_parallel_module(graph, plan, mesh, copy.deepcopy(model)), inputs, output)


def check_exact(entry: Entry, world: int = 2) -> str:
    """The tiny model on ``world`` threaded ranks under a budget that forces sharding, against one
    process: output, gradients and buffers after one training step."""
    import autotp
    from autotp.planning.planner import plan_graph

    model, inputs = build(entry, tiny=True)
    graph = autotp.capture(model, inputs)  # in this thread: torch.export must not trace beside the ranks
    try:
        plan_graph(graph, (world,), "cpu-gloo", "train", 1.0, recompute=False)
        budget = None
    except autotp.MemoryBudgetError as err:
        budget = int(err.minimum_bytes * TINY_BUDGET_SCALE) + 1
    plan = plan_graph(graph, (world,), "cpu-gloo", "train", budget, recompute=False)
    sharded = sum(p != "R" for p in plan.parameter_placements.values())
    what = f"{sharded}/{len(plan.parameter_placements)} sharded"
    ref = _step(copy.deepcopy(model), inputs, entry.output)
    scales = [max([t.abs().max().item() for t in part.values() if t is not None and t.numel()] + [1e-30])
              for part in ref]
    worst, wrong = 0.0, []
    for got in run_threads(_rank, world, graph, plan, model, inputs, entry.output):
        for g, r, scale in zip(got, ref, scales):
            diff, bad = compare(g, r, scale)
            worst, wrong = max(worst, diff), wrong + bad
    if wrong:
        return f"WRONG {len(wrong)}: {wrong[0]}; {what}"
    return f"exact (max diff {worst:.1e} of the largest); {what}"


# ---------------------------------------------------------------------------------------- table

COLUMNS = (("model", "model"), ("kind", "kind"), ("status", "autotp: styles; step"), ("dp", "/ data parallel"),
           ("hand", "/ hand TP"), ("plan_s", "plan s"), ("exact", "2 ranks"))


def run_entry(entry: Entry, exact: bool) -> dict:
    row = {"model": f"{entry.name} ({entry.checkpoint})", "kind": entry.kind}
    lacking = missing(entry)
    if lacking:
        row["status"] = f"skipped: {lacking}"
        return row
    t0 = time.perf_counter()
    try:
        plan_real(entry, row)
    except Exception as err:  # noqa: BLE001 - one row's failure is that row's cell
        row["status"] = short_error(err)
    if exact:
        try:
            row["exact"] = check_exact(entry)
        except Exception as err:  # noqa: BLE001
            row["exact"] = short_error(err)
        row["is_exact"] = row["exact"].startswith("exact")
    _progress(f"  {time.perf_counter() - t0:.1f} s")
    return row


def render(rows: list[dict], markdown: bool, exact: bool) -> str:
    cols = [c for c in COLUMNS if exact or c[0] != "exact"]
    return table([[h for _, h in cols]] + [[str(r.get(k, "-")) for k, _ in cols] for r in rows], markdown)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="comma-separated subset of: " + ",".join(e.name for e in ENTRIES))
    parser.add_argument("--no-exact", action="store_true", help="skip the 2-rank exactness check")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    by_name = {e.name: e for e in ENTRIES}
    names = args.models.split(",") if args.models else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(by_name)}")
    exact = not args.no_exact
    t0 = time.perf_counter()
    rows = []
    for name in names:
        _progress(f"{name} ...")
        rows.append(run_entry(by_name[name], exact))
    print(f"mesh {MESH} of {HARDWARE}, train, float32; batches as each entry gives"
          + ("; exactness at tiny widths on 2 threaded cpu-gloo ranks, one training step" if exact else ""))
    print(render(rows, args.markdown, exact))
    ok = sum(bool(r.get("ok")) for r in rows)
    text = f"{len(rows)} models: {ok} planned with autotp's step <= every reference's"
    if exact:
        text += f", {sum(bool(r.get('is_exact')) for r in rows)} exact on 2 ranks"
    print(text)
    print(f"wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
