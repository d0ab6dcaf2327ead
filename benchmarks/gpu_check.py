"""GPU check on one CUDA device (an H100 or H200), in one command, under 8 minutes:

    python -m benchmarks.gpu_check        # on a machine with one CUDA device

Without a CUDA device it prints that none is present and exits 0. Each item runs guarded, within
its own time budget (``run_items``; the budgets are in ``main``): a failure or an overrun prints one
line and the next item runs.

0. Two ranks as threads of this process on the one GPU (the "threaded" process group): the plan
   made once, each rank's module built from it (``build_parallel_module``), outputs against the
   model's. This exercises the tensor-parallel runtime on CUDA. A pipeline of 2 stages is not run.
1. Roofline figures measured here (bf16/fp32 matmul FLOP/s, copy bandwidth) next to the built-in
   profile of this device (``cost_models.profile_for_device``; ``h100-sxm`` where it has none),
   priced as the planner prices them (times the profile's achievable fraction).
2. ``autotp.parallelize`` on CUDA with an NCCL group of one rank, train mode, for tiny LLaMA and
   Hugging Face LlamaForCausalLM: outputs and gradients against the original model.
3. Predicted against measured training step time and peak memory
   (``torch.cuda.max_memory_allocated``) of a Qwen2 of about 0.5 B parameters built from its config
   (random weights, bf16, batch 4 x 1024, AdamW), priced with this device's profile.
4. Memory: the plan's predicted peak per device against ``torch.cuda.max_memory_allocated`` over
   the third AdamW step of a ~110 M LLaMA with its cross-entropy planned with it (``loss_fn=``).
5. The real-size path on CUDA: a Hugging Face GPT-2 saved with ``save_pretrained`` (sharded
   safetensors), built under ``autotp.meta_init()``, parallelized on the CUDA mesh, filled by
   ``autotp.load_weights``: logits against ``from_pretrained`` on the same device, and the CUDA
   bytes allocated while parallelizing and loading against the plan's parameter bytes.
6. Generation on CUDA (``benchmarks/generate.py``'s measurement at world size 1): the ~100 M
   Llama in bf16, prompt 128, 128 new tokens, batch 1 and 8: autotp's ``generate`` (eager, and its
   decode step compiled with ``mode="reduce-overhead"``: CUDA graphs) against the model's own
   ``generate`` (its dynamic cache, and its static cache compiled, timed whole); the time per token
   of tokens 113-128 over tokens 2-17, per decoded token over the model's own, and the prompt's.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import autotp
from autotp.parallel import default_hardware
from cost_models import load_profile
from examples import models

TOTAL_BUDGET_S = 480.0  # 8 minutes for the whole check


@dataclass(frozen=True)
class Item:
    """One check: its name, its seconds at most, and a function of no arguments returning lines."""

    name: str
    budget_s: float
    run: Callable[[], list]


class ItemTimeout(Exception):
    """An item ran past its budget."""


def run_items(items: list, out: Callable[[str], None] = print) -> int:
    """Run each item guarded: its lines printed, or one line saying it failed or ran out of time,
    and the next item runs. Returns how many failed. A budget is enforced with SIGALRM (main thread)."""
    if sum(i.budget_s for i in items) > TOTAL_BUDGET_S:
        raise ValueError(f"the items' budgets add up to {sum(i.budget_s for i in items):g} s, over {TOTAL_BUDGET_S:g} s")
    failed = 0

    def expire(*_):
        raise ItemTimeout

    old = signal.signal(signal.SIGALRM, expire)
    try:
        for item in items:
            start = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, item.budget_s)
            try:
                for line in item.run():
                    out(f"{item.name}: {line}")
            except ItemTimeout:
                failed += 1
                out(f"{item.name}: STOPPED after its budget of {item.budget_s:g} s")
            except Exception as err:  # noqa: BLE001 - one line, and the next item runs
                failed += 1
                first = (str(err).strip().splitlines() or [""])[-1][:300]
                out(f"{item.name}: FAILED: {type(err).__name__}: {first}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            out(f"{item.name}: {time.perf_counter() - start:.1f} s")
    finally:
        signal.signal(signal.SIGALRM, old)
    return failed


def device_profile(device_name: str):
    """The built-in profile this device is priced with, and a note where it has none."""
    try:
        return load_profile(default_hardware("cuda", device_name)), ""
    except ValueError:
        return load_profile("h100-sxm"), " (no built-in profile for this device: h100-sxm's figures)"


def roofline_lines(measured: dict, profile, note: str = "") -> list:
    """Measured matmul rates and copy bandwidth against what the profile prices (peak x fraction)."""
    d = profile.device
    lines = []
    for dtype in ("bfloat16", "float32"):
        priced = d.flops_per_s_for(dtype, float("inf"))
        lines.append(f"{dtype} matmul {measured[dtype] / 1e12:.0f} TFLOP/s measured, {priced / 1e12:.0f} priced by "
                     f"{profile.name} ({d.peak_flops_for(dtype) / 1e12:.0f} peak x {d.achievable_fraction:g}); "
                     f"measured/priced {measured[dtype] / priced:.2f}{note}")
    bw = d.bandwidth_for(float("inf"))
    lines.append(f"copy {measured['copy_bytes_per_s'] / 1e12:.2f} TB/s measured, {bw / 1e12:.2f} priced; "
                 f"measured/priced {measured['copy_bytes_per_s'] / bw:.2f}")
    return lines


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, reps: int = 10) -> float:
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync()
    return (time.perf_counter() - t0) / reps


def roofline(device: str, n: int = 8192) -> dict:
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out[str(dtype).removeprefix("torch.")] = 2 * n**3 / _timed(lambda: a @ b)
    x = torch.empty(n * n * 16, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    out["copy_bytes_per_s"] = 2 * x.numel() / _timed(lambda: y.copy_(x))
    return out


def check_runtime(device: str, mesh, factory, **kw) -> str:
    model, inputs = factory(device=device, **kw)
    reference, _ = factory(device=device, **kw)
    pm = autotp.parallelize(model, mesh, inputs, hardware="h100-sxm")
    out = pm(*inputs)
    ref = reference(*inputs)
    out, ref = (getattr(o, "logits", o) for o in (out, ref))
    ref.float().pow(2).mean().backward()
    out.float().pow(2).mean().backward()
    refp = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in refp.values())
    grad_err = max((p.grad.full_tensor() - refp[n].grad).abs().max().item() for n, p in pm.named_parameters()) / scale
    out_err = (out - ref).abs().max().item() / ref.abs().max().item()
    return f"{factory.__name__}: output rel err {out_err:.1e}, gradient rel err {grad_err:.1e}"


def predicted_vs_measured_memory(device: str, mesh) -> str:
    """The plan's peak bytes per device against what a training step holds: a LLaMA with its
    cross-entropy planned with it (``loss_fn=``), three AdamW steps, the third measured. On CUDA the
    measure is ``torch.cuda.max_memory_allocated`` over the step (everything the caching allocator
    hands out: parameters, gradients, optimizer state, inputs, activations, temporaries); in the CPU
    dry run, ``benchmarks/memory.py``'s storage count."""
    from benchmarks.memory import LiveBytes, cross_entropy

    cuda = device == "cuda"
    size = dict(dim=1024, n_head=16, n_kv_head=8, ffn_dim=2816, n_layer=4, vocab=32000, seq=1024) if cuda else dict(
        dim=128, n_head=4, n_kv_head=2, ffn_dim=256, n_layer=2, vocab=512, seq=64)
    model, inputs = models.tiny_llama(device=device, batch=4, **size)
    targets = torch.randint(0, size["vocab"], inputs[0].shape, device=device)
    pm = autotp.parallelize(model, mesh, (*inputs, targets), hardware="h100-sxm", loss_fn=cross_entropy)
    del model
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        pm(*inputs, targets).backward()
        optimizer.step()

    step()
    step()  # the optimizer state exists from here on
    _sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        step()
        _sync()
        measured = torch.cuda.max_memory_allocated()
    else:
        meter = LiveBytes()
        meter.track_training(pm, optimizer, (*inputs, targets))
        with meter:
            step()
        measured = meter.peak
    m = pm.plan.memory_per_device()
    return (f"memory, LLaMA dim {size['dim']} x {size['n_layer']} layers, batch 4 x {size['seq']}, float32, "
            f"AdamW: predicted peak {m.peak_bytes / 2**20:.1f} MiB ({m.peak_phase}), measured "
            f"{measured / 2**20:.1f} MiB ({'max_memory_allocated' if cuda else 'storage count'}), "
            f"predicted/measured {m.peak_bytes / measured:.2f}")


def check_meta_load(device: str, mesh) -> str:
    import tempfile

    from transformers import AutoConfig, GPT2LMHeadModel

    with tempfile.TemporaryDirectory() as directory:
        saved, (ids,) = models.hf_gpt2(n_layer=2, hidden=256, heads=8, vocab=1024, seq=64, batch=2)
        saved.save_pretrained(directory, max_shard_size="1MB")
        with autotp.meta_init():
            model = GPT2LMHeadModel(AutoConfig.from_pretrained(directory)).eval()
        ids = ids.to(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        try:  # the profile a user's call gets on this device; with none built in, the check runs priced as h100-sxm
            hardware, note = default_hardware(device, torch.cuda.get_device_name(0) if device == "cuda" else None), ""
        except ValueError as err:
            hardware, note = "h100-sxm", f" (default profile: {err}; priced as h100-sxm here)"
        pm = autotp.parallelize(model, mesh, (ids,), hardware=hardware)
        autotp.load_weights(pm, directory)
        peak = torch.cuda.max_memory_allocated() - before if device == "cuda" else float("nan")
        reference = GPT2LMHeadModel.from_pretrained(directory).to(device).eval()
        err = ((pm(ids).logits - reference(ids).logits).abs().max() / reference(ids).logits.abs().max()).item()
        planned = pm.plan.memory_per_device().parameters_bytes
    return (f"meta -> parallelize -> load_weights (GPT-2, {pm.plan.hardware.name}): logits rel err {err:.1e}; "
            f"peak bytes allocated {peak / 2**20:.1f} MiB for {planned / 2**20:.1f} MiB of planned parameters{note}")


def check_generate(device: str, mesh, new: int = 128, layers: int = 8) -> list[str]:
    """Item 5 of the module docstring (on CPU: 8 new tokens, 2 layers, float32, eager only)."""
    import statistics

    from benchmarks.generate import PROMPT, Clock, build, per_token

    cuda = device == "cuda"
    if not cuda:
        new, layers = 8, 2
    dtype = torch.bfloat16 if cuda else torch.float32
    lines = []
    for batch in (1, 8):
        prompt = torch.randint(0, 32000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).to(device)
        cache = PROMPT + new
        runs: dict[str, list[float]] = {}

        def timed(name: str, call, modules) -> None:
            """Each token's seconds, from hooks on the ``modules`` each token runs (none: a compiled
            call a hook would break, timed whole and spread evenly over its tokens)."""
            call(2)  # traces, plans and compiles what the run needs
            clock = Clock()

            def mark(*_: object) -> None:  # a hook's value would replace the output: it returns none
                _sync()
                clock.hook()

            hooks = [m.register_forward_hook(mark) for m in modules]
            _sync()
            start = time.perf_counter()
            tokens = call(new)
            _sync()
            runs[name] = per_token(clock.ends, start) if modules else [(time.perf_counter() - start) / new] * new
            runs[name + " tokens"] = tokens.tolist()
            for h in hooks:
                h.remove()

        pm = autotp.parallelize(build(layers).to(device=device, dtype=dtype), mesh, (prompt,), mode="inference",
                                hardware="h100-sxm")
        for name, compile_ in (("autotp", False), ("autotp compiled", {"mode": "reduce-overhead"} if cuda else None)):
            if compile_ is None:
                continue
            def call(n: int, c=compile_):
                return pm.generate(prompt, max_new_tokens=n, max_cache_len=cache, compile=c)
            call(1)
            graphs = next(iter(pm._autotp_generation.values()))
            # hooks on the eager prompt graph and on what runs each decoded token (the compiled step, whose
            # graph a hook inside would break)
            timed(name, call, [graphs.graphs["prompt"], graphs.step(compile_) if compile_ else graphs.graphs["token"]])
        model = build(layers).to(device=device, dtype=dtype)
        timed("model", lambda n: model.generate(prompt, max_new_tokens=n, do_sample=False), [model])
        if cuda:
            timed("model static compiled", lambda n: model.generate(prompt, max_new_tokens=n, do_sample=False,
                                                                  cache_implementation="static"), [])
        k = min(16, new // 4)
        base = statistics.median(runs["model"][1:])
        for name in [n for n in runs if not n.endswith("tokens")]:
            t = runs[name]
            decode = statistics.median(t[1:])
            lines.append(f"generate batch {batch}, {name}: {decode * 1e3:.2f} ms/token, late/early "
                         f"{statistics.median(t[-k:]) / statistics.median(t[1:1 + k]):.2f} (goal <= 1.3), "
                         f"over the model's own {decode / base:.2f}, prompt {t[0] * 1e3:.1f} ms "
                         f"({t[0] / runs['model'][0]:.2f} of the model's); tokens equal the model's: "
                         f"{runs[name + ' tokens'] == runs['model tokens']}")
    return lines


def qwen2_half_b(device: str):
    """A Qwen2 of about 0.5 B parameters (Qwen2-0.5B's config: hidden 896, 24 layers, 14 heads, 2 kv
    heads, MLP 4864, vocabulary 151936), built from its config with random weights, bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def half_b_predicted_vs_measured(mesh, profile, batch: int = 4, seq: int = 1024) -> list:
    """Predicted against measured training step (forward, backward, AdamW) and peak memory."""
    model = qwen2_half_b("cuda")
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    pm = autotp.parallelize(model, mesh, (ids,), hardware=profile)
    del model
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-5)

    def step():
        optimizer.zero_grad(set_to_none=True)
        pm(ids).logits.float().pow(2).mean().backward()
        optimizer.step()

    step()
    step()
    _sync()
    torch.cuda.reset_peak_memory_stats()
    measured = _timed(step, reps=3)
    peak = torch.cuda.max_memory_allocated()
    t, m = pm.plan.predicted_time(), pm.plan.memory_per_device()
    return [f"Qwen2 {params / 1e9:.2f} B, bf16, batch {batch} x {seq}, AdamW: step predicted {t.total_s * 1e3:.1f} ms "
            f"({profile.name}), measured {measured * 1e3:.1f} ms, predicted/measured {t.total_s / measured:.2f}",
            f"peak memory predicted {m.peak_bytes / 2**30:.2f} GiB ({m.peak_phase}), max_memory_allocated "
            f"{peak / 2**30:.2f} GiB, predicted/measured {m.peak_bytes / peak:.2f}"]


def two_threaded_ranks(profile) -> list:
    """Two ranks as threads on the one GPU: plan once, build each rank's module, compare outputs."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.planning.planner import plan_graph
    from autotp.runtime.module import build_parallel_module
    from examples.ranks import run_threads

    model, inputs = models.hf_llama(device="cuda", n_layer=2, hidden=256, ffn=512, heads=8, kv_heads=4, vocab=512,
                                    seq=64)
    model.eval()
    graph = autotp.capture(model, inputs)
    plan = plan_graph(graph, (2,), profile.scaled_links(1e3), "inference")  # links priced fast: the weights split
    with torch.no_grad():
        reference = model(*inputs).logits

    def rank(r: int, world: int) -> float:
        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
        pm = build_parallel_module(graph, plan, mesh, model)
        with torch.no_grad():
            out = pm(*inputs)
        out = getattr(out, "logits", out)
        return ((out - reference).abs().max() / reference.abs().max()).item()

    errors = run_threads(rank, 2)
    split = sum(1 for p in plan.parameter_placements.values() if "S" in str(p))
    return [f"hf_llama on 2 threaded ranks, one GPU: {split} weights split, logits rel err "
            f"{max(errors):.1e} on each rank (max)",
            "pipeline of 2 stages: not run (a pipeline's stages send to each other point to point, which "
            "PyTorch's threaded process group, the only way to put 2 ranks on one GPU in one process, does not do)"]


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device present (torch.cuda.is_available() is False); nothing to check. "
              "Run `python -m benchmarks.gpu_check` on a machine with one H100 or H200.")
        return 0
    name = torch.cuda.get_device_name(0)
    profile, note = device_profile(name)
    print(f"torch {torch.__version__}, {name}, priced with {profile.name}{note}")
    torch.cuda.set_device(0)
    failed = run_items([
        Item("roofline", 40, lambda: roofline_lines(roofline("cuda"), profile, note)),
        Item("2 threaded ranks", 60, lambda: two_threaded_ranks(profile)),
    ])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
    try:
        failed += run_items([
            Item("1 rank, NCCL", 40, lambda: [check_runtime("cuda", mesh, models.tiny_llama),
                                             check_runtime("cuda", mesh, models.hf_llama)]),
            Item("Qwen2 0.5 B", 90, lambda: half_b_predicted_vs_measured(mesh, profile)),
            Item("memory", 40, lambda: [predicted_vs_measured_memory("cuda", mesh)]),
            Item("meta load", 30, lambda: [check_meta_load("cuda", mesh)]),
            Item("generate", 150, lambda: check_generate("cuda", mesh)),
        ])
    finally:
        dist.destroy_process_group()
    print(f"gpu_check: {failed} item(s) failed or ran out of time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
