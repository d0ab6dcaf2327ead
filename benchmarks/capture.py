"""Capture time and FLOP agreement on Llama 3 8B and 70B shapes (Hugging Face LlamaForCausalLM, meta device).

For each shape: build the model on meta, ``autotp.capture`` it, and count FLOPs three ways, side by
side in one run: autotp's graph (``OpGraph.total_flops``: causal attention at the T (T + 1) / 2
(query, key) pairs its kernel computes), PyTorch's ``FlopCounterMode`` over the exported program run
on meta inputs (every attention at the whole T x T square: compared with autotp's count plus the
square's masked part), and the closed formula ``2 * matmul params * tokens + 4 * D * T (T + 1) / 2``
per layer (attention's two products over the causal pairs).

    .venv/bin/python -m benchmarks.capture            # both shapes
    .venv/bin/python -m benchmarks.capture 8b         # one
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import autotp
from examples import models as M

SHAPES = {
    "8b": dict(n_layer=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256),
    "70b": dict(n_layer=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256),
}
SEQ, BATCH = 2048, 1


def formula_flops(n_layer: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int) -> float:
    kv = hidden // heads * kv_heads
    matmul_params = n_layer * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn) + hidden * vocab
    return 2.0 * matmul_params * SEQ * BATCH + n_layer * 4.0 * BATCH * (SEQ * (SEQ + 1) // 2) * hidden


def masked_square_flops(graph) -> float:
    """What FlopCounterMode counts of the attentions and autotp does not: the square's masked pairs."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sum(sdpa_flop_count(*(i.shape for i in n.input_infos[:3])) - n.flops for n in graph.ops()
               if n.target.endswith(("scaled_dot_product_attention.default", "masked_attention.default")))


def run(name: str) -> dict:
    import transformers.models.llama.modeling_llama  # noqa: F401 - import time is not build time

    shape = SHAPES[name]
    t0 = time.perf_counter()
    model, inputs = M.hf_llama(**shape, seq=SEQ, batch=BATCH, device="meta")
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = autotp.capture(model, inputs)
    capture_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        graph.exported.module()(*inputs)
    reference_s = time.perf_counter() - t0
    return dict(
        name=name, layers=shape["n_layer"], params=sum(p.numel() for p in model.parameters()), nodes=len(graph),
        build_s=build_s, capture_s=capture_s, reference_s=reference_s, autotp=graph.total_flops(),
        square=masked_square_flops(graph),
        counter=float(counter.get_total_flops()), formula=formula_flops(**shape),
    )


def main(names: list[str]) -> None:
    rows = [run(n) for n in names]
    head = (f"{'shape':<6} {'layers':>6} {'params':>8} {'nodes':>6} {'build s':>8} {'capture s':>10} "
            f"{'autotp TFLOP':>13} {'FlopCounter TFLOP':>18} {'(autotp+masked)/counter':>24} {'formula TFLOP':>14} "
            f"{'autotp/formula':>15}")
    print(f"HF LlamaForCausalLM on meta, batch {BATCH} x seq {SEQ}, float32; FLOPs of one forward")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['name']:<6} {r['layers']:>6} {r['params'] / 1e9:>7.2f}B {r['nodes']:>6} {r['build_s']:>8.1f} "
              f"{r['capture_s']:>10.1f} {r['autotp'] / 1e12:>13.2f} {r['counter'] / 1e12:>18.2f} "
              f"{(r['autotp'] + r['square']) / r['counter']:>24.6f} {r['formula'] / 1e12:>14.2f} "
              f"{r['autotp'] / r['formula']:>15.6f}")
    took = ", ".join(f"{r['name']} {r['reference_s']:.1f} s" for r in rows)
    print(f"(FlopCounter: FlopCounterMode over graph.exported.module() run on meta inputs; took {took})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shapes", nargs="*", metavar="SHAPE", help=f"of {sorted(SHAPES)} (default: both)")
    shapes = parser.parse_args().shapes
    if unknown := [n for n in shapes if n not in SHAPES]:
        parser.error(f"unknown shape(s) {unknown}: expected some of {sorted(SHAPES)}")
    main(shapes or list(SHAPES))
