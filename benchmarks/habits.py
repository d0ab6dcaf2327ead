"""The zoos as a matrix of habits: each habit a user brings, tried on each model, against one process.

A feature tested on the models its author chose holds there; the habits below are what every user
brings to every model. Each cell runs the zoo's tiny model (``benchmarks/zoo.py``: hidden 64, 4 heads,
2 layers, vocabulary 128; the vision zoo's own tiny widths) on 2 ranks as a user runs it: every rank
calls ``autotp.parallelize`` itself (threads of one process, their traces taken in turns:
``tests/helpers/turns.py``; the pipeline on 2 gloo processes), under a plan made with a memory budget
5% above the least one, so that the plan must shard. A cell says ``exact`` (with the largest
difference, as a fraction of the largest reference value), ``WRONG`` with the first value that
differs, or the error raised, whose text a Limits section of docs/ names. Columns:

* ``padded``: a training step on a right-padded batch (row 2 holds 9 tokens of 16, its
  ``attention_mask`` zero after them) with the padding's labels ``-100``: the model's own loss and
  every parameter's gradient (an encoder without labels: ``(output - target)^2`` of its output);
* ``generate``, ``no mask``: greedy ``generate`` of 4 tokens from two prompts, the second
  left-padded with the pad token, against the model's own ``generate``: with the attention mask,
  and without it (Hugging Face infers it from ``pad_token_id``); causal language models and
  encoder-decoders (the encoder's prompts padded);
* ``pipeline``: ``step`` of a pp 2 layout (4 layers, 2 micro-batches of 1 row) on the padded batch
  with ignored labels, the model in train mode with its dropout (and router noise) at 0: loss and
  gradients; 2 gloo
  processes, so only with ``--pipeline``;
* ``bf16``: the model cast to bfloat16 before ``parallelize``, one training step: the largest
  difference of the output and gradients from float32's (as a fraction of the largest float32
  value) at most twice one process's in bfloat16 (the ranks add partial sums in another order, so
  their roundings differ from one process's, value by value, but are no more);
* ``save_pretrained``: ``pmodel.save_pretrained(dir)`` read back by the model class's own
  ``from_pretrained``: its logits against the model's;
* ``restore``: ``autotp.checkpoint.save`` of that module, loaded into a module of another plan
  (no memory budget: other placements) wiped first: its output against the model's;
* ``frozen`` (vision zoo, ``--vision``): a model in train mode whose first batch norm the user put in
  eval mode (its running statistics moved off the batch's): one training step, output, gradients and
  every buffer against one process.

    .venv/bin/python -m benchmarks.habits [--archs llama,qwen2,...] [--habits padded,bf16,...]
        [--pipeline] [--vision [--models resnet50,...]] [--markdown]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from benchmarks import zoo, zoo_vision
from examples.models import output_tensor

WORLD = 2
NEW_TOKENS = 4
BF16_FACTOR = 2.0  # autotp in bfloat16 against float32: at most this times one process's own error
LM_HABITS = ("padded", "generate", "no_mask", "pipeline", "bf16", "save_pretrained", "restore")
HEADERS = {"padded": "padded", "generate": "generate", "no_mask": "no mask", "pipeline": "pipeline pp 2",
           "bf16": "bf16", "save_pretrained": "save_pretrained", "restore": "restore", "frozen": "frozen"}


# ------------------------------------------------------------------------------------- harness

def _ranks(fn: Callable, *args: Any) -> list[Any]:
    from tests.helpers.turns import run_threads_tracing_in_turns

    return run_threads_tracing_in_turns(fn, WORLD, *args)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))


def sharding_plan(model: torch.nn.Module, inputs: dict, mode: str = "train", budget: bool = True) -> Any:
    """The plan the ranks run: under a budget 5% above the least one, so that it shards (or with no
    budget: ``budget=False``)."""
    import autotp

    common = dict(hardware="cpu-gloo", mode=mode, recompute=False)
    if not budget:
        return autotp.plan(model, (WORLD,), inputs, **common)
    try:
        return autotp.plan(model, (WORLD,), inputs, memory_budget=1, **common)
    except autotp.MemoryBudgetError as err:
        return autotp.plan(model, (WORLD,), inputs, memory_budget=err.minimum_bytes * zoo.TINY_BUDGET_SCALE,
                           **common)


def _scale(tensors: dict) -> float:
    return max([t.abs().max().item() for t in tensors.values() if t is not None and t.numel()] + [1e-30])


def _verdict(pairs: list[tuple[dict, dict]]) -> str:
    """``exact`` with the largest difference, else the first difference; each pair (got, reference)
    compared with ``benchmarks.zoo.compare`` at the reference's scale."""
    worst, wrong = 0.0, []
    for got, ref in pairs:
        diff, bad = zoo.compare(got, ref, _scale(ref))
        worst, wrong = max(worst, diff), wrong + bad
    if wrong:
        return f"WRONG {len(wrong)}: {wrong[0]}"
    return f"exact ({worst:.0e})"


def _cell(fn: Callable, *args: Any, width: int = 150) -> str:
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - one cell's failure is that cell's text
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        if isinstance(err, AssertionError) and lines and lines[0].startswith("rank "):
            text = lines[-1]  # a rank's own error: the last line of its traceback
            return text if len(text) <= width else text[:width - 3] + "..."
        return zoo.short_error(err, width)


# ------------------------------------------------------------------------------ language models

def _padded_inputs(arch: zoo.Arch, model: torch.nn.Module, inputs: dict) -> tuple[dict, bool]:
    """The zoo's inputs right-padded (row 2: 9 tokens), with labels ignored on the padding where the
    model takes labels; and whether it does."""
    ids = inputs["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    padded = {**inputs, "attention_mask": mask}
    takes_labels = "labels" in inspect.signature(model.forward).parameters
    if takes_labels:
        target = inputs.get("decoder_input_ids", ids)
        labels = target.clone()
        labels[1, 9:] = -100
        padded["labels"] = labels
    return padded, takes_labels


def _loss_step(model: torch.nn.Module, inputs: dict, takes_labels: bool) -> tuple[dict, dict]:
    out = model(**inputs)
    if takes_labels:
        loss = out.loss
    else:
        y = output_tensor(out)
        loss = (y.float() - torch.randn(y.shape, generator=torch.Generator().manual_seed(7))).pow(2).mean()
    loss.backward()
    return {"loss": loss.detach().float().reshape(1)}, zoo.full_gradients(model)


def _padded_rank(rank: int, world: int, model, inputs, plan, takes_labels) -> tuple[dict, dict]:
    import autotp

    pm = autotp.parallelize(copy.deepcopy(model), _mesh(), inputs, plan=plan)
    return _loss_step(pm, inputs, takes_labels)


def padded(arch: zoo.Arch) -> str:
    model, base = zoo.build(arch, 2, tiny=True)
    inputs, takes_labels = _padded_inputs(arch, model, base)
    plan = sharding_plan(model, inputs)
    ref = _loss_step(copy.deepcopy(model), inputs, takes_labels)
    got = _ranks(_padded_rank, model, inputs, plan, takes_labels)
    return _verdict([(g[k], ref[k]) for g in got for k in range(2)])


def _prompts(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Two prompts of 8 tokens, the second left-padded by 3 pad tokens; its mask; the pad token."""
    config = model.config
    vocab = config.vocab_size
    pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    pad = pad if isinstance(pad, int) else vocab - 1
    eos = eos if isinstance(eos, int) else None
    avoid = {pad, eos}
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, 8), generator=gen)
    for t in avoid - {None}:
        ids[ids == t] = next(x for x in range(vocab) if x not in avoid)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = pad, 0
    return ids, mask, pad


def _generation_example(arch: zoo.Arch, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """What generate's module is parallelized on: the prompts and their mask (an encoder-decoder's
    forward also takes the decoder's first tokens)."""
    example = {"input_ids": ids, "attention_mask": mask}
    return {**example, "decoder_input_ids": ids[:, :4].clone()} if arch.kind == "enc-dec" else example


def _generate_rank(rank: int, world: int, model, example, pad, plan, with_mask) -> torch.Tensor:
    import autotp

    ids, mask = example["input_ids"], example["attention_mask"]
    pm = autotp.parallelize(copy.deepcopy(model), _mesh(), example, mode="inference", plan=plan)
    return pm.generate(ids, attention_mask=mask if with_mask else None, max_new_tokens=NEW_TOKENS,
                       do_sample=False, pad_token_id=pad)


def generate(arch: zoo.Arch, with_mask: bool = True) -> str:
    if arch.kind == "encoder":
        return "-"
    model, _ = zoo.build(arch, 2, tiny=True)
    ids, mask, pad = _prompts(model)
    if arch.kind == "enc-dec" and model.generation_config.decoder_start_token_id is None:
        # the tiny config names no decoder start (T5's checkpoints start from the pad token)
        model.config.decoder_start_token_id = model.generation_config.decoder_start_token_id = pad
    example = _generation_example(arch, ids, mask)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the model's own warning about an inferred mask
        want = model.generate(ids, attention_mask=mask if with_mask else None, max_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=pad)
    plan = sharding_plan(model, example, mode="inference")
    got = _ranks(_generate_rank, model, example, pad, plan, with_mask)
    new = 0 if arch.kind == "enc-dec" else ids.shape[1]  # an encoder-decoder returns the decoder's tokens
    for tokens in got:
        if not torch.equal(tokens, want):
            return f"WRONG tokens {tokens[:, new:].tolist()}, the model's {want[:, new:].tolist()}"
    return f"exact ({NEW_TOKENS} tokens)"


def _bf16_rank(rank: int, world: int, model, inputs, plan) -> tuple[torch.Tensor, dict]:
    import autotp

    return zoo._step(autotp.parallelize(copy.deepcopy(model), _mesh(), inputs, plan=plan), inputs)


def _error(got: tuple, want: tuple) -> float:
    """The largest difference of an output and gradients from float32's, as a fraction of the largest
    float32 value of each (output, gradients)."""
    (out, grads), (out32, grads32) = got, want
    worst = (out.float() - out32).abs().max().item() / _scale({"o": out32})
    scale = _scale(grads32)
    return max([worst] + [(grads[k].float() - g).abs().max().item() / scale for k, g in grads32.items()
                          if g is not None and grads.get(k) is not None])


def bf16(arch: zoo.Arch) -> str:
    """Against float32, autotp in bfloat16 is off by no more than BF16_FACTOR times one process in
    bfloat16 is (the ranks add partial sums in another order: other roundings, not more of them)."""
    model, inputs = zoo.build(arch, 2, tiny=True)
    want = zoo._step(copy.deepcopy(model), inputs)  # float32
    model = model.to(torch.bfloat16)
    plan = sharding_plan(model, inputs)
    one = _error(zoo._step(copy.deepcopy(model), inputs), want)
    worst = max(_error(got, want) for got in _ranks(_bf16_rank, model, inputs, plan))
    verdict = "within bf16" if worst <= BF16_FACTOR * one else "WRONG"
    return f"{verdict} ({worst:.0e} from float32; one process {one:.0e})"


def _save_rank(rank: int, world: int, model, inputs, plan, directory) -> None:
    import autotp

    autotp.parallelize(copy.deepcopy(model), _mesh(), inputs, plan=plan).save_pretrained(directory)


def save_pretrained(arch: zoo.Arch) -> str:
    import transformers

    model, inputs = zoo.build(arch, 2, tiny=True)
    plan = sharding_plan(model, inputs)
    with tempfile.TemporaryDirectory() as directory:
        _ranks(_save_rank, model, inputs, plan, directory)
        read = getattr(transformers, arch.model).from_pretrained(directory).eval()
    with torch.no_grad():
        return _verdict([({"output": output_tensor(read(**inputs))}, {"output": output_tensor(model(**inputs))})])


def _restore_rank(rank: int, world: int, model, inputs, plans, directory) -> torch.Tensor:
    import autotp

    first = autotp.parallelize(copy.deepcopy(model), _mesh(), inputs, plan=plans[0])
    autotp.checkpoint.save(first, directory)
    other = autotp.parallelize(copy.deepcopy(model), _mesh(), inputs, plan=plans[1])
    with torch.no_grad():  # wiped: only the load can make it the model
        for p in other.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).zero_()
    autotp.checkpoint.load(other, directory)
    with torch.no_grad():
        return output_tensor(other(**inputs))


def restore(arch: zoo.Arch) -> str:
    model, inputs = zoo.build(arch, 2, tiny=True)
    plans = (sharding_plan(model, inputs), sharding_plan(model, inputs, budget=False))
    if plans[0].parameter_placements == plans[1].parameter_placements:
        return "same plan twice: nothing to restore across"
    with tempfile.TemporaryDirectory() as directory:
        got = _ranks(_restore_rank, model, inputs, plans, directory)
    with torch.no_grad():
        want = output_tensor(model(**inputs))
    return _verdict([({"output": g}, {"output": want}) for g in got])


def _training_model(arch: zoo.Arch) -> tuple[torch.nn.Module, dict]:
    """The zoo's tiny model in train mode (a pipeline is planned and run in train mode), its dropout
    off so that one process is a reference value by value, and its padded inputs with labels."""
    model, base = zoo.build(arch, 4, tiny=True)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for key, value in vars(m).items():  # dropout and router noise a module reads as a float of its own
            if isinstance(value, float) and ("drop" in key or "jitter" in key):
                setattr(m, key, 0.0)
    return model, _padded_inputs(arch, model, base)[0]


def _pipeline_rank(rank: int, world: int, name: str, plan_json: str) -> tuple[Any, dict]:
    import autotp

    model, inputs = _training_model({a.name: a for a in zoo.ARCHS}[name])
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("pp", "tp"))
    pm = autotp.parallelize(model, mesh, inputs, plan=autotp.Plan.from_json(plan_json))
    loss = pm.step(**inputs)
    return None if loss is None else loss.reshape(1), zoo.full_gradients(pm)


def pipeline(arch: zoo.Arch) -> str:
    import autotp
    from examples.ranks import run_ranks

    if arch.kind not in ("causal", "MoE"):
        return "-"
    model, inputs = _training_model(arch)
    layout = {"pp": WORLD, "tp": 1, "dp": 1, "schedule": "1f1b", "micro_batches": 2, "zero": 0, "recompute": False}
    plan = autotp.plan(model, WORLD, inputs, hardware="cpu-gloo", pipeline=layout)
    ref_loss, ref_grads = _loss_step(copy.deepcopy(model), inputs, True)
    got = run_ranks(_pipeline_rank, WORLD, arch.name, plan.to_json())
    grads = {n: g for _, gs in got for n, g in gs.items()}
    losses = [{"loss": loss} for loss, _ in got if loss is not None]
    return _verdict([(grads, ref_grads)] + [(loss, ref_loss) for loss in losses])


# --------------------------------------------------------------------------------------- vision

def _frozen_rank(rank: int, world: int, model, inputs, plan, output) -> tuple[dict, dict, dict]:
    import autotp

    return zoo_vision._step(autotp.parallelize(copy.deepcopy(model), _mesh(), inputs, plan=plan), inputs, output)


def frozen(entry: Any) -> str:
    model, inputs = zoo_vision.build(entry, tiny=True)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return "-"
    with torch.no_grad():  # running statistics off the batch's, so the two modes differ
        norms[0].running_mean.uniform_(-1, 1, generator=torch.Generator().manual_seed(5))
        norms[0].running_var.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(6))
    norms[0].eval()
    plan = sharding_plan(model, inputs)
    ref = zoo_vision._step(copy.deepcopy(model), inputs, entry.output)
    got = _ranks(_frozen_rank, model, inputs, plan, entry.output)
    return _verdict([(g[k], ref[k]) for g in got for k in range(3)])


CELLS: dict[str, Callable[[Any], str]] = {
    "padded": padded, "generate": generate, "no_mask": lambda arch: generate(arch, with_mask=False),
    "pipeline": pipeline, "bf16": bf16, "save_pretrained": save_pretrained, "restore": restore}


# ---------------------------------------------------------------------------------------- table

def render(rows: list[dict], columns: list[str], markdown: bool) -> str:
    return zoo.table([columns] + [[str(r.get(c, "-")) for c in columns] for r in rows], markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=None, help="language models: " + ",".join(a.name for a in zoo.ARCHS))
    parser.add_argument("--habits", default=None, help="of: " + ",".join(LM_HABITS))
    parser.add_argument("--pipeline", action="store_true", help="the pipeline column too (2 gloo processes a cell)")
    parser.add_argument("--vision", action="store_true", help="the vision zoo's frozen column instead")
    parser.add_argument("--models", default=None, help="vision models: " + ",".join(e.name for e in zoo_vision.ENTRIES))
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()

    import transformers

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    rows = []
    if args.vision:
        entries = {e.name: e for e in zoo_vision.ENTRIES}
        for name in args.models.split(",") if args.models else list(entries):
            print(f"{name} ...", file=sys.stderr, flush=True)
            lacking = zoo_vision.missing(entries[name])
            rows.append({"model": name, "frozen": f"skipped: {lacking}" if lacking else _cell(frozen, entries[name])})
        columns = ["model", "frozen"]
    else:
        archs = {a.name: a for a in zoo.ARCHS}
        habits = args.habits.split(",") if args.habits else [h for h in LM_HABITS if h != "pipeline" or args.pipeline]
        unknown = [h for h in habits if h not in CELLS] + [a for a in (args.archs or "").split(",") if a and a not in archs]
        if unknown:
            parser.error(f"unknown {unknown}")
        for name in args.archs.split(",") if args.archs else list(archs):
            print(f"{name} ...", file=sys.stderr, flush=True)
            row = {"architecture": name}
            lacking = zoo.missing(archs[name])
            for habit in habits:
                row[HEADERS[habit]] = f"skipped: no {lacking}" if lacking else _cell(CELLS[habit], archs[name])
            rows.append(row)
        columns = ["architecture"] + [HEADERS[h] for h in habits]
    print(render(rows, columns, args.markdown))
    print(f"wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
