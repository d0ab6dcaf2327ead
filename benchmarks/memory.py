"""Does the memory model predict what a step holds? Predicted against measured peak bytes per rank.

On 2 gloo ranks (CPU), a small Llama (``tiny_llama``: float32, dim 256, 8 heads, 4 kv heads, ffn
768, vocab 2048, batch 4 x 128 tokens, ``--layers`` layers) with its cross-entropy planned with it
(``loss_fn=``), eleven plans (:func:`plans`): replicated, Megatron (pinned), the planner's under a
roomy budget, at the least budget without recompute, tighter with recompute, sequence parallel
(the Megatron pins at the least budget they fit without recompute), every layer but one
recomputed, an inference plan (a forward without autograd), a Hugging Face Llama computing its
own loss (``labels=``), a Hugging Face Qwen3-MoE (16 experts, top 2, ``benchmarks/experts.py``
at the Llama's widths) with its experts whole on ranks (the stacked expert weights pinned ``S(0)``),
and a long sequence: a narrow Hugging Face Llama (``benchmarks/long_context.py``'s: hidden 64) at
1 x 4096 tokens with ``labels=``, where the sequence's activations are most of the step, as the
planner splits it and with every weight pinned whole (attention by balanced causal rows).

Each training row runs three steps (``zero_grad(set_to_none=True)``, forward and loss, backward,
``torch.optim.AdamW`` step) and measures the third under :class:`LiveBytes`, a
``TorchDispatchMode`` that counts every storage the step allocates until it is freed, on top of the
parameters, buffers, optimizer state and inputs that live across steps; the inference row measures
one forward the same way. It prints, per plan, the plan's ``memory_per_device()`` (parameters,
gradients, optimizer state, activations, and its peak over the phases of a step) and the measured
peak, with what was alive at the peak and in which phase, and their ratio.

    .venv/bin/python -m benchmarks.memory [--layers 2] [--foreach]
"""

from __future__ import annotations

import argparse
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from examples.ranks import run_ranks

MB = 1e6
KINDS = ("parameters", "optimizer", "gradients", "inputs", "other")
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
_ROWWISE = ("o_proj", "down_proj")


def _storages(t: torch.Tensor) -> list:
    """The storages that hold ``t`` (a DTensor: its local tensor's)."""
    out, todo = [], [t]
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            names, _ = x.__tensor_flatten__()
            todo += [getattr(x, n) for n in names if isinstance(getattr(x, n), torch.Tensor)]
        elif x.device.type != "meta":
            out.append(x.untyped_storage())
    return out


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive, by kind, and their peak. Each storage counts once (one Python
    object per storage: a weak reference to it fires when the storage is freed). What lived before
    the mode is registered with :meth:`track`; a parameter's gradient moves to ``gradients`` when
    autograd stores it; everything else a step allocates (activations, temporaries) is ``other``."""

    def __init__(self) -> None:
        super().__init__()
        self.alive: dict[int, list] = {}  # id(storage) -> [bytes, kind, weakref]
        self.now = dict.fromkeys(KINDS, 0)
        self.peak, self.at_peak, self.peak_phase = 0, dict(self.now), ""
        self.phase = "forward"
        self.hooks: list = []

    def _add(self, storage, kind: str) -> None:
        entry = self.alive.get(id(storage))
        if entry is not None:
            if kind != "other" and entry[1] != kind:  # re-labelled: a gradient, or state made in the step
                self.now[entry[1]] -= entry[0]
                self.now[kind] += entry[0]
                entry[1] = kind
            return
        size = storage.nbytes()
        key = id(storage)
        self.alive[key] = [size, kind, weakref.ref(storage, lambda _, key=key: self._free(key))]
        self.now[kind] += size
        total = sum(self.now.values())
        if total > self.peak:
            self.peak, self.at_peak, self.peak_phase = total, dict(self.now), self.phase

    def _free(self, key: int) -> None:
        entry = self.alive.pop(key, None)
        if entry is not None:
            self.now[entry[1]] -= entry[0]

    def track(self, t: torch.Tensor, kind: str) -> None:
        for storage in _storages(t):
            self._add(storage, kind)

    def track_training(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs) -> None:
        for p in module.parameters():
            self.track(p, "parameters")
            self.hooks.append(p.register_post_accumulate_grad_hook(lambda q: self.track(q.grad, "gradients")))
        for b in module.buffers():
            self.track(b, "parameters")
        for state in optimizer.state.values() if optimizer is not None else ():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self.track(v, "optimizer")
        for t in inputs:
            self.track(t, "inputs")
        self.peak = sum(self.now.values())
        self.at_peak = dict(self.now)

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs local ops, which come back here
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t, "other")
        return out


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss the plans price and the steps run (``loss_fn=``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def targets_of(inputs) -> torch.Tensor:
    return torch.randint(0, 2048, inputs[0].shape, generator=torch.Generator().manual_seed(1))


def build(layers: int):
    from examples.models import tiny_llama

    return tiny_llama(batch=4, seq=128, n_layer=layers, dim=256, n_head=8, n_kv_head=4, ffn_dim=768, vocab=2048)


def hf_llama(layers: int):
    """A Hugging Face Llama built from its config (float32), with its token ids as labels: the model
    computes its own cross-entropy (shifted by one) and returns the loss beside the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=2048, max_position_embeddings=256)
    ids = torch.randint(0, 2048, (4, 128), generator=torch.Generator().manual_seed(2))
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def hf_moe(layers: int):
    """A Hugging Face Qwen3-MoE (``benchmarks/experts.py``'s model: 16 experts, top 2, hidden 256,
    vocabulary 2048, batch 4 x 128), its token ids as labels."""
    import dataclasses

    from benchmarks import experts

    return experts.build(dataclasses.replace(experts.FULL, layers=layers, batch=4, seq=128))


LONG_SEQ = 4096


def hf_long(layers: int):
    """A narrow Hugging Face Llama at a long sequence (``benchmarks/long_context.py``'s model: hidden
    64, vocabulary 128, batch 1 x ``LONG_SEQ`` tokens), its token ids as labels: the activations of
    the sequence are most of what a step holds."""
    import dataclasses

    from benchmarks import long_context

    return long_context.build(dataclasses.replace(long_context.Size(), layers=layers, seq=LONG_SEQ))


HF_MODELS = {"hf": hf_llama, "hf-moe": hf_moe, "long": hf_long}


def plans(layers: int) -> dict[str, tuple[str, str]]:
    """The plans, as (model kind, plan JSON), made once on the first rank: on the tiny Llama with its
    cross-entropy planned with it (``loss_fn=``), ``replicated``, ``megatron``, ``free``, ``tight``,
    ``recompute`` (see the module docstring), ``sequence`` (the Megatron pins at the least budget
    they fit without recompute: the norms' tokens split along the sequence), ``all-but-one`` (the
    least budget any plan fits: every layer but one recomputes); ``inference`` (the model alone, in eval mode, the
    planner's choice); ``hf-llama`` (a Hugging Face Llama with ``labels=``, the planner's choice);
    ``moe-experts`` (a Hugging Face Qwen3-MoE with ``labels=``, its experts pinned whole on ranks);
    ``long-seq`` (a narrow Hugging Face Llama at ``LONG_SEQ`` tokens with ``labels=``, the planner's
    choice: attention by heads, the rest by sequence); ``long-rows`` (the same with every weight
    pinned whole: every activation split along the sequence, attention by balanced causal rows)."""
    import autotp
    from autotp.planning.planner import plan_graph
    from autotp.tracing.loss import WithLoss

    model, inputs = build(layers)
    graph = autotp.capture(WithLoss(model, cross_entropy), (*inputs, targets_of(inputs)))
    hw = "cpu-gloo"

    def least(**kwargs) -> float:
        try:
            plan_graph(graph, (2,), hw, memory_budget=1, **kwargs)
        except autotp.MemoryBudgetError as err:
            return err.minimum_bytes
        raise AssertionError("a budget of one byte was met")

    def fitting(budget: float, **kwargs):
        """The plan at the least of budget x 1.001, 1.01, 1.02, ... that a plan fits (the least any
        plan needs is a lower bound: the gathered copies a plan keeps depend on the plan)."""
        for scale in (1.001, 1.01, 1.02, 1.05, 1.1, 1.2, 1.5):
            try:
                return plan_graph(graph, (2,), hw, memory_budget=budget * scale, **kwargs)
            except autotp.MemoryBudgetError:
                continue
        raise AssertionError(f"no plan fits {budget * 1.5:.0f} bytes")

    megatron = {n: "S(0)" if any(k in n for k in _COLWISE) else "S(1)" if any(k in n for k in _ROWWISE) else "R"
                for n, _ in model.named_parameters()}
    tight_plan = fitting(least(recompute=False), recompute=False)
    tight = tight_plan.memory.budget_bytes
    out = {
        "replicated": plan_graph(graph, (2,), hw, memory_budget="100GB", recompute=False,
                                 pin={n: "R" for n, _ in model.named_parameters()}),
        "megatron": plan_graph(graph, (2,), hw, memory_budget="100GB", recompute=False, pin=megatron),
        "free": plan_graph(graph, (2,), hw, memory_budget="100GB"),
        "tight": tight_plan,
    }
    activations = out["tight"].memory.activations_bytes
    out["recompute"] = fitting(max(tight - activations / 4, least()))
    out["sequence"] = fitting(least(recompute=False, pin=megatron), recompute=False, pin=megatron)
    assert any(c.kind == "reduce_scatter" for c in out["sequence"].collectives()), "no sequence split"
    out["all-but-one"] = fitting(least())
    made = {name: ("loss", plan.to_json()) for name, plan in out.items()}
    made["inference"] = ("inference", plan_graph(autotp.capture(model, inputs, training=False), (2,), hw,
                                                 mode="inference", memory_budget="100GB").to_json())
    hf, kwargs = hf_llama(layers)
    made["hf-llama"] = ("hf", plan_graph(autotp.capture(hf, kwargs), (2,), hw, memory_budget="100GB").to_json())
    from benchmarks.experts import pins

    moe, kwargs = hf_moe(layers)
    made["moe-experts"] = ("hf-moe", plan_graph(autotp.capture(moe, kwargs), (2,), hw, memory_budget="100GB",
                                                pin=pins(moe)["experts"]).to_json())
    long, kwargs = hf_long(layers)
    long_graph = autotp.capture(long, kwargs)
    made["long-seq"] = ("long", plan_graph(long_graph, (2,), hw, memory_budget="100GB").to_json())
    made["long-rows"] = ("long", plan_graph(long_graph, (2,), hw, memory_budget="100GB",
                                            pin={n: "R" for n, _ in long.named_parameters()}).to_json())
    return made


def _rank(rank: int, world: int, layers: int, foreach) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    made = [plans(layers) if rank == 0 else None]
    dist.broadcast_object_list(made, src=0)
    results = {}
    for name, (kind, text) in made[0].items():
        plan = autotp.Plan.from_json(text)
        if kind in HF_MODELS:
            model, kwargs = HF_MODELS[kind](layers)
            pm = autotp.parallelize(model, mesh, kwargs, plan=plan)
            held = tuple(kwargs.values())
            output: list = []

            def run():  # as a user's loop holds it: the output, logits and all, lives through the backward
                output[:] = [pm(**kwargs)]
                return output[0].loss
        else:
            model, inputs = build(layers)
            targets = targets_of(inputs)
            if kind == "loss":
                pm = autotp.parallelize(model, mesh, (*inputs, targets), plan=plan, loss_fn=cross_entropy)
                held = (*inputs, targets)
                run = lambda: pm(*inputs, targets)  # noqa: E731
            else:
                pm = autotp.parallelize(model, mesh, inputs, plan=plan)
                held = inputs
        del model
        m = plan.memory_per_device()
        row = dict(predicted=(m.parameters_bytes, m.gradients_bytes, m.optimizer_bytes, m.activations_bytes,
                              m.total_bytes), recompute=len(plan.recompute),
                   styles=sorted(set(plan.module_styles().values()) - {"replicate"}), budget=m.budget_bytes)
        if kind == "inference":
            with torch.no_grad():
                pm(*inputs)
                meter = LiveBytes()
                meter.track_training(pm, None, held)
                with meter:
                    logits = pm(*inputs)
                del logits
        else:
            optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=foreach)

            def step(meter=None):
                optimizer.zero_grad(set_to_none=True)
                loss = run()
                if meter is not None:
                    meter.phase = "backward"
                loss.backward()
                if meter is not None:
                    meter.phase = "optimizer step"
                optimizer.step()

            step()
            step()  # the optimizer state exists from here on
            meter = LiveBytes()
            meter.track_training(pm, optimizer, held)
            with meter:
                step(meter)
            del optimizer
        results[name] = dict(row, peak=meter.peak, at_peak=meter.at_peak, phase=meter.peak_phase)
        del pm
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--foreach", action="store_true", help="AdamW(foreach=True) (default: torch's choice)")
    args = ap.parse_args()
    results = run_ranks(_rank, 2, args.layers, True if args.foreach else None)
    print(f"tiny_llama, {args.layers} layers, dim 256, batch 4 x 128, float32, its cross-entropy planned with it "
          f"(hf-llama: LlamaForCausalLM with labels=; moe-experts: Qwen3MoeForCausalLM, 16 experts top 2, with labels=, its experts whole on ranks; long-seq: LlamaForCausalLM hidden 64, 1 x {LONG_SEQ} tokens, with labels=); 2 gloo ranks; AdamW; MB per rank (rank 0; rank 1 in brackets "
          f"where it differs)")
    head = (f"{'plan':11} {'recompute':>9} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'predicted':>9} | "
            f"{'measured':>9} {'phase':>15} | {'params':>7} {'grads':>7} {'optim':>7} {'other':>7} | pred/meas")
    print(head)
    print("-" * len(head))
    for name, r in results[0].items():
        p = r["predicted"]
        a = r["at_peak"]
        other = r["peak"] - a["parameters"] - a["gradients"] - a["optimizer"]
        second = results[1][name]["peak"]
        also = f" ({second / MB:.2f})" if abs(second - r["peak"]) > 1e4 else ""
        print(f"{name:11} {r['recompute']:>9} {p[0] / MB:7.2f} {p[1] / MB:7.2f} {p[2] / MB:7.2f} {p[3] / MB:7.2f} "
              f"{p[4] / MB:9.2f} | {r['peak'] / MB:9.2f}{also} {r['phase']:>15} | {a['parameters'] / MB:7.2f} "
              f"{a['gradients'] / MB:7.2f} {a['optimizer'] / MB:7.2f} {other / MB:7.2f} | {p[4] / r['peak']:.2f}")
    print("other = activations kept for the backward, the loss's tensors and gradients, and the step's "
          "temporaries, alive at the peak")
    ratios = [r["predicted"][4] / r["peak"] for r in results[0].values()]
    print(f"predicted / measured: {min(ratios):.2f} to {max(ratios):.2f} over {len(ratios)} plans (goal 0.9-1.1)")
    bound = {name: max(r["peak"], results[1][name]["peak"]) / r["budget"] for name, r in results[0].items()
             if r["budget"] is not None and r["budget"] < 1e10}
    print("planned under a budget that binds (measured peak of the fuller rank / budget): "
          + ", ".join(f"{name} {v:.2f}" for name, v in bound.items())
          + f"; every one within its budget: {all(v <= 1 for v in bound.values())}")


if __name__ == "__main__":
    main()
