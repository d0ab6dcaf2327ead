"""Llama 3 8B at long sequences on 8 and 16 H100, plan-only: what the layout search picks with a
context axis among its layouts (autotp/planning/search/context_axis.py), its predicted step and
memory per device, and how long the search took.

    python -m benchmarks.context_layouts [--only 131072x8] [--loss labels|loss_fn]

The model is built on the meta device (bf16, AdamW, batch 1); ``--loss labels`` gives the inputs
``labels=`` (the model's own loss: its logits returned whole beside it), ``loss_fn`` a cross-entropy
on the logits (the loss alone). Each row is one ``autotp.plan(model, devices, inputs,
hardware="h100-sxm", pipeline=True)``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import autotp
from examples import models

LLAMA_3_8B = dict(n_layer=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256)
ROWS = {f"{seq}x{devices}": (seq, devices) for seq in (131072, 262144) for devices in (8, 16)}


def _cross_entropy(output, target):
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(0, 1))


def row(name: str, loss: str = "loss_fn") -> dict:
    seq, devices = ROWS[name]
    model, (ids,) = models.hf_llama(**LLAMA_3_8B, seq=seq, batch=1, device="meta", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    if loss == "labels":
        plan = autotp.plan(model, devices, {"input_ids": ids, "labels": ids}, hardware="h100-sxm", pipeline=True)
    else:
        plan = autotp.plan(model, devices, {"input_ids": ids, "targets": ids}, hardware="h100-sxm", pipeline=True,
                           loss_fn=_cross_entropy)
    return dict(name=name, chosen=plan.pipeline.chosen, plan=plan, search_s=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=sorted(ROWS), action="append")
    ap.add_argument("--loss", choices=("labels", "loss_fn"), default="loss_fn")
    args = ap.parse_args()
    print(f"Llama 3 8B on meta, bf16, AdamW, batch 1, hardware h100-sxm, pipeline=True, {args.loss}")
    print(f"{'row':<11} {'chosen':<72} {'step s':>7} {'peak GiB':>9} {'search s':>9}")
    for name in args.only or list(ROWS):
        try:
            r = row(name, args.loss)
        except autotp.MemoryBudgetError as err:
            print(f"{name:<11} {err}", flush=True)
            continue
        c = r["chosen"]
        print(f"{name:<11} {c.describe():<72} {c.step_s:7.2f} {c.peak_bytes / 2**30:9.1f} {r['search_s']:9.1f}",
              flush=True)
        for x in r["plan"].pipeline.candidates[1:4]:  # the runners-up
            step = f"{x.step_s:.2f} s" if x.step_s is not None else "-"
            print(f"            {x.describe()}: {step}, {x.peak_bytes / 2**30:.1f} GiB; {x.why}")


if __name__ == "__main__":
    main()
