"""Loading a saved model shard by shard: host memory and time per rank, against loading it whole.

    python -m benchmarks.load                  # HF Llama of about 205 M parameters, 2 gloo ranks
    python -m benchmarks.load --layers 2       # a smaller one

A random Hugging Face Llama is saved with ``save_pretrained`` (safetensors in several files).
Then, side by side on this machine:

- one process: ``LlamaForCausalLM.from_pretrained`` (the whole model in one process);
- two gloo ranks: build on meta (``autotp.meta_init``), ``autotp.parallelize`` with a plan that
  shards every block weight, ``autotp.load_weights``.

Printed per rank: the peak anonymous host memory the rank allocated while parallelizing and
loading (sampled every 2 ms from ``/proc/self/status``; file pages that safetensors maps are the
page cache's, not the rank's, and are left out) over the full model's bytes (goal <= 0.55 on
two ranks), and the time until every weight the rank holds is in memory (``load_weights``, then
one read of every local weight) over the same for ``from_pretrained`` (goal <= 1.0), with the
files in the page cache and with them evicted first. Times are the fastest of a few runs on each
side, with no sampler: reading ``/proc/self/status`` takes the lock that page faults need and slows
loading down by half. Each rank runs one thread, the single process all cores. Last, per rank, the
time to get as much fresh memory as loading added (the pieces a rank must copy, split along a later
dim and so strided in the file): ``from_pretrained`` copies nothing, and with the files in the page
cache this alone is the floor for any loader that copies.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import threading
import time

import torch


RUNS = (("warm", 3), ("cold", 3))  # timed runs of each kind, the fastest counts (the same for both sides)


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


def _evict(directory: str) -> None:
    """Drop the checkpoint's files from the page cache, as if read from disk for the first time."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _touch(tensors) -> None:
    """Read every element once, as a step would: pages a file mapping left unread arrive now."""
    torch.stack([t.detach().float().sum() for t in tensors]).sum().item()


def _rank(rank: int, world: int, directory: str) -> dict:
    import autotp
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))

    def build():
        with autotp.meta_init():
            model = LlamaForCausalLM(AutoConfig.from_pretrained(directory)).eval()
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        # a budget of 55 % of the model's parameters (inference) is met only by sharding the blocks
        return autotp.parallelize(model, mesh, (torch.zeros(1, 128, dtype=torch.int64),), mode="inference",
                                  memory_budget=0.55 * full), full

    # memory: sampled while parallelizing and loading
    with PeakAnon() as memory:
        pm, full = build()
        with PeakAnon() as loading:
            autotp.load_weights(pm, directory)
    held = sum(p.to_local().numel() * p.element_size() for p in pm.parameters())
    del pm
    # time: runs with no sampler (reading /proc/self/status takes the lock page faults need), the
    # fastest of as many runs as the single process makes: the files in the page cache, then evicted
    times: dict[str, float] = {}
    for cache, runs in RUNS:
        for _ in range(runs):
            gc.collect()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            pm, _ = build()
            if cache == "cold" and rank == 0:
                _evict(directory)
            torch.distributed.barrier()
            t1 = time.perf_counter()
            autotp.load_weights(pm, directory)
            _touch(p.to_local() for p in pm.parameters())
            times[cache] = min(times.get(cache, float("inf")), time.perf_counter() - t1)
            times["parallelize"] = min(times.get("parallelize", float("inf")), t1 - t0)
            del pm
    # the floor for any loader that copies: getting as much fresh memory as loading added (one write of
    # each byte, which is what makes the kernel hand the pages over)
    fresh = []
    for _ in range(3):
        t0 = time.perf_counter()
        torch.empty(loading.added_bytes, dtype=torch.uint8).fill_(1)
        fresh.append(time.perf_counter() - t0)
    times["fresh_memory"] = min(fresh)
    return {"peak_bytes": memory.added_bytes, "held_bytes": held, "full_bytes": full,
            "load_peak_bytes": loading.added_bytes, "seconds": times}


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
        os.sync()  # written back to disk: pages still being written out slow the first reads down
        files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
        print(f"HF Llama, {n / 1e6:.0f} M parameters (float32, {n * 4 / 2**30:.2f} GiB) in {len(files)} files")

        with PeakAnon() as whole:
            reference = LlamaForCausalLM.from_pretrained(directory)
        del reference
        # timed with no sampler: the fastest of RUNS with the files in the page cache, then with them
        # evicted first (the first run also imports what it needs)
        single = {}
        for cache, runs in RUNS:
            for _ in range(runs):
                if cache == "cold":
                    _evict(directory)
                t0 = time.perf_counter()
                reference = LlamaForCausalLM.from_pretrained(directory)
                # from_pretrained maps the files and reads a page when it is first touched: touch them
                # all, as a step would, for the time the weights take to arrive (the ranks do the same)
                _touch(reference.parameters())
                single[cache] = min(single.get(cache, float("inf")), time.perf_counter() - t0)
                del reference
        print(f"one process, from_pretrained and every weight read: {single['warm']:.2f} s with the files in the "
              f"page cache, {single['cold']:.2f} s from disk; peak anonymous memory "
              f"{whole.added_bytes / 2**30:.2f} GiB")

        for rank, r in enumerate(run_ranks(_rank, 2, directory)):
            t = r["seconds"]
            print(f"rank {rank}: holds {r['held_bytes'] / 2**30:.2f} GiB "
                  f"({r['held_bytes'] / r['full_bytes']:.2f} of the model); peak anonymous memory while "
                  f"parallelizing + loading {r['peak_bytes'] / 2**30:.2f} GiB = "
                  f"{r['peak_bytes'] / r['full_bytes']:.2f} of the full model (goal <= 0.55), of which loading "
                  f"added {r['load_peak_bytes'] / 2**20:.0f} MiB")
            print(f"  load_weights and every local weight read: {t['warm']:.2f} s = "
                  f"{t['warm'] / single['warm']:.2f} of from_pretrained's with the files in the page cache, "
                  f"{t['cold']:.2f} s = {t['cold'] / single['cold']:.2f} from disk (goal <= 1.0); "
                  f"parallelize before it (capture, plan, allocate): {t['parallelize']:.2f} s")
            print(f"  getting the {r['load_peak_bytes'] / 2**20:.0f} MiB of fresh memory loading added (the pieces "
                  f"copied out of the files) takes {t['fresh_memory']:.2f} s on its own")


if __name__ == "__main__":
    main()
