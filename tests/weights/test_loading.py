"""Real-size models the way a user runs them: built on meta, parallelized, loaded shard by shard.

Small random Hugging Face models are saved with ``save_pretrained`` (safetensors, sharded into
several files with an index); then, on two spawned gloo processes, each rank builds the model
under ``autotp.meta_init()`` (no parameter memory), calls ``autotp.parallelize`` and
``autotp.load_weights``, and its logits and gradients must equal ``from_pretrained`` in one
process. Llama (an index of several files), GPT-2 (Conv1D weights, ``lm_head`` tied to the token
embedding, which the file holds once) and BERT (a non-persistent ``position_ids`` buffer). The
same run checks that no rank ever allocates a sharded parameter at full size, that a bfloat16 file
loads into a float32 model, that a checkpoint with wrong keys is refused whole, that a DCP
checkpoint saved on one plan (or from the unsharded model) loads into another, and that a fresh
init runs the model's own init on the shards.
"""

from __future__ import annotations

import copy
import itertools
import math
import json
import warnings
from pathlib import Path

import pytest
import torch

from examples import models
from examples.ranks import run_ranks
from tests.helpers.observed import tensor_of

pytestmark = pytest.mark.timeout(600)

FACTORIES = {"llama": models.hf_llama, "gpt2": models.hf_gpt2, "bert": models.hf_bert}


def _classes():
    from transformers import BertModel, GPT2LMHeadModel, LlamaForCausalLM

    return {"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel, "bert": BertModel}


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every real (not meta) storage an op makes, each counted once (a view or an in-place
    op's output shares its input's storage; a DTensor's local tensor is seen where it is made). The
    sum bounds the peak from above: nothing made is taken as freed. A storage an op only points at
    (``set_``: safetensors maps the file and slices views of the mapping) is no allocation: reading
    from it touches only the pages of the slice."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, int] = {}
        self.mapped: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if type(t) is torch.Tensor and not t.is_meta:
                storage = t.untyped_storage()
                if func is torch.ops.aten.set_.source_Storage:
                    self.mapped.add(storage.data_ptr())
                elif storage.data_ptr() not in self.mapped:
                    self.storages[storage.data_ptr()] = storage.nbytes()
        return out

    @property
    def total_bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def largest_bytes(self) -> int:
        return max(self.storages.values(), default=0)


def _meta_model(name: str, directory: str):
    """The model as a user builds it for loading: its config, parameters on meta."""
    import autotp
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    with autotp.meta_init():
        model = _classes()[name](config) if name != "bert" else _classes()[name](config, add_pooling_layer=False)
    return model.eval()


def _parallelize(model, mesh, ids):
    import autotp

    # static sizes: what is loaded does not depend on them (tests/tracing/test_dynamic.py covers other sizes),
    # and a static trace is half the time of these two-process runs
    # (no recompute: what is loaded does not depend on it, tests/planning/test_recompute.py covers it)
    try:
        return autotp.parallelize(model, mesh, (ids,), memory_budget=1, dynamic_dims=False, recompute=False)
    except autotp.MemoryBudgetError as err:  # just above the least any plan needs: it shards
        return autotp.parallelize(model, mesh, (ids,), memory_budget=err.minimum_bytes * 1.05,
                                  dynamic_dims=False, recompute=False)


def _ranks(rank, world, dirs):
    import autotp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    out, pms = {}, {}
    for name, directory in dirs.items():
        if name not in FACTORIES:
            continue
        model = _meta_model(name, directory)
        with _Allocations() as built:
            pm = _parallelize(model, mesh, ids)
        with _Allocations() as read:
            autotp.load_weights(pm, directory)
        assert all(p.is_meta for p in model.parameters()), "the model's own parameters stay on meta"
        sharded = [p for p in pm.parameters() if p.to_local().numel() < p.numel()]
        planned = pm.plan.memory_per_device().parameters_bytes + sum(b.nbytes for b in pm.buffers())
        largest_local = max([p.to_local().nbytes for p in pm.parameters()] + [b.nbytes for b in pm.buffers()])
        full = sum(p.numel() * p.element_size() for p in pm.parameters()) + sum(b.nbytes for b in pm.buffers())
        ref = _classes()[name].from_pretrained(directory)
        ref.eval()
        got, want = tensor_of(pm(ids)), tensor_of(ref(ids))
        target = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
        (got - target).pow(2).mean().backward()
        (want - target).pow(2).mean().backward()
        # relative to the largest gradient of the model (a key bias' gradient is zero but for rounding)
        gmax = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
        grads = {}
        for pname, p in pm.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[pname] = (g - ref.get_parameter(pname).grad).abs().max().item() / gmax
        out[name] = {"logits": (got - want).abs().max().item() / want.abs().max().item(),
                     "grads": max(grads.values()), "n_grads": len(grads), "worst": max(grads, key=grads.get),
                     "sharded": len(sharded), "allocated": built.total_bytes, "planned": planned, "full": full,
                     "largest_read": read.largest_bytes, "largest_local": largest_local,
                     "styles": sorted(set(pm.plan.module_styles().values()))}
        pms[name] = pm

    # bfloat16 file -> float32 model (into the Llama module above: loading replaces every value)
    pm = pms["llama"]
    pm.zero_grad(set_to_none=True)
    autotp.load_weights(pm, dirs["llama_bf16"])
    ref = _classes()["llama"].from_pretrained(dirs["llama"])
    want = ref(ids).logits
    out["bf16"] = (pm(ids).logits - want).abs().max().item() / want.abs().max().item()

    # a checkpoint that does not fit: refused whole, nothing loaded
    before = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in pm.state_dict().items()}
    try:
        autotp.load_weights(pm, dirs["bad"])
        out["bad"] = None
    except ValueError as err:
        out["bad"] = str(err)
    after = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in pm.state_dict().items()}
    out["bad_untouched"] = all(torch.equal(before[k], after[k]) for k in before)

    # an optimizer step on shards loaded without a copy (the file's pages) leaves the file as it was
    autotp.load_weights(pm, dirs["llama"])
    pm(ids).logits.pow(2).mean().backward()
    torch.optim.SGD(pm.parameters(), lr=0.5).step()
    pm.zero_grad(set_to_none=True)
    moved = (pm(ids).logits - want).abs().max().item() / want.abs().max().item()
    autotp.load_weights(pm, dirs["llama"])
    out["write"] = (moved, (pm(ids).logits - want).abs().max().item() / want.abs().max().item())

    # DCP: saved from the sharded plan, loaded into a replicated one
    autotp.checkpoint.save(pm, dirs["dcp"])
    # the state dict gathered whole on rank 0 is the model's (and nothing on the other ranks)
    gathered = autotp.checkpoint.full_state_dict(pm)
    out["gathered"] = (sorted(gathered) == sorted(ref.state_dict()) and all(
        torch.equal(gathered[k], v) for k, v in ref.state_dict().items())) if rank == 0 else gathered == {}
    # no budget: the device's memory, which no plan comes near (these models are a few hundred KiB), so
    # the plan is the planner's own choice, another than the sharded one
    replicated = autotp.parallelize(_meta_model("llama", dirs["llama"]), mesh, (ids,), dynamic_dims=False,
                                    recompute=False)
    autotp.load_weights(replicated, dirs["dcp"])
    out["dcp"] = (replicated(ids).logits - want).abs().max().item() / want.abs().max().item()
    out["dcp_plans_differ"] = replicated.plan.parameter_placements != pm.plan.parameter_placements
    out["init"], fresh = _fresh_init(mesh, ids, dirs["llama"], pms["llama"].plan)
    # a DCP checkpoint written from the unsharded model in one process loads into the shards
    autotp.load_weights(fresh, dirs["dcp_unsharded"])
    out["dcp_unsharded"] = (fresh(ids).logits - want).abs().max().item() / want.abs().max().item()
    return out


def _fresh_init(mesh, ids, directory, plan):
    """The model's own init on the shards: deterministic per seed, the distribution of a
    single-device init, shards that differ across ranks and replicated tensors that agree. ``plan``:
    the sharded plan of the same model and inputs, made above (given, it is not solved again)."""
    import autotp

    model = _meta_model("llama", directory)
    pm = autotp.parallelize(model, mesh, (ids,), plan=plan, dynamic_dims=False)

    def full():
        return {k: v.full_tensor().clone() for k, v in pm.named_parameters()}

    autotp.init_weights(pm, model, seed=0)
    first = full()
    local = {k: (v.to_local().sum().item(), v.to_local().numel() < v.numel()) for k, v in pm.named_parameters()}
    autotp.init_weights(pm, model, seed=0)
    again = full()
    autotp.init_weights(pm, model, seed=1)
    other = full()
    torch.manual_seed(0)
    from transformers import AutoConfig

    single = _classes()["llama"](AutoConfig.from_pretrained(directory))  # its own init, one device
    stats = {k: (v.mean().item(), v.std().item(), single.get_parameter(k).mean().item(),
                 single.get_parameter(k).std().item(), v.numel()) for k, v in first.items()}
    return {"deterministic": all(torch.equal(first[k], again[k]) for k in first),
            "seed_changes": all(not torch.equal(first[k], other[k]) for k in first
                                if first[k].std().item() > 0),
            "stats": stats, "local": local, "meta_after": all(p.is_meta for p in model.parameters())}, pm


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("ckpt")
    dirs = {}
    for name, factory in FACTORIES.items():
        model, _ = factory()
        dirs[name] = str(root / name)
        model.save_pretrained(dirs[name], max_shard_size="40KB")
    assert (Path(dirs["llama"]) / "model.safetensors.index.json").is_file()
    assert len(set(json.loads((Path(dirs["llama"]) / "model.safetensors.index.json").read_text())["weight_map"].values())) >= 2
    # the Llama checkpoint again in bfloat16, one file
    state = {}
    for file in Path(dirs["llama"]).glob("*.safetensors"):
        state.update(load_file(file))
    bf16 = root / "llama_bf16"
    bf16.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, bf16 / "model.safetensors")
    (bf16 / "config.json").write_text((Path(dirs["llama"]) / "config.json").read_text())
    dirs["llama_bf16"] = str(bf16)
    # the Llama checkpoint with a key missing, one extra and one of the wrong shape
    bad = root / "bad"
    bad.mkdir()
    broken = dict(state)
    broken.pop("model.norm.weight")
    broken["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    broken["lm_head.weight"] = torch.zeros(3, 64)
    save_file(broken, bad / "model.safetensors")
    dirs["bad"] = str(bad)
    dirs["dcp"] = str(root / "dcp")
    # the unsharded model saved by DCP in this process (no process group)
    import torch.distributed.checkpoint as dcp

    dirs["dcp_unsharded"] = str(root / "dcp_unsharded")
    with warnings.catch_warnings():  # "no process group: saving in one process", which is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(state), checkpoint_id=dirs["dcp_unsharded"], no_dist=True)
    return run_ranks(_ranks, 2, dirs)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_meta_model_loaded_shard_by_shard_equals_from_pretrained(loaded, name):
    for rank in loaded:
        r = rank[name]
        assert r["sharded"], f"{name}: the plan shards nothing, the check would be vacuous"
        assert {"colwise", "rowwise"} & set(r["styles"]), r["styles"]
        assert r["logits"] < 1e-5, r
        assert r["grads"] < 1e-5 and r["n_grads"] > 0, r


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_rank_allocates_its_planned_shards_and_reads_no_more(loaded, name):
    """Everything a rank allocates while it parallelizes is within 10 % of its planned parameter and
    buffer bytes, plus 64 KiB (the plan it receives as JSON, small temporaries), and less than the
    full model; while it loads, no tensor it makes is larger than its largest local shard or buffer
    (each parameter is read as the slice this rank holds)."""
    for rank in loaded:
        r = rank[name]
        assert r["allocated"] <= 1.1 * r["planned"] + 64 * 1024, r
        assert r["allocated"] < r["full"], r
        assert 0 < r["largest_read"] <= r["largest_local"], r


def test_a_bfloat16_file_loads_into_a_float32_model(loaded):
    for rank in loaded:
        assert rank["bf16"] < 2e-2, rank["bf16"]  # bfloat16 keeps 8 bits of mantissa


def test_training_the_loaded_shards_leaves_the_checkpoint_as_it_was(loaded):
    for rank in loaded:
        moved, reloaded = rank["write"]
        assert moved > 1e-3, "the step changed nothing: the check would be vacuous"
        assert reloaded < 1e-5, reloaded


def test_a_checkpoint_that_does_not_fit_is_refused_whole(loaded):
    for rank in loaded:
        message = rank["bad"]
        assert message is not None, "the broken checkpoint loaded"
        assert "nothing was loaded" in message
        assert "missing from the checkpoint: model.norm.weight" in message
        assert "in the checkpoint but not in the model: model.layers.9.mlp.up_proj.weight" in message
        assert "lm_head.weight: [3, 64] in the file, [128, 64] in the model" in message
        assert rank["bad_untouched"]


def test_a_dcp_checkpoint_loads_into_another_plan(loaded):
    for rank in loaded:
        assert rank["dcp_plans_differ"]
        assert rank["dcp"] < 1e-5, rank["dcp"]


def test_the_full_state_dict_is_gathered_on_rank_0_alone(loaded):
    assert all(rank["gathered"] for rank in loaded), [rank["gathered"] for rank in loaded]


def test_a_dcp_checkpoint_of_the_unsharded_model_loads_into_the_shards(loaded):
    for rank in loaded:
        assert rank["dcp_unsharded"] < 1e-5, rank["dcp_unsharded"]


def test_fresh_init_runs_the_models_own_init_on_the_shards(loaded):
    a, b = loaded[0]["init"], loaded[1]["init"]
    for r in (a, b):
        assert r["deterministic"] and r["seed_changes"] and r["meta_after"], r
    for name, (mean, std, ref_mean, ref_std, n) in a["stats"].items():
        if ref_std == 0:  # ones and zeros: exactly the single-device values
            assert std == 0 and mean == ref_mean, (name, mean, ref_mean)
        else:  # a random init: the same distribution (std within what n samples allow)
            assert abs(std - ref_std) <= 4 * ref_std / (2 * n) ** 0.5 + 1e-3 * ref_std, (name, std, ref_std, n)
            assert abs(mean - ref_mean) <= 4 * ref_std / n ** 0.5 + 4 * abs(ref_std) / n ** 0.5, (name, mean, ref_mean)
    sharded = [k for k, (_, is_sharded) in a["local"].items() if is_sharded]
    assert sharded, "nothing sharded: the check would be vacuous"
    for name, (total, is_sharded) in a["local"].items():
        other = b["local"][name][0]
        if is_sharded and a["stats"][name][3] > 0:
            assert total != other, f"{name}: both ranks drew the same shard"
        elif not is_sharded:
            assert total == other, f"{name}: replicated, yet the ranks hold different values"


def _init_without_an_init(rank, world):
    import autotp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with autotp.meta_init():
        model, inputs = models.tiny_llama()  # its RMSNorms have no reset_parameters, the model no _init_weights
    pm = autotp.parallelize(model, mesh, inputs, hardware="cpu-gloo")
    try:
        autotp.init_weights(pm, model)
    except ValueError as err:
        return str(err)
    return None


def test_init_names_the_parameters_the_models_init_does_not_write():
    from examples.ranks import run_threads

    message = run_threads(_init_without_an_init, 1)[0]
    assert message is not None, "parameters left as uninitialized memory without a word"
    assert "layers.0.input_layernorm.weight" in message and "norm.weight" in message
    assert "q_proj" not in message  # nn.Linear's reset_parameters wrote those


@pytest.mark.parametrize("placements, coordinate", [
    ("S(0)", [1]), ("S(1)", [0]), ("S(1)", [1]), ("S(0)[3]", [1]), ("S(1)[2]", [0]), ("R", [0])])
def test_the_prefetched_bytes_are_the_pieces_span(tmp_path, placements, coordinate):
    """What a rank asks the kernel to read ahead holds every element of its piece, and each span
    (one per block) runs from an element of the piece to an element of the piece: the spans are
    checked against the file's own bytes (each element's value is its index)."""
    from safetensors.torch import save_file

    from autotp.weights import loading
    from autotp.placement import parse_placements
    from autotp.runtime.shards import local_ranges

    weight = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    save_file({"a": torch.ones(3), "w": weight}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    start, layout = loading._data_layout(tmp_path / "model.safetensors")
    ranges = local_ranges((12, 10), parse_placements(placements), coordinate, (2,))
    spans = loading._byte_spans(*layout["w"], ranges)
    blocks = list(itertools.product(*ranges))
    piece = {int(v) for (r0, r1), (c0, c1) in blocks for v in weight[r0:r1, c0:c1].reshape(-1)}
    assert len(spans) == len(blocks)
    covered = set()
    for lo, hi in spans:
        values = [int(v) for v in torch.frombuffer(bytearray(data[start + lo:start + hi]), dtype=torch.float32)]
        assert values[0] in piece and values[-1] in piece, (lo, hi)
        covered.update(values)
    assert piece <= covered


@pytest.mark.parametrize("shape, placements, dtype", [
    ((12, 10), "S(0)", torch.float32), ((12, 10), "S(1)", torch.float32), ((12, 10), "R", torch.float32),
    ((12, 10), "S(0)[3]", torch.float32), ((12, 10), "S(1)[2]", torch.float32), ((12, 10), "S(0)", torch.bfloat16),
    ((1, 12, 10), "S(1)", torch.float32), ((2, 12, 10), "S(1)", torch.float32), ((12, 10, 1), "S(1)", torch.float32),
    ((12, 10), "R", torch.bfloat16)])  # read whole (a buffer) into another dtype
def test_the_shards_faulted_in_early_are_the_ones_pieces_are_copied_into(tmp_path, shape, placements, dtype):
    """A piece contiguous in the file and of the shard's dtype is mapped (the shard takes the file's
    pages); any other is copied into the shard's own storage (which gets its pages early), block by
    block, with the right values; a tensor read whole (a buffer: ranges None) too."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from autotp.weights import loading
    from autotp.placement import parse_placements
    from autotp.runtime.shards import local_ranges

    weight = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    save_file({"w": weight}, tmp_path / "w.safetensors")
    header_dtype = loading._header(tmp_path / "w.safetensors")[1]["w"]["dtype"]
    for coordinate in ([0], [1]):
        ranges = local_ranges(shape, parse_placements(placements), coordinate, (2,))
        local = torch.empty([sum(hi - lo for lo, hi in r) for r in ranges], dtype=dtype)
        expected = weight[tuple(torch.tensor([i for lo, hi in r for i in range(lo, hi)]).reshape(
            [-1 if d == k else 1 for k in range(len(shape))]) for d, r in enumerate(ranges))].to(dtype)
        storage = local.untyped_storage().data_ptr()
        with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
            copied = loading._copied(shape, ranges, local, header_dtype)
            loading._load_entry(f, "w", None if placements == "R" else ranges, local, copied, loading._Uploads())
        assert torch.equal(local, expected), (coordinate, ranges)
        # a piece is mapped (the shard takes the file's pages) or copied into the shard's own storage
        assert (local.untyped_storage().data_ptr() == storage) is copied, (coordinate, ranges)
        # by hand: whole rows of a tensor with no larger dim before the split, in the file's dtype
        assert copied is not (dtype == torch.float32 and (placements in ("S(0)", "R") or shape == (1, 12, 10))), \
            ranges


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    from autotp.weights import loading

    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(ValueError, match=r"model\.safetensors is not a safetensors file"):
        loading._safetensors_files(tmp_path)


def _load_where_one_rank_sees_another_checkpoint(rank, world, prepared, directories, model):
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.runtime.module import build_parallel_module

    graph, plan = prepared
    pm = build_parallel_module(graph, plan, init_device_mesh("cpu", (world,)), copy.deepcopy(model))
    with torch.no_grad():
        for p in pm.parameters():
            p.to_local().fill_(7.0)
    try:
        autotp.load_weights(pm, directories[rank])
        message = None
    except (ValueError, FileNotFoundError) as err:
        message = f"{type(err).__name__}: {err}"
    untouched = all(bool((p.to_local() == 7.0).all()) for p in pm.parameters())
    return message, untouched


@pytest.mark.parametrize("broken", ["a key missing", "no checkpoint", "a dcp checkpoint", "a truncated file"])
def test_a_checkpoint_that_one_rank_sees_otherwise_is_refused_on_every_rank(tmp_path, broken):
    """Rank 0 reads a good checkpoint, rank 1 (another host's copy, say) a broken one or none: both
    ranks raise before either reads, and rank 0's shards are as they were."""
    from safetensors.torch import save_file

    from examples.ranks import run_threads
    from tests.helpers.plans import sharded_mlp

    model, graph, plan = sharded_mlp()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(), bad.mkdir()
    save_file(state, good / "model.safetensors")
    if broken == "a key missing":
        save_file(dict(list(state.items())[1:]), bad / "model.safetensors")
    elif broken == "a dcp checkpoint":
        (bad / ".metadata").write_bytes(b"")
    elif broken == "a truncated file":  # a copy cut short: its header is whole, its data is not
        (bad / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:-16])
    results = run_threads(_load_where_one_rank_sees_another_checkpoint, 2, (graph, plan), [good, bad], model)
    (first, first_untouched), (second, _) = results
    assert second is not None and first is not None, results
    assert "nothing was loaded" in first and "rank 1" in first, first
    assert first_untouched, "rank 0 loaded while rank 1 refused"
    if broken == "a key missing":
        assert next(iter(state)) in first and next(iter(state)) in second


def test_an_index_that_lists_a_key_in_the_wrong_file_is_refused(tmp_path):
    from safetensors.torch import save_file

    from autotp.weights import loading

    save_file({"a": torch.ones(2)}, tmp_path / "one.safetensors")
    save_file({"b": torch.ones(3)}, tmp_path / "two.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "one.safetensors", "b": "one.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    targets = [(("a",), torch.zeros(2)), (("b",), torch.zeros(3))]
    with pytest.raises(ValueError, match=r"the index lists them in a file that does not hold them: b \(listed in one"):
        loading._match(targets, loading._safetensors_files(tmp_path))


class _Copies(torch.utils._python_dispatch.TorchDispatchMode):
    """Every ``copy_`` as (destination's storage, source's storage, non_blocking)."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src, *rest = args
            blocking = rest[0] if rest else (kwargs or {}).get("non_blocking", False)
            self.log.append(("copy", dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr(), blocking))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("on_gpu", [False, True])
def test_pieces_for_a_gpu_go_through_pinned_memory_and_are_waited_for_once(tmp_path, monkeypatch, on_gpu):
    """A bfloat16 file into a float32 Llama: every tensor is copied in (converted). Into a CUDA shard
    (faked: the device check says CUDA, the pinned buffer is ordinary memory, the synchronization
    recorded), each piece is staged in a buffer of the shard's dtype and copied to the shard with
    non_blocking=True, and the device synchronized once, after the last copy; into a CPU shard, plain
    copies as before, none staged, no synchronization. The values are the file's either way."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    import autotp
    from autotp.weights import loading

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    saved = {k: v.to(torch.bfloat16) for k, v in LlamaForCausalLM(config).state_dict().items()}
    save_file(saved, tmp_path / "model.safetensors")
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    log: list = []
    staged: list = []
    if on_gpu:
        def pinned(shape, dtype):
            staged.append(torch.empty(shape, dtype=dtype))
            return staged[-1]

        monkeypatch.setattr(loading, "_is_cuda", lambda t: True)
        monkeypatch.setattr(loading, "_pinned", pinned)
        monkeypatch.setattr(loading, "_synchronize", lambda device: log.append(("synchronize", device)))
    with _Copies(log):
        autotp.load_weights(model, tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k].float()), k
    own = {v.untyped_storage().data_ptr(): k for k, v in model.state_dict().items()}
    uploads = [e for e in log if e[0] == "copy" and e[1] in own]  # the copies into the model's tensors
    assert sorted(own[e[1]] for e in uploads) == sorted(saved)  # each tensor once
    if not on_gpu:
        assert staged == [] and all(not blocking for *_, blocking in uploads)
        return
    buffers = {t.untyped_storage().data_ptr() for t in staged}
    assert len(staged) == len(saved) and {t.dtype for t in staged} == {torch.float32}
    assert all(src in buffers and non_blocking for _, _, src, non_blocking in uploads), uploads
    assert [e for e in log if e[0] == "synchronize"] == [log[-1]] and log[-1] == ("synchronize", torch.device("cpu"))
