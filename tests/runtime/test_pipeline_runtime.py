"""Pipeline stages at run time (autotp.runtime.pipeline.module): a plan made with ``pipeline=`` run as stages
under torch.distributed.pipelining's schedules, against one process.

The default suite cuts a graph into stages and runs them one after the other on one rank (the
mechanism), and runs a 2-rank pipeline of a Llama (1F1B) and a GPT-2 whose embedding is tied to its
head (GPipe) on 2 gloo processes: the loss on the last stage and every parameter's gradient equal one
process's. The slow suite runs 4 ranks: pp 2 x tp 2 (Megatron's layout pinned inside the stages) and
pp 4.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import pytest
import torch

import autotp
from autotp.runtime.interface import Parallelized
from autotp.runtime.recompute import Recompute
from examples.ranks import run_ranks


def _model(name: str):
    torch.manual_seed(0)
    if name.startswith("llama"):
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                             max_position_embeddings=64))
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=128, n_positions=64,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    if name.endswith("_loss"):  # traced without labels: the loss is step()'s loss_fn, on the last stage
        return model, {"input_ids": ids}
    # a right-padded batch, its padding's labels ignored: the micro-batches (2 rows each, and each
    # replica's) hold unequal numbers of valid targets, so only a loss weighed by them is one process's
    labels = ids.clone()
    for row, length in enumerate((5, 16, 11, 2)):
        labels[row, length:] = -100
    return model, {"input_ids": ids, "labels": labels}


def _shifted_cross_entropy(output, target):
    """The loss a Hugging Face causal LM computes from ``labels=``: each position predicts the next."""
    logits = output.logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))


def _megatron_pin(model) -> dict[str, str]:
    """Megatron's split of each layer pinned (Llama's attention and MLP; GPT-2's MLP, whose ``Conv1D``
    weights are stored (in, out))."""
    cols = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
    rows = ("o_proj.weight", "down_proj.weight")
    pin = {}
    for n, _ in model.named_parameters():
        if n.endswith(cols) or n.endswith("mlp.c_proj.weight"):
            pin[n] = "S(0)"
        elif n.endswith(rows) or n.endswith("mlp.c_fc.weight"):
            pin[n] = "S(1)"
    return pin


def _plan(name: str, pp: int, tp: int, schedule: str, micro_batches: int, dp: int = 1, zero: int = 0,
          recompute: bool = False):
    model, inputs = _model(name)
    layout = {"pp": pp, "tp": tp, "dp": dp, "schedule": schedule, "micro_batches": micro_batches, "zero": zero,
              "recompute": recompute}
    if schedule == "interleaved_1f1b":
        layout["stages_per_rank"] = 2
    return autotp.plan(model, pp * dp * tp, inputs, hardware="cpu-gloo", pin=_megatron_pin(model) if tp > 1 else None,
                       pipeline=layout)


def _reference(name: str):
    model, inputs = _model(name.removesuffix("_loss"))
    if name.endswith("_loss"):  # step()'s loss_fn: every position's next token, none ignored
        inputs = {**inputs, "labels": inputs["input_ids"]}
    loss = model(**inputs).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _observe_sends(sent: list):
    """torch.distributed.pipelining's point-to-point ops, recorded as (``isend``/``irecv``, bytes) as the
    schedule posts them."""
    import torch.distributed.pipelining.schedules as schedules

    def wrap(fn):
        def recorded(ops, *a, **kw):
            sent.extend((op.op.__name__, op.tensor.numel() * op.tensor.element_size()) for op in ops)
            return fn(ops, *a, **kw)
        return recorded

    schedules._batch_p2p = wrap(schedules._batch_p2p)  # _sorted_batch_p2p posts through it too


def _built(name: str, plan_json: str, shape: tuple, weights: str | None):
    """The pipeline module; with ``weights`` (a saved model), built on meta and filled from it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp") if len(shape) == 3 else ("pp", "tp"))
    if weights is None:
        model, inputs = _model(name)
    else:
        with autotp.meta_init():
            model, inputs = _model(name)
    pm = autotp.parallelize(model, mesh, inputs, plan=autotp.Plan.from_json(plan_json))
    if weights is not None:
        autotp.load_weights(pm, weights)
    return pm, inputs


def _rank(rank, world, cases):
    sent: list = []
    _observe_sends(sent)
    out = []
    for name, plan_json, shape, weights, checkpoint, *export in cases:
        pm, inputs = _built(name, plan_json, shape, weights)
        wrong_device = None
        try:  # inputs on another device than the mesh's: refused before any send
            pm.step(**{k: v.to("meta") for k, v in inputs.items()})
        except ValueError as err:
            wrong_device = str(err)
        del sent[:]
        from tests.helpers.observed import CollectiveLog

        given = dict(target=inputs["input_ids"], loss_fn=_shifted_cross_entropy) if name.endswith("_loss") else {}
        with CollectiveLog(pm.tp_mesh) as log, _fsdp_calls() as fsdp:  # the tensor axis's; FSDP2's
            loss = pm.step(**inputs, **given)
        step_sends = [b for kind, b in sent if kind == "isend"]
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 for n, p in pm.named_parameters()}
        logits = pm(**inputs)  # inference: the batch through the stages, the output on the last stage
        restored = None
        if checkpoint is not None:  # each rank writes and reads its stage's shards
            autotp.checkpoint.save(pm, checkpoint)
            again, _ = _built(name, plan_json, shape, weights)
            with torch.no_grad():  # built alike: wiped, so only the load can make it equal
                for p in again.parameters():
                    _local(p).zero_()
            autotp.checkpoint.load(again, checkpoint)
            mine, theirs = pm.state_dict(), again.state_dict()
            restored = sorted(mine) == sorted(theirs) and all(
                torch.equal(_local(mine[k]), _local(theirs[k])) for k in mine)
        if export:  # the whole model as Hugging Face files, every stage's tensors sent to rank 0
            pm.save_pretrained(export[0], max_shard_size=100_000)
        full = autotp.checkpoint.full_state_dict(pm, rank=None)  # every stage's tensors, whole, on every rank
        on_zero = autotp.checkpoint.full_state_dict(pm)  # ... on rank 0 alone
        out.append({"loss": None if loss is None else loss.item(), "grads": grads, "full": full, "on_zero": on_zero,
                    "fsdp": dict(fsdp), "fsdp_units": pm.fsdp_units,
                    "logits": None if logits is None else logits.logits,
                    "eval_loss": None if getattr(logits, "loss", None) is None else logits.loss.item(),
                    "stages": pm.stage_indices, "state": sorted(pm.state_dict()), "sends": step_sends,
                    "restored": restored, "wrong_device": wrong_device, "collectives": [(c.kind, c.mesh_axis, c.bytes) for c in log.seen],
                    "from_plan": pm.built_from_plan, "layout": (isinstance(pm, Parallelized), pm.layout),
                    "buckets": None if pm.gradient_reducer is None else (
                        len(pm.gradient_reducer.parameters), len(pm.gradient_reducer.buckets),
                        pm.gradient_reducer.launched_in_backward),
                    "on_meta": [n for n, p in pm.named_parameters() if _local(p).is_meta],
                    "recomputed": sorted(m.path for st in pm.stages for m in st.modules() if isinstance(m, Recompute)),
                    "placements": {n: getattr(p, "placements", None) for n, p in pm.named_parameters()}})
    return out


@contextlib.contextmanager
def _fsdp_calls():
    """Counts of the gathers and reduce-scatters FSDP2 runs in the block (its collectives go through
    ``dist.all_gather_single`` and ``dist.reduce_scatter_single``)."""
    import torch.distributed as dist

    counts: Counter = Counter()
    saved = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def counted(name):
        def call(*a, **kw):
            counts[name] += 1
            return saved[name](*a, **kw)
        return call

    for name in saved:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _check(name: str, results: list[dict], plan, pp: int) -> None:  # noqa: C901
    ref_loss, ref_grads = _reference(name)
    m, stages = plan.pipeline.chosen.micro_batches, plan.pipeline.stages
    n = len(stages)
    for r in results:  # each rank allocated its stages' shards only, and ran nothing to build
        assert r["from_plan"] and not r["on_meta"], (r["from_plan"], r["on_meta"])
        assert r["layout"] == (True, plan.pipeline.layout)  # what parallelize returns, either kind
    for r in results:  # the point-to-point sends of a step, against the bytes the plan prices at each cut
        forward = m * sum(stages[k].send_bytes for k in r["stages"] if k < n - 1)
        if n == 1:  # one stage: nothing to send
            assert r["sends"] == []
        elif r["stages"] == (0,):  # the first stage sends its activations on, each micro-batch, and nothing back
            assert sum(r["sends"]) == forward > 0, (r["sends"], forward)
        else:  # a later stage also sends back the gradients of what it received that needs one
            back = sum(r["sends"]) - forward
            assert 0 < back <= m * sum(stages[k - 1].send_bytes for k in r["stages"] if k > 0), (r["stages"], r["sends"])
    last = [r for r in results if r["loss"] is not None]
    assert len(last) == len(results) // pp and all(n - 1 in r["stages"] for r in last)
    for r in last:
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-5)
    held: dict[str, torch.Tensor] = {}
    for r in results:  # each rank holds its stage's parameters only, under the model's names
        assert set(r["grads"]) <= set(ref_grads) and set(r["grads"]) <= set(r["state"])
        assert pp == 1 or set(r["grads"]) < set(ref_grads)
        for n in set(r["grads"]) & set(held):  # a weight two stages hold: the same gradient in both
            torch.testing.assert_close(r["grads"][n], held[n], msg=n)
        held.update(r["grads"])
    assert set(held) == set(ref_grads), set(ref_grads) - set(held)
    scale = max(g.abs().max().item() for g in ref_grads.values())
    for n, g in ref_grads.items():
        torch.testing.assert_close(held[n], g, rtol=1e-4, atol=1e-5 * scale, msg=n)
    model, inputs = _model(name.removesuffix("_loss"))
    with torch.no_grad():
        want = model(**inputs).logits
    for r in last:
        torch.testing.assert_close(r["logits"], want, rtol=1e-4, atol=1e-5)
        assert r["eval_loss"] is None or r["eval_loss"] == pytest.approx(ref_loss, rel=1e-5)
    # autotp.checkpoint.full_state_dict: the whole model on every rank (rank=None), or on rank 0
    # alone, equal to the model's own (the step computed gradients only: the weights are as built)
    whole = model.state_dict()
    for i, r in enumerate(results):
        assert set(r["full"]) == set(whole), set(r["full"]) ^ set(whole)  # GPT-2's lm_head.weight, its tied name, too
        for k, v in r["full"].items():
            assert torch.equal(v, whole[k]), k
        assert r["on_zero"].keys() == (r["full"].keys() if i == 0 else set()), i


def _cut_on_one_rank(model, example, plan, stack: str):
    """The rewritten graph of ``model`` on ``example`` (one rank of a tensor axis of 1) and its stages as
    ``plan`` cuts them: ``(stages, whole graph module, rewrite, unit of each node)``. Called in a rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.planning.search.stages import unit_of_nodes
    from autotp.runtime.pipeline.stage_graphs import split_stages, stage_of_units
    from autotp.runtime.rewrite import GraphRewrite
    from autotp.runtime.state import register_state

    graph = autotp.capture(model, example)
    root = torch.nn.Module()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    register_state(root, graph, plan, mesh, model)
    rewrite = GraphRewrite(graph, plan, mesh, root)
    rewrite.emit()
    gm = torch.fx.GraphModule(root, rewrite.fx)
    layers = plan.pipeline.layers
    unit = unit_of_nodes(graph, [f"{stack}.{i}" for i in range(layers)])
    return split_stages(gm, rewrite.origin, unit, stage_of_units(plan.pipeline.stages, layers)), gm, rewrite, unit


def test_stages_run_one_after_the_other_compute_the_whole_graph():
    """The rewritten graph cut at the plan's stages: each stage reads what crosses the cut in front of
    it; run in order on one rank, they give the whole graph's output, and every parameter is in one
    stage."""
    from examples.ranks import run_threads

    plan = _plan("llama", 4, 1, "gpipe", 4)
    assert [(s.first_layer, s.end_layer) for s in plan.pipeline.stages] == [(0, 1), (1, 2), (2, 3), (3, 4)]

    def rank(r, world):
        model, inputs = _model("llama")
        micro = {k: v[:1] for k, v in inputs.items()}
        stages, gm, rewrite, unit = _cut_on_one_rank(model, micro, plan, "model.layers")
        given = dict(zip(stages[0].keywords, (micro["input_ids"], micro["labels"])))
        values: dict = {}
        for s in stages[:-1]:
            values.update(zip(s.outputs, s.module(*(values[n] for n in s.inputs), **given)))
        out = stages[-1].module(*(values[n] for n in stages[-1].inputs), **given)
        owners = {}
        for s in stages:
            for n, _ in s.module.named_parameters():
                owners.setdefault(n, []).append(s.index)
        # each layer as a unit FSDP2 can hold (what a data axis under ZeRO 1 or 3 runs): the layer's nodes
        # and the parameters only it reads moved into a submodule; the stages compute the same
        from autotp.runtime.pipeline.stage_units import group_stage_layers, model_name

        layers = [f"model.layers.{i}" for i in range(4)]
        for s in stages:
            group_stage_layers(s.module, rewrite.origin, unit, layers, recompute=False, with_state=True)
        values = {}
        for s in stages[:-1]:
            values.update(zip(s.outputs, s.module(*(values[n] for n in s.inputs), **given)))
        grouped = stages[-1].module(*(values[n] for n in stages[-1].inputs), **given)
        units = {n: model_name(n) for s in stages for n, _ in s.module.named_parameters()}
        # the logits, which a step does not read, come out as the plan holds them: gathered to compare
        out, whole, grouped = ([o.full_tensor() if hasattr(o, "full_tensor") else o for o in outs]
                               for outs in (out, gm(micro["input_ids"], micro["labels"]), grouped))
        return out, whole, owners, [s.outputs for s in stages], grouped, units

    ((out, whole, owners, crossing, grouped, units),) = run_threads(rank, 1)
    torch.testing.assert_close(out[0], whole[0])  # the loss
    torch.testing.assert_close(out[1], whole[1])  # the logits
    assert all(len(v) == 1 for v in owners.values()) and len(owners) == 39, owners
    assert torch.equal(grouped[0], out[0]) and torch.equal(grouped[1], out[1])
    assert sorted(units.values()) == sorted(owners)  # the model's names read back
    for inside, name in units.items():  # a layer's own weights in its unit; the embedding, norm and head outside
        assert inside.startswith("autotp_pipeline_layer_") == name.startswith("model.layers."), (inside, name)
    assert not crossing[-1] and all(crossing[:-1]), crossing
    assert not {"input_ids", "labels"} & {n for names in crossing for n in names}, "inputs are given, never sent"


def test_two_stage_pipelines_equal_one_process(tmp_path):
    """Llama under 1F1B, built on meta and filled from a saved model (each rank reads its stage's
    tensors), then checkpointed and restored stage by stage; GPT-2 (its embedding tied to the head:
    held by both stages, the gradients summed) under GPipe with its layers recomputed, traced without
    labels and stepped with a loss_fn and a target. 2 stages of 2 layers, 2 micro-batches, on
    2 gloo processes. Both exported with save_pretrained: the files the model's own save_pretrained
    writes (several, and an index), which from_pretrained reads."""
    _model("llama")[0].save_pretrained(tmp_path / "llama")
    cases = [("llama", _plan("llama", 2, 1, "1f1b", 2).to_json(), (2, 1), str(tmp_path / "llama"),
              str(tmp_path / "checkpoint"), str(tmp_path / "llama_export")),
             ("gpt2_loss", _plan("gpt2_loss", 2, 1, "gpipe", 2, recompute=True).to_json(), (2, 1), None, None,
              str(tmp_path / "gpt2_export"))]
    results = run_ranks(_rank, 2, cases)
    for name, *_, export in cases:  # the step computed gradients only: the weights are the model's
        model, inputs = _model(name.removesuffix("_loss"))
        model.save_pretrained(tmp_path / "own", max_shard_size=100_000)
        index = "model.safetensors.index.json"
        assert (tmp_path / "own" / index).read_text() == Path(export, index).read_text()
        loaded = type(model).from_pretrained(export)
        with torch.no_grad():
            torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)
    for i, (name, plan_json, *_) in enumerate(cases):
        _check(name, [r[i] for r in results], autotp.Plan.from_json(plan_json), pp=2)
    assert [r[0]["restored"] for r in results] == [True, True]
    for r in results:
        assert "input 'input_ids' is on meta, but this parallel module computes on cpu" in r[0]["wrong_device"]
    assert [r[1]["recomputed"] for r in results] == [["transformer.h.0", "transformer.h.1"],
                                                     ["transformer.h.2", "transformer.h.3"]]  # the layout's recompute
    assert [r[0]["recomputed"] for r in results] == [[], []]
    both = [set(results[0][i]["grads"]) & set(results[1][i]["grads"]) for i in range(2)]
    assert both[0] == set() and len(both[1]) == 1, both  # only GPT-2's tied embedding is held by two stages


@pytest.mark.slow  # 4 processes
@pytest.mark.parametrize("name,pp,dp,tp,zero,recompute", [
    ("llama", 2, 2, 1, 0, False), ("llama", 1, 2, 2, 3, False), ("llama", 2, 2, 1, 1, False),
    ("llama", 2, 2, 1, 3, False), ("gpt2", 2, 2, 1, 0, False), ("gpt2", 1, 2, 2, 3, True),
    ("gpt2", 3, 2, 1, 1, False)])  # a middle stage's ranks hold no piece of the tied embedding
def test_data_parallel_replicas_equal_one_process(name, pp, dp, tp, zero, recompute, tmp_path):
    """A data axis beside the stages or the tensor axis: each replica runs its rows of the batch, the
    gradients averaged over the replicas (ZeRO 0), or the stages under FSDP2 over the tensor-parallel
    shards, parameters sharded on the data axis (ZeRO 1: kept gathered through the step; ZeRO 3:
    gathered for each pass). Under FSDP2 each rank checkpoints its shards and restores them."""
    schedule = "none" if pp == 1 else "1f1b" if pp == 2 else "gpipe"  # 1F1B needs a micro-batch per stage
    plan = _plan(name, pp, tp, schedule, 2, dp=dp, zero=zero, recompute=recompute)
    checkpoint = str(tmp_path / "checkpoint") if zero else None
    results = run_ranks(_rank, pp * dp * tp, [(name, plan.to_json(), (pp, dp, tp), None, checkpoint)])
    if checkpoint:
        assert [r[0]["restored"] for r in results] == [True] * len(results)
    if recompute:  # each layer a unit FSDP2 shards, run again in the backward
        assert all(len(r[0]["recomputed"]) == 4 for r in results), [r[0]["recomputed"] for r in results]
    _check(name, [r[0] for r in results], plan, pp=pp)
    if not zero:  # the gradients of each rank's stage all-reduced in DDP's buckets, each launched during the
        # last micro-batch's backward (the tiny models' gradients make one bucket: one all-reduce, not
        # one per parameter)
        assert all(r[0]["buckets"][1:] == (1, 1) and r[0]["buckets"][0] > 1 for r in results), [
            r[0]["buckets"] for r in results]
    if zero:  # FSDP2 holds each parameter sharded over the data axis
        assert all("Shard" in str(p) for p in results[0][0]["placements"].values()), results[0][0]["placements"]
        # ... each layer one unit, the rest of its stage another, run as the search prices it
        # (autotp/planning/search/pipeline_search.py): under ZeRO 1 each unit gathers once a step and
        # reduce-scatters once; under ZeRO 3 it gathers for each micro-batch's forward and backward and
        # reduce-scatters after each backward
        m = plan.pipeline.chosen.micro_batches
        for r in results:
            units = r[0]["fsdp_units"]
            assert units == sum(s.end_layer - s.first_layer + (s.before or s.after) for s in plan.pipeline.stages
                                if s.index in r[0]["stages"]), units
            want = {"all_gather_single": units, "reduce_scatter_single": units} if zero == 1 else {
                "all_gather_single": 2 * m * units, "reduce_scatter_single": m * units}
            assert r[0]["fsdp"] == want, (r[0]["fsdp"], want)


@pytest.mark.slow  # 4 processes; the 2-rank pipeline and the stages' cut are in the default suite
@pytest.mark.parametrize("name,pp,tp,schedule,micro", [("llama", 2, 2, "1f1b", 2), ("gpt2", 2, 2, "gpipe", 2),
                                                       ("llama", 4, 1, "1f1b", 4), ("gpt2", 4, 1, "1f1b", 4),
                                                       ("llama", 2, 1, "interleaved_1f1b", 2)])
def test_four_rank_pipelines_equal_one_process(name, pp, tp, schedule, micro):
    plan = _plan(name, pp, tp, schedule, micro)
    if tp > 1:
        assert sum(v != "R" for v in plan.parameter_placements.values()) >= 8  # the stages split their layers
    results = run_ranks(_rank, pp * tp, [(name, plan.to_json(), (pp, tp), None, None)])
    _check(name, [r[0] for r in results], plan, pp=pp)
    if tp > 1:  # the stages of one tensor rank together run the plan's collectives, once per micro-batch
        from collections import Counter

        seen = Counter(c for r in results[::tp] for c in r[0]["collectives"])
        planned: Counter = Counter()
        for c in plan.collectives():
            planned[(c.kind, c.mesh_axis, int(c.bytes))] += plan.pipeline.chosen.micro_batches
        assert seen == planned and seen, (seen, planned)


def test_a_mesh_that_is_not_the_layout_s_is_refused_before_anything_runs():
    """A pp 2 x dp 2 layout given a mesh of 2 ranks: the error names the mesh it needs, and the model
    is as it was."""
    plan = _plan("llama", 2, 1, "1f1b", 2, dp=2)

    def rank(r, world):
        from torch.distributed.device_mesh import init_device_mesh

        model, inputs = _model("llama")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with pytest.raises(autotp.PlanError, match=r"a mesh of shape \(2, 2, 1\) with axes named \('pp', 'dp', 'tp'\)"):
            autotp.parallelize(model, mesh, inputs, plan=plan)
        return all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    from examples.ranks import run_threads

    assert run_threads(rank, 2) == [True, True]


def test_inference_through_stages_that_draw_dropout_masks_is_refused():
    """A layout is planned in train mode: its stages' graphs hold the model's dropout. Their forward
    would apply it to inference whatever eval() says, so it refuses, before any rank runs anything."""
    from types import SimpleNamespace

    from autotp.runtime.pipeline.module import PipelineModule

    with pytest.raises(NotImplementedError, match=r"ShardedDropout: dropout.*mode='inference'"):
        PipelineModule.forward(SimpleNamespace(_draws=["ShardedDropout"]), input_ids=torch.zeros(2, 4))


class _StridedCrossing(torch.nn.Module):
    """A stack of 4 alike layers that each read a transposed view made before the stack (as GPT-J's
    rotary tables are strided views): the view crosses every cut."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        h = self.inp(x)  # (B, T, 8)
        table = h.transpose(1, 2)  # (B, 8, T): not contiguous
        for layer in self.layers:
            h = layer(h) + table.transpose(1, 2).sin()
        return h.pow(2).mean()


def test_what_crosses_a_cut_is_sent_contiguous():
    """A send takes contiguous memory only: each stage returns what crosses its cut contiguous (a strided
    view is copied), where GPT-J's and CodeGen's pipelines failed at their first send."""
    from examples.ranks import run_threads

    torch.manual_seed(0)
    model, x = _StridedCrossing(), torch.randn(2, 4, 8)
    plan = autotp.plan(model, 2, (x,), hardware="cpu-gloo", pipeline={"pp": 2, "tp": 1, "dp": 1, "schedule": "gpipe",
                                                                    "micro_batches": 2})

    def rank(r, world):
        micro = x[:1]
        stages, gm, _, _ = _cut_on_one_rank(model, (micro,), plan, "layers")
        sent = stages[0].module(micro)
        return [(tuple(t.shape), t.is_contiguous()) for t in sent], stages[-1].module(*sent, micro), gm(micro)

    ((sent, out, whole),) = run_threads(rank, 1)
    assert any(len(shape) == 3 and shape[1] == 8 for shape, _ in sent), sent  # the transposed table crosses
    assert all(contiguous for _, contiguous in sent), sent
    torch.testing.assert_close(out, whole)
