"""Long sequences on paper: autotp's layout against torchtitan's context parallelism, priced alike.

Llama 3 8B (``examples.models.hf_llama``: 32 layers, hidden 4096, ffn 14336, 32 heads, 8 kv heads,
vocabulary 128256; bf16 weights, AdamW) at batch 1 x ``S`` tokens, ``S`` in 32768, 65536, 131072
and 262144, trained on 8 H100 (``h100-sxm``), on the meta device (no process, no memory).

* ``autotp``: ``autotp.plan(model, 8, inputs, pipeline=True)``, the layout search's choice
  (pipeline x data x tensor, recompute and ZeRO chosen with it; at batch 1 the 8 ranks split the
  sequence, heads or features), its predicted step and peak per device;
* ``torchtitan``: torchtitan's Llama 3 8B recipe (``llama3_8b.toml``: FSDP over every rank) with
  ``context_parallel_degree = 8`` on the same 8 ranks, as its ``context_parallel`` defaults run it:
  every activation split along the sequence, causal attention on load-balanced (head-tail) chunks,
  keys and values all-gathered (``context_parallel_rotate_method = "allgather"``). Priced by the
  same search (``autotp.planning.search.pipeline_search.price_layout``): the model planned on
  ``(8,)`` with every weight pinned whole (``pin=`` ``"R"``: no tensor parallelism, so the ILP splits
  the activations, and the attention offered its balanced causal rows alone, as torchtitan runs it:
  not autotp's rings nor the heads split) is the context
  axis's plan, and FSDP is that plan's ZeRO 3 over a data axis of 8, priced on the same node's link
  (the weights' gathers and the gradients' reduce-scatters beside the compute, each layer a unit,
  as FSDP2 runs them). The recipe's selective recompute (``selective_ac_option = "op"``) is not a
  layout autotp prices: the hand layout is priced as published without recompute, then with every
  layer recomputed where that does not fit (the row says so).

Both step the same tokens with the same cost model; the ratio autotp / torchtitan is printed (goal
<= 1.0). With ``labels=`` a Hugging Face model returns its logits whole beside the loss; where
either layout does not fit 80 GB so, both rows are planned with the loss as ``loss_fn=`` (the
logits stay split) and the row says so. A layout that does not fit even then says by how much.

    .venv/bin/python -m benchmarks.long_context_plan [--seq 32768 65536 131072 262144]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Optional

import torch
import torch.nn.functional as F

from benchmarks.long_context import attention_strategies
from benchmarks.plan_3d import AS_PUBLISHED_OR_FITTED, HARDWARE, SHAPES

DEVICES = 8
SEQS = (32768, 65536, 131072, 262144)
# torchtitan's llama3_8b.toml (FSDP over every rank) with context_parallel_degree 8 on the same ranks:
# the context axis is the planned axis of 8, FSDP its ZeRO 3 over a data axis of 8 on the same node
HAND = dict(pp=1, dp=DEVICES, tp=DEVICES, schedule="none", stages_per_rank=1, micro_batch_size=1, micro_batches=1,
            zero=3, recompute=False)


def cross_entropy(output, targets: torch.Tensor) -> torch.Tensor:
    """The loss as ``loss_fn=``: next-token cross-entropy on the model's logits, as its own loss."""
    logits = output.logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets[:, 1:].reshape(-1))


def model_at(seq: int, shape: Optional[dict] = None):
    """The model (``shape``: ``hf_llama`` kwargs, default Llama 3 8B) on meta in bf16, train mode, and its ids."""
    from examples import models as M

    model, (ids,) = M.hf_llama(**(shape or SHAPES["8b"]), seq=seq, batch=1, device="meta", dtype=torch.bfloat16)
    return model.train(), ids


def inputs_of(ids: torch.Tensor, split_loss: bool) -> tuple:
    """``(inputs, loss_fn)``: the ids as their labels (the model's loss), or the loss as ``loss_fn=``."""
    return ((ids, ids), cross_entropy) if split_loss else ({"input_ids": ids, "labels": ids}, None)


def hand_units(model, inputs, loss_fn, profile, devices: int):
    """The context axis's plan on ``(devices,)`` (every weight pinned whole, no recompute: the search
    adds recompute) read by unit of the stack, and its attention's strategies."""
    import autotp
    from autotp.planning.choices import strategies
    from autotp.planning.planner import plan_graph
    from autotp.planning.search.pipeline_search import units_of_plan
    from autotp.tracing.loss import WithLoss
    from autotp.tracing.repeats import find_stacks

    traced = WithLoss(model, loss_fn) if loss_fn is not None else model
    stack = max(find_stacks(traced), key=lambda s: s.count)
    graph = autotp.capture(traced, inputs, unroll=True)
    offered = strategies.node_strategies

    def torchtitan_s(*args):  # the attention as torchtitan's "allgather" rotation runs it: balanced rows
        out = offered(*args)
        balanced = [s for s in out if s.variant == "balanced"]
        return balanced or out

    strategies.node_strategies = torchtitan_s
    try:
        plan = plan_graph(graph, (devices,), profile, "train", 1e18, recompute=False, explainable=False,
                          pin={n: "R" for n, _ in model.named_parameters()})
    finally:
        strategies.node_strategies = offered
    return units_of_plan(plan, graph, [stack.layer(i) for i in range(stack.count)]), attention_strategies(plan)


def price_hand(model, inputs, loss_fn, profile, devices: int = DEVICES, hand: Optional[dict] = None):
    """The hand layout priced (as published; where it does not fit, with every layer recomputed):
    ``(Candidate, note, attention strategies)``; the candidate's ``step_s`` is None where nothing fits."""
    from autotp.planning.search.pipeline_search import Candidate, price_layout

    hand = dict(hand or HAND, dp=devices, tp=devices)
    units, attention = hand_units(model, inputs, loss_fn, profile, devices)
    assert attention and all(a.startswith("balanced causal rows") for a in attention), (
        f"the context axis's plan does not split the attention as torchtitan's load-balanced chunks: {attention}")
    # FSDP over the context axis's own ranks: the data axis priced on the link inside the node
    same_node = dataclasses.replace(profile, devices_per_node=max(profile.devices_per_node, devices * devices))
    budget = float(profile.device.memory_bytes)
    for changed, note in AS_PUBLISHED_OR_FITTED:
        priced, _ = price_layout(Candidate(**{**hand, **changed}), units, same_node, budget)
        if priced.step_s is not None:
            return priced, note, attention
    return priced, " (no fit)", attention


def row(seq: int, shape: Optional[dict] = None, devices: int = DEVICES) -> dict:
    """autotp's layout and the hand layout at ``seq`` tokens, each with ``labels=`` where both fit,
    else both with ``loss_fn=``."""
    import autotp
    from cost_models import resolve_hardware

    profile = resolve_hardware(HARDWARE)
    model, ids = model_at(seq, shape)
    for split_loss in (False, True):
        inputs, loss_fn = inputs_of(ids, split_loss)
        t0 = time.perf_counter()
        try:
            chosen = autotp.plan(model, devices, inputs, hardware=HARDWARE, loss_fn=loss_fn, pipeline=True).pipeline.chosen
            error = ""
        except autotp.MemoryBudgetError as err:
            chosen, error = None, str(err).split(". ")[0]
        search_s = time.perf_counter() - t0
        hand, note, attention = price_hand(model, inputs, loss_fn, profile, devices)
        if (chosen is not None and hand.step_s is not None) or split_loss:
            break
    return dict(seq=seq, loss="loss_fn=" if split_loss else "labels=", chosen=chosen, error=error, hand=hand,
                note=note, attention=attention, search_s=search_s)


def lines_of(r: dict) -> list[str]:
    c, h = r["chosen"], r["hand"]
    hand_s = h.step_s if h.step_s is not None else float("nan")
    ratio = f"{c.step_s / hand_s:.2f}" if c is not None and h.step_s is not None else "-"
    out = [f"{r['seq']:>7} {r['loss']:>9}  autotp {c.describe() if c is not None else r['error']}",
           f"{'':>18}  torchtitan CP {DEVICES} x FSDP {DEVICES}{r['note']}; its attention "
           f"{'; '.join(r['attention'])}"]
    for who, x in (("autotp", c), ("torchtitan", h)):
        if x is None:
            continue
        if x.step_s is None:
            out.append(f"{'':>18}  {who}: does not fit 80 GB: needs {x.peak_bytes / 2**30:.1f} GiB per device")
        else:
            out.append(f"{'':>18}  {who}: step {x.step_s:.2f} s (compute {x.compute_s:.2f}, communication "
                       f"{x.communication_s:.2f}), peak {x.peak_bytes / 2**30:.1f} GiB")
    out.append(f"{'':>18}  autotp / torchtitan = {ratio}; search {r['search_s']:.1f} s")
    return out


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=list(SEQS))
    args = ap.parse_args(argv)
    print(f"Llama 3 8B (HF LlamaForCausalLM on meta, bf16, AdamW), batch 1, {DEVICES} x {HARDWARE}; training step")
    for seq in args.seq:
        print("\n".join(lines_of(row(seq))), flush=True)


if __name__ == "__main__":
    main()
