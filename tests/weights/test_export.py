"""``save_pretrained`` of a parallel module: the files the model's own ``save_pretrained`` writes, which
its ``from_pretrained`` reads on one process, written one gathered tensor at a time.

Tiny Hugging Face models (one layer) split over 2 ranks (threads of this process over a real group, the plan made
once in this thread): the logits of ``from_pretrained(dir)`` equal the original model's; the files,
the index and the tensors in them equal what the model's own ``save_pretrained`` writes with the
same ``max_shard_size`` (GPT-2's ``lm_head.weight``, tied to the token embedding, left out as
Hugging Face leaves it out); rank 0 never holds more than the largest tensor twice over (the gather's
output and its copy to write) of what the save makes. The pipeline module's export runs in
``tests/runtime/test_pipeline_runtime.py``'s two-process pipelines.
"""

from __future__ import annotations

import json
import weakref

import pytest
import torch

from examples import models
from examples.ranks import run_threads


class _LivePeak(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes of real storage made in the block that are alive at once (a storage lives while
    a tensor an op returned on it does)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, tensors alive on it]
        self.now_bytes = self.peak_bytes = 0

    def _dropped(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now_bytes -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if type(t) is torch.Tensor and not t.is_meta:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.live:
                    self.live[ptr] = [t.untyped_storage().nbytes(), 0]
                    self.now_bytes += self.live[ptr][0]
                    self.peak_bytes = max(self.peak_bytes, self.now_bytes)
                self.live[ptr][1] += 1
                weakref.finalize(t, self._dropped, ptr)
        return out


def _prepared(factory: str, budget_bytes: int):
    """The model, its inputs, its graph and a plan on 2 ranks that shards (a budget near the least)."""
    import autotp
    from autotp.planning.planner import plan_graph

    model, inputs = getattr(models, factory)(n_layer=1, device="cpu")
    graph = autotp.capture(model, inputs, False)
    try:
        plan = plan_graph(graph, (2,), "cpu-gloo", "inference", budget_bytes)
    except autotp.MemoryBudgetError as err:
        plan = plan_graph(graph, (2,), "cpu-gloo", "inference", int(err.minimum_bytes * 1.05) + 1)
    assert {"colwise", "rowwise"} & set(plan.module_styles().values()), "the plan should shard"
    return model, inputs, graph, plan


def _save_rank(rank, world, factory, graph, plan, inputs, directory, max_shard_size):
    """This rank's module, built as autotp.parallelize builds it, saved; rank 0's live peak of the save."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import ModeSwitch, build_parallel_module, meta_copy

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, _ = getattr(models, factory)(n_layer=1, device="cpu")
    switch = ModeSwitch(meta_copy(model), inputs, False, mesh, None, None)
    pm = build_parallel_module(graph, plan, mesh, model, switch=switch)
    with _LivePeak() as live:
        pm.save_pretrained(directory, max_shard_size=max_shard_size)
    return live.peak_bytes


def _files(directory) -> dict:
    """Every tensor of a saved directory by file, and the index."""
    from safetensors.torch import load_file

    out = {p.name: load_file(p) for p in sorted(directory.glob("*.safetensors"))}
    index = directory / "model.safetensors.index.json"
    return out, json.loads(index.read_text()) if index.exists() else None


@pytest.mark.parametrize("factory,cls,budget,max_shard_size", [
    ("hf_llama", "LlamaForCausalLM", 150_000, "5GB"),
    ("hf_gpt2", "GPT2LMHeadModel", 300_000, 60_000)])  # several files and an index
def test_save_pretrained_writes_what_the_model_s_own_does(factory, cls, budget, max_shard_size, tmp_path):
    import transformers

    model, inputs, graph, plan = _prepared(factory, budget)
    peaks = run_threads(_save_rank, 2, factory, graph, plan, inputs, tmp_path / "autotp", max_shard_size)
    model.save_pretrained(tmp_path / "hf", max_shard_size=max_shard_size)

    ours, ours_index = _files(tmp_path / "autotp")
    theirs, their_index = _files(tmp_path / "hf")
    assert sorted(ours) == sorted(theirs)  # model.safetensors, or model-0000k-of-0000n.safetensors
    assert (ours_index is None) == (max_shard_size == "5GB")
    assert ours_index == their_index  # weight_map and sizes
    for name, tensors in theirs.items():
        assert sorted(ours[name]) == sorted(tensors), name  # GPT-2: lm_head.weight once, as the embedding
        for key, value in tensors.items():
            assert torch.equal(ours[name][key], value), key

    config = json.loads((tmp_path / "autotp" / "config.json").read_text())
    assert config["architectures"] == [cls] and config["dtype"] == "float32"
    loaded = getattr(transformers, cls).from_pretrained(tmp_path / "autotp").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, model(*inputs).logits, rtol=0, atol=0)

    # streamed: rank 0 held at most two copies of the largest tensor (the gather's and the bytes
    # written), never the model
    largest = max(v.nbytes for v in model.state_dict().values())
    total = sum(v.nbytes for v in model.state_dict().values())
    assert peaks[0] <= 2 * largest < total, (peaks[0], largest, total)


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    from autotp.weights.export import save_pretrained

    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"max_shard_size '5 bytes'.*'5GB'"):
        save_pretrained(module, tmp_path / "a", "5 bytes")
    with pytest.raises(ValueError, match=r"max_shard_size 0 is 0 bytes; expected a positive size"):
        save_pretrained(module, tmp_path / "a", 0)
    with pytest.raises(TypeError, match=r"max_shard_size is a float"):
        save_pretrained(module, tmp_path / "a", 1.5)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"is a file; expected a directory"):
        save_pretrained(module, tmp_path / "file")
    assert not (tmp_path / "a").exists()
