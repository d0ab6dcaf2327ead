"""Loading a saved model shard by shard: host memory and time per rank, against loading it whole.

    python benchmarks/load.py                  # HF Llama of about 205 M parameters, 2 gloo ranks
    python benchmarks/load.py --layers 2       # a smaller one

A random Hugging Face Llama is saved with ``save_pretrained`` (safetensors in several files).
Then, side by side on this machine:

- one process: ``LlamaForCausalLM.from_pretrained`` (the whole model in one process);
- two gloo ranks: build on meta (``autotp.meta_init``), ``autotp.parallelize`` with a plan that
  shards every block weight, ``autotp.load_weights``.

Printed per rank: the peak anonymous host memory the rank allocated while parallelizing and
loading (sampled every 2 ms from ``/proc/self/status``; file pages that safetensors maps are the
page cache's, not the rank's, and are left out) over the full model's bytes (goal <= 0.55 on
two ranks), and its wall time over the single-process load's (goal <= 1.0).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakAnon:
    """The largest anonymous resident memory seen while the block runs, above where it started."""

    def __enter__(self) -> "PeakAnon":
        self.start = self.peak = _rss_anon_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon_bytes())

    @property
    def added_bytes(self) -> int:
        return self.peak - self.start


def _rank(rank: int, world: int, directory: str) -> dict:
    import autotp
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with autotp.meta_init():
        model = LlamaForCausalLM(AutoConfig.from_pretrained(directory)).eval()
    ids = torch.zeros(1, 128, dtype=torch.int64)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    # a budget of 55 % of the model's parameters (inference) is met only by sharding the blocks
    t0 = time.perf_counter()
    with PeakAnon() as memory:
        pm = autotp.parallelize(model, mesh, (ids,), mode="inference", memory_budget=0.55 * full)
        t1 = time.perf_counter()
        with PeakAnon() as loading:
            autotp.load_weights(pm, directory)
    t2 = time.perf_counter()
    held = sum(p.to_local().numel() * p.element_size() for p in pm.parameters())
    return {"peak_bytes": memory.added_bytes, "held_bytes": held, "full_bytes": full, "seconds": t2 - t0,
            "parallelize_s": t1 - t0, "load_s": t2 - t1, "load_peak_bytes": loading.added_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()

    from transformers import LlamaForCausalLM

    from examples.models import hf_llama
    from examples.ranks import run_ranks

    with tempfile.TemporaryDirectory() as directory:
        model, _ = hf_llama(n_layer=args.layers, hidden=args.hidden, ffn=args.ffn, heads=16, kv_heads=8,
                            vocab=args.vocab, seq=128)
        n = sum(p.numel() for p in model.parameters())
        model.save_pretrained(directory, max_shard_size="200MB")
        del model
        files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
        print(f"HF Llama, {n / 1e6:.0f} M parameters (float32, {n * 4 / 2**30:.2f} GiB) in {len(files)} files")

        t0 = time.perf_counter()
        with PeakAnon() as whole:
            reference = LlamaForCausalLM.from_pretrained(directory)
            mapped_s = time.perf_counter() - t0
            # from_pretrained maps the files and reads a page when it is first touched: touch them all,
            # as a step would, for the time the weights take to arrive
            torch.stack([p.detach().float().sum() for p in reference.parameters()]).sum().item()
        single_s = time.perf_counter() - t0
        del reference
        print(f"one process, from_pretrained: {mapped_s:.2f} s to return, {single_s:.2f} s with every weight "
              f"read; peak anonymous memory {whole.added_bytes / 2**30:.2f} GiB")

        for rank, r in enumerate(run_ranks(_rank, 2, directory)):
            print(f"rank {rank}: holds {r['held_bytes'] / 2**30:.2f} GiB "
                  f"({r['held_bytes'] / r['full_bytes']:.2f} of the model); peak anonymous memory while "
                  f"parallelizing + loading {r['peak_bytes'] / 2**30:.2f} GiB = "
                  f"{r['peak_bytes'] / r['full_bytes']:.2f} of the full model (goal <= 0.55), of which loading "
                  f"added {r['load_peak_bytes'] / 2**20:.0f} MiB")
            print(f"  time: parallelize {r['parallelize_s']:.2f} s (capture, plan, allocate), load_weights "
                  f"{r['load_s']:.2f} s = {r['load_s'] / single_s:.2f} of from_pretrained's with every weight read "
                  f"(goal <= 1.0); both {r['seconds']:.2f} s = {r['seconds'] / single_s:.2f}")


if __name__ == "__main__":
    main()
