"""GPU check at world size 1 (NCCL): the runtime on CUDA, and the roofline against a real device.

    python -m benchmarks.gpu_check        # on a machine with one CUDA device

1. Roofline figures measured here (bf16/fp32 matmul FLOP/s, copy bandwidth) next to the built-in
   ``h100-sxm`` profile's.
2. ``autotp.parallelize`` on CUDA with an NCCL group of one rank, train mode, for tiny LLaMA and
   Hugging Face LlamaForCausalLM: outputs and gradients against the original model.
3. Predicted against measured forward+backward time of a mid-size LLaMA at world size 1 (no
   communication: this checks the compute roofline and kernel overheads alone).
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
import time

import torch
import torch.distributed as dist

import autotp
from autotp.parallel import default_hardware
from cost_models import load_profile
from examples import models


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


def predicted_vs_measured(device: str, mesh, dtype, small: bool = False) -> str:
    size = dict(dim=128, n_head=4, n_kv_head=2, ffn_dim=256, n_layer=2, vocab=512, seq=64) if small else dict(
        dim=2048, n_head=16, n_kv_head=8, ffn_dim=5632, n_layer=8, vocab=32000, seq=2048)
    model, inputs = models.tiny_llama(device=device, dtype=dtype, batch=1, **size)
    plan = autotp.plan(model, (1,), inputs, hardware="h100-sxm", mode="train")
    pm = autotp.parallelize(model, mesh, inputs, plan=plan)

    def step():
        pm(*inputs).float().pow(2).mean().backward()

    measured = _timed(step, reps=5)
    predicted = plan.predicted_time().total_s
    return (f"LLaMA dim {size['dim']} x {size['n_layer']} layers, seq {size['seq']}, {str(dtype).removeprefix('torch.')}: predicted "
            f"{predicted * 1e3:.1f} ms (h100-sxm profile), measured {measured * 1e3:.1f} ms, "
            f"predicted/measured {predicted / measured:.2f}")


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


def main() -> None:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"  # without a GPU: a small dry run of the same steps on gloo
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (1,), mesh_dim_names=("tp",))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if cuda else 'CPU dry run'}")
    measured = roofline(device, 8192 if cuda else 512)
    h100 = load_profile("h100-sxm").device
    print(f"bf16 matmul {measured['bfloat16'] / 1e12:.0f} TFLOP/s (h100-sxm profile {h100.peak_flops_for('bfloat16') / 1e12:.0f}); "
          f"fp32 {measured['float32'] / 1e12:.0f} TFLOP/s (profile {h100.peak_flops_for('float32') / 1e12:.0f}); "
          f"copy {measured['copy_bytes_per_s'] / 1e12:.2f} TB/s (profile {h100.memory_bandwidth_bytes_per_s / 1e12:.2f})")
    print(check_runtime(device, mesh, models.tiny_llama))
    try:
        print(check_runtime(device, mesh, models.hf_llama))
    except ValueError as err:  # a construct autotp refuses at capture is reported, the rest still runs
        print(f"hf_llama: not parallelized: {str(err).splitlines()[-1][:200]}")
    for dtype in (torch.float32, torch.bfloat16):
        print(predicted_vs_measured(device, mesh, dtype, small=not cuda))
    print(predicted_vs_measured_memory(device, mesh))
    print(check_meta_load(device, mesh))
    for line in check_generate(device, mesh):
        print(line)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
