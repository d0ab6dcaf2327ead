"""Three-dimensional layouts on paper (autotp/planning/search/stages.py, autotp/planning/search/pipeline_search.py):
a plan read by layer, the stack cut into balanced stages, each layout priced, the fastest that fits
chosen and reported, and a profile's links moving the choice."""

import ast
import dataclasses
import itertools
import json
import random
import re

import pytest
import torch

import autotp
from autotp.planning.costs import buckets
from autotp.planning.costs.buckets import BUCKET_BYTES
from autotp.planning.errors import PlanError
from autotp.planning.planner import plan_graph
from autotp.planning.search.pipeline_search import Candidate, layouts, price_layout, units_of_plan
from autotp.planning.search.stages import balanced_cut
from autotp.tracing.repeats import find_stacks
from cost_models import LinkSpec, collective_time_s, load_profile
from examples import models as M
from examples.ranks import run_threads
from tests.helpers.captures import captures_shared
from tests.helpers.plans import without_pd


def test_the_balanced_cut_is_the_least_slowest_stage():
    """Against every way to cut short chains: the bisection's slowest stage is the least there is."""
    rng = random.Random(1)
    for _ in range(40):
        n = rng.randint(1, 9)
        seconds = [rng.choice([1.0, 2.0, 3.0, rng.uniform(0.5, 4)]) for _ in range(n)]
        for parts in range(1, n + 1):
            cut = balanced_cut(seconds, parts)
            assert len(cut) == parts and cut[0][0] == 0 and cut[-1][1] == n
            assert all(a < b for a, b in cut) and all(cut[i][1] == cut[i + 1][0] for i in range(parts - 1))
            best = min(max(sum(seconds[a:b]) for a, b in zip((0,) + c, c + (n,)))
                       for c in itertools.combinations(range(1, n), parts - 1))
            assert max(sum(seconds[a:b]) for a, b in cut) == pytest.approx(best, rel=1e-9)
    with pytest.raises(ValueError, match="3 units cannot make 4 stages"):
        balanced_cut([1, 1, 1], 4)


def test_every_layout_offered_is_one_torch_pipelining_runs():
    """1F1B runs at least one micro-batch per stage (torch's Schedule1F1B refuses fewer: a batch of 4
    on 2 stages had been offered, and chosen, as one micro-batch of 4); interleaved 1F1B whole rounds."""
    every = layouts(devices=8, devices_per_node=8, layers=8, batch=4)
    assert {x.schedule for x in every} == {"none", "gpipe", "1f1b", "interleaved_1f1b"}
    assert all(x.micro_batches >= x.pp for x in every if x.schedule == "1f1b")
    assert all(x.micro_batches % x.pp == 0 for x in every if x.schedule == "interleaved_1f1b")
    assert any(x.micro_batches < x.pp for x in every if x.schedule == "gpipe")  # GPipe runs any number


def test_a_weight_two_pipeline_ranks_hold_is_priced_as_its_gradient_all_reduce():
    """GPT-2's embedding is tied to its head: the first and the last stage both hold it. The step
    costs, past the same layout with the head's copy untied, one all-reduce of its gradient over
    the pipeline axis (a replica's piece of it under ZeRO 1 and 3); on one rank, nothing."""
    model, (ids,) = M.hf_gpt2(n_layer=4)
    graph = autotp.capture(model.train(), {"input_ids": ids, "labels": ids})
    plan = plan_graph(graph, (2,), "h100-sxm", "train", 1e18, recompute=False, explainable=False)
    stack = find_stacks(model)[0]
    pu = units_of_plan(plan, graph, [stack.layer(i) for i in range(stack.count)])
    tied = [n for n in pu.parameters if n in pu.units[0].parameters and n in pu.units[-1].parameters]
    assert len(tied) == 1  # the embedding, read by the first unit and the head
    untied = dataclasses.replace(pu, units=pu.units[:-1] + (dataclasses.replace(
        pu.units[-1], parameters=tuple(n for n in pu.units[-1].parameters if n != tied[0])),))
    prof = plan.hardware
    for layout, shard in ((Candidate(2, 1, 2, "1f1b", 1, 4, 1, 0, False), 1),
                          (Candidate(2, 2, 2, "1f1b", 1, 2, 1, 1, False), 2)):
        with_tie, _ = price_layout(layout, pu, prof, 1e18)
        without, _ = price_layout(layout, untied, prof, 1e18)
        link = prof.links["intra_node"]  # 8 devices in a node: every axis inside it
        expected = collective_time_s(link, "all_reduce", pu.parameters[tied[0]][1] / shard, 2)
        assert with_tie.step_s - without.step_s == pytest.approx(expected, rel=1e-9)
        assert with_tie.communication_s - without.communication_s == pytest.approx(expected, rel=1e-9)
    one, _ = price_layout(Candidate(1, 2, 2, "none", 1, 2, 1, 0, False), pu, prof, 1e18)
    one_untied, _ = price_layout(Candidate(1, 2, 2, "none", 1, 2, 1, 0, False), untied, prof, 1e18)
    assert one.step_s == one_untied.step_s


@pytest.fixture(scope="module")
def llama_units():
    """A tiny Llama with a loss, planned on (2,): its plan, graph and units."""
    model, (ids,) = M.hf_llama(n_layer=4)
    model.train()
    graph = autotp.capture(model, {"input_ids": ids, "labels": ids})
    plan = plan_graph(graph, (2,), "h100-sxm", "train", 1e18, recompute=False, explainable=False)
    stack = find_stacks(model)[0]
    units = units_of_plan(plan, graph, [stack.layer(i) for i in range(stack.count)])
    return plan, graph, units, stack


def test_the_units_add_up_to_the_plan(llama_units):
    """Every node's compute and every collective and copy falls in exactly one unit: the units sum
    to the plan's predicted compute and communication; the alike layers cost alike; each cut
    between layers carries at least the residual stream as the plan splits it."""
    plan, graph, pu, stack = llama_units
    units = pu.units
    assert len(units) == stack.count + 2
    assert sum(u.forward_compute_s + u.backward_compute_s for u in units) == pytest.approx(plan.time.compute_s)
    assert sum(u.forward_comm_s + u.backward_comm_s for u in units) == pytest.approx(plan.time.communication_s)
    middle = units[2:-2]
    assert all(u.forward_s == pytest.approx(middle[0].forward_s) for u in middle)
    assert all(u.activation_bytes == pytest.approx(middle[0].activation_bytes) for u in middle)
    assert all(0 < u.recomputed_activation_bytes < u.activation_bytes for u in units[1:-1])
    ids = next(n for n in graph.nodes if n.role == "input")
    hidden = next(p.info.shape[-1] for p in graph.parameters if p.fqn.endswith("embed_tokens.weight"))
    residual_bytes = ids.output.numel * hidden * 4  # fp32; a rank holds at least half
    assert all(u.send_bytes >= residual_bytes / 2 for u in units[:-1]) and units[-1].send_bytes == 0
    # every parameter in some unit; the state of the units is the plan's
    assert set().union(*(u.parameters for u in units)) == {n.name for n in graph.nodes if n.role == "parameter"}
    assert sum(v[0] for v in pu.parameters.values()) == pytest.approx(plan.memory.parameters_bytes)


def test_collectives_an_op_runs_inside_count_once_in_the_units():
    """Routed experts (the grouped matmuls send their rows by all-to-all inside themselves, pinned
    so on (2,)): the units' compute and communication add up to the plan's, where the all-to-alls
    count once, as communication; a unit counting them in its compute too would exceed it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = transformers.Qwen3MoeForCausalLM(config).train()
    ids = torch.zeros(4, 12, dtype=torch.long)
    graph = autotp.capture(model, {"input_ids": ids, "labels": ids})
    pin = {n: "S(0)" for n, p in model.named_parameters() if p.ndim == 3}
    with without_pd():  # the tokens sent to their experts' ranks, not every token on every rank
        plan = plan_graph(graph, (2,), "h100-sxm", "train", 1e18, recompute=False, explainable=False, pin=pin)
    inside = [c for c in plan.collective_list if c.kind == "all_to_all"]
    assert inside, "the routed variant's all-to-alls"
    stack = find_stacks(model)[0]
    units = units_of_plan(plan, graph, [stack.layer(i) for i in range(stack.count)]).units
    assert sum(u.forward_compute_s + u.backward_compute_s for u in units) == pytest.approx(plan.time.compute_s)
    assert sum(u.forward_comm_s + u.backward_comm_s for u in units) == pytest.approx(plan.time.communication_s)


def test_a_plain_layout_is_priced_from_a_plan_that_returns_every_output_whole(llama_units):
    """The layouts with stages, replicas or another axis are priced from plans whose step reads the
    loss alone; a plain layout (pp 1 x dp 1 x tp n), which runs as one module returning every output
    whole, from its own plan that gathers them (autotp/planning/search/step_reads.py)."""
    plan, _, pu, stack = llama_units
    asked = []

    def units_for(tp, b, *axes, whole_outputs=False):
        asked.append((tp, b, axes, whole_outputs))
        return pu

    from autotp.planning.search.pipeline_search import search_layouts

    search_layouts(2, plan.hardware, 1e18, stack.path, stack.count, 2, units_for)
    plain = [a for a in asked if a[3]]
    assert plain and all(tp == 2 and not axes for tp, _, axes, _ in plain), asked
    assert any(tp == 1 and not whole for tp, _, _, whole in asked), asked  # stages or replicas: the step's plan


def test_a_stage_holds_the_largest_working_set_of_its_layers_once(llama_units):
    """A layer's attention holds its working set (a chunk's masks, the ring's blocks and chunks in
    flight) during its own backward only: a stage of four layers holding W each peaks W higher, not
    4 W."""
    plan, _, pu, _ = llama_units
    w = 3.0e9
    working = dataclasses.replace(pu, units=tuple(dataclasses.replace(u, working_bytes=w if 0 < i < len(pu.units) - 1
                                                                      else 0.0) for i, u in enumerate(pu.units)))
    layout = Candidate(1, 1, 2, "none", 1, 1, 2, 0, False)
    without, _ = price_layout(layout, pu, plan.hardware, 1e18)
    with_w, _ = price_layout(layout, working, plan.hardware, 1e18)
    assert with_w.peak_bytes - without.peak_bytes == pytest.approx(w)


def test_a_layout_priced_by_hand(llama_units, monkeypatch):
    """One stage over two data-parallel replicas: m micro-batches one after the other, the gradients
    all-reduced in DDP's buckets during the last backward; two stages under 1F1B: rank 0 holds two
    micro-batches' activations."""
    plan, _, pu, _ = llama_units
    prof = plan.hardware
    units = pu.units
    grads = sum(v[1] for v in pu.parameters.values())
    assert grads < BUCKET_BYTES  # one bucket, ready when the backward ends: nothing hides it
    one, _ = price_layout(Candidate(1, 2, 2, "none", 1, 3, 1, 0, False), pu, prof, 1e18)
    per_mb = sum(u.forward_s + u.backward_s for u in units)
    link = prof.links["intra_node"]
    backward_compute = sum(u.backward_compute_s for u in units)  # what one micro-batch's backward computes
    reduce = collective_time_s(link, "all_reduce", grads, 2)
    assert one.step_s == pytest.approx(3 * per_mb + reduce)
    slow_link = LinkSpec({k: c.scaled(1e-4) for k, c in prof.links["intra_node"].costs.items()})
    slow = dataclasses.replace(prof, links={**prof.links, "intra_node": slow_link})
    slow_one, _ = price_layout(Candidate(1, 2, 2, "none", 1, 3, 1, 0, False), pu, slow, 1e18)
    slow_reduce = collective_time_s(slow.links["intra_node"], "all_reduce", grads, 2)
    assert slow_one.step_s - one.step_s == pytest.approx(slow_reduce - reduce)
    # two buckets: every parameter but the first the forward reads (the embedding), then the embedding
    # alone, ready when the backward ends. On a link fast enough the first bucket's all-reduce ends
    # within the backward (it is ready once the backward has made its share of the bytes): only the
    # last bucket's adds to the step
    first = units[0].parameters[0]
    monkeypatch.setattr(buckets, "BUCKET_BYTES", grads - pu.parameters[first][1])
    fast_link = LinkSpec({k: c.scaled(1e4) for k, c in prof.links["intra_node"].costs.items()})
    fast = dataclasses.replace(prof, links={**prof.links, "intra_node": fast_link})
    rest = collective_time_s(fast_link, "all_reduce", grads - pu.parameters[first][1], 2)
    assert rest < backward_compute * pu.parameters[first][1] / grads
    two_buckets, _ = price_layout(Candidate(1, 2, 2, "none", 1, 3, 1, 0, False), pu, fast, 1e18)
    last = collective_time_s(fast_link, "all_reduce", pu.parameters[first][1], 2)
    assert two_buckets.step_s == pytest.approx(3 * per_mb + last)
    assert one.bubble_s == pytest.approx(0.0, abs=1e-12)
    # the memory of one stage on two replicas. ZeRO 0 holds everything whole. ZeRO 1 and 3 run as the
    # runtime runs FSDP2 (each layer a unit, the embedding, final norm and head another) and hold shards
    # of everything at the optimizer's step; while the stage runs, ZeRO 1 holds every unit gathered,
    # ZeRO 3 the embedding's unit and two layers (one prefetched); the gradients accumulated over the
    # micro-batches sit beside the activations, whole but under ZeRO 3
    p, g, o, t = (sum(v[j] for v in pu.parameters.values()) for j in range(4))
    buffers = sum(u.buffers_bytes for u in units)
    acts, transient = sum(u.activation_bytes for u in units), sum(u.transient_bytes for u in units)
    assert one.peak_bytes == pytest.approx(max(p + o + g + buffers + acts + transient, p + o + buffers + g + t))
    z1, _ = price_layout(Candidate(1, 2, 2, "none", 1, 3, 1, 1, False), pu, prof, 1e18)
    z3, _ = price_layout(Candidate(1, 2, 2, "none", 1, 3, 1, 3, False), pu, prof, 1e18)
    root = set(units[0].parameters) | set(units[-1].parameters)
    layer = max(sum(pu.parameters[n][0] for n in set(u.parameters) - root) for u in units[1:-1])
    at_step = (p + g + o + t) / 2 + buffers
    assert z1.peak_bytes == pytest.approx(max(p + p / 2 + o / 2 + g + buffers + acts + transient, at_step))
    during3 = p / 2 + sum(pu.parameters[n][0] for n in root) + 2 * layer
    assert z3.peak_bytes == pytest.approx(max(during3 + o / 2 + g / 2 + buffers + acts + transient, at_step))
    assert z3.peak_bytes < z1.peak_bytes
    # ... ZeRO 1 gathers once a step beside the first forward and reduce-scatters after the last
    # backward; ZeRO 3 both for every micro-batch, beside its compute
    gather, scatter = collective_time_s(link, "all_gather", p, 2), collective_time_s(link, "reduce_scatter", grads, 2)
    forward_compute = sum(u.forward_compute_s for u in units)
    assert z1.step_s == pytest.approx(3 * per_mb + scatter + max(gather - forward_compute, 0.0))
    assert z3.step_s == pytest.approx(3 * (per_mb + max(gather - forward_compute, 0.0)
                                           + max(gather + scatter - backward_compute, 0.0)))
    two, stages = price_layout(Candidate(2, 1, 2, "1f1b", 1, 4, 1, 0, False), pu, prof, 1e18)
    peaks = []
    for s, held in zip(stages, (2, 1)):  # 1F1B: rank r holds pp - r micro-batches
        mine = ([units[0]] if s.before else []) + [units[1 + i] for i in range(s.first_layer, s.end_layer)] + (
            [units[-1]] if s.after else [])
        names = set().union(*(u.parameters for u in mine))
        p, g, o, t = (sum(pu.parameters[n][j] for n in names) for j in range(4))
        state = p + o + sum(u.buffers_bytes for u in mine)
        assert s.state_bytes == pytest.approx(state)
        peaks.append(max(state + g + held * sum(u.activation_bytes for u in mine) + sum(u.transient_bytes for u in mine),
                         state + g + t))
    assert two.peak_bytes == pytest.approx(max(peaks))
    rec, _ = price_layout(Candidate(2, 1, 2, "1f1b", 1, 4, 1, 0, True), pu, prof, 1e18)
    assert rec.peak_bytes <= two.peak_bytes and rec.step_s > two.step_s  # recompute: no more held, more work
    tight, _ = price_layout(Candidate(2, 1, 2, "1f1b", 1, 4, 1, 0, False), pu, prof, two.peak_bytes * 0.99)
    assert tight.step_s is None and tight.peak_bytes == two.peak_bytes


def _two_nodes_of_two(inter_like_intra: bool):
    base = load_profile("h100-sxm")
    links = dict(base.links)
    if inter_like_intra:
        links["inter_node"] = links["intra_node"]
    return dataclasses.replace(base, name="flat" if inter_like_intra else "h100-2", devices_per_node=2, links=links)


@pytest.fixture(scope="module")
def searched():
    model, (ids,) = M.hf_llama(n_layer=4, hidden=2048, ffn=8192, heads=16, kv_heads=4, vocab=32000, seq=256, batch=2,
                               device="meta")
    model.train()
    inputs = {"input_ids": ids, "labels": ids}
    with captures_shared():  # the two profiles' searches trace the same micro-batches
        return {flat: autotp.plan(model, 4, inputs, hardware=_two_nodes_of_two(flat), pipeline=True)
                for flat in (True, False)}


def test_a_slower_link_across_nodes_moves_the_choice_to_pipeline_stages_across_them(searched):
    """Two nodes of two: where the link across nodes is as fast as inside one, the layout has no
    stages (no bubble to pay), data parallelism crossing the nodes; on h100-sxm's slower link across
    nodes, the pipeline axis crosses them and only activations go over it."""
    flat, h100 = searched[True].pipeline, searched[False].pipeline
    assert flat.chosen.pp == 1 and dict(flat.links)["data"] == "inter_node"
    assert h100.chosen.pp > 1 and dict(h100.links)["pipeline"] == "inter_node"
    assert dict(h100.links)["tensor"] == "intra_node"


def test_the_search_keeps_the_fastest_that_fits_and_says_why_each_lost(searched):
    pc = searched[False].pipeline
    fitting = [c for c in pc.candidates if c.step_s is not None]
    assert pc.candidates[0] == pc.chosen and pc.chosen.why == ""
    assert pc.chosen.step_s == min(c.step_s for c in fitting)
    assert [c.step_s for c in fitting] == sorted(c.step_s for c in fitting)
    assert all(c.why.split(" ")[0] in ("bubble", "communication", "compute", "as", "at", "memory:") for c in pc.candidates[1:])
    assert pc.priced > len(pc.candidates)
    # the stages cover the stack once, in order, first with the embedding, last with the head
    assert [(s.first_layer, s.end_layer) for s in pc.stages][0][0] == 0 and pc.stages[-1].end_layer == pc.layers
    assert all(a.end_layer == b.first_layer for a, b in zip(pc.stages, pc.stages[1:]))
    assert pc.stages[0].before and pc.stages[-1].after
    assert len(pc.stages) == pc.chosen.pp * pc.chosen.stages_per_rank
    assert [s.rank for s in pc.stages] == [k % pc.chosen.pp for k in range(len(pc.stages))]


def test_the_report_and_the_file_keep_the_layout(searched, tmp_path):
    plan = searched[False]
    text = plan.report()
    c = plan.pipeline.chosen
    assert "Layout search:" in text and f"Chosen: {c.describe()}" in text
    assert text.splitlines()[0].startswith(f"autotp plan: LlamaForCausalLM on {plan.pipeline.devices} devices laid "
                                           f"out as {c.describe()}, each stage's plan on mesh ")
    # the mesh the report names is the one autotp.parallelize takes for the layout
    from types import SimpleNamespace

    found = re.search(r"init_device_mesh\(\.\.\., (\([0-9, ]+\)), mesh_dim_names=(\([a-z', ]+\))\) for autotp\.parallelize",
                      text)
    assert found and "before model.layers" in text, text
    shape, names = ast.literal_eval(found.group(1)), ast.literal_eval(found.group(2))
    assert c.layout.mesh_problem(SimpleNamespace(mesh_dim_names=names, mesh=torch.empty(shape))) == ""
    assert c.layout.mesh_problem(SimpleNamespace(mesh_dim_names=("pipeline",), mesh=torch.empty(c.pp))) != ""
    # pp 1 x dp 1 is a plain tensor-parallel plan: autotp.parallelize runs it on the plan's own mesh, as
    # one module returning every output whole (the stages' plan leaves the logits as it holds them)
    model, (ids,) = M.hf_llama(n_layer=4)
    flat = autotp.plan(model.train(), 2, {"input_ids": ids, "labels": ids}, hardware="h100-sxm",
                       pipeline={"pp": 1, "dp": 1, "tp": 2})
    assert "init_device_mesh(..., (2,), mesh_dim_names=('tp',)) for autotp.parallelize" in flat.report()
    assert flat.pipeline.layout.plain and not flat.unread_outputs
    assert c.pp > 1 and len(plan.unread_outputs) == 1  # the logits, beside the loss
    assert f"the model's other outputs ({plan.unread_outputs[0]} [" in text and "Outputs: a step returns the loss alone" in text
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = autotp.load_plan(path)
    assert loaded.unread_outputs == plan.unread_outputs
    assert loaded.pipeline == dataclasses.replace(plan.pipeline, search_s=None)
    assert json.loads(loaded.to_json()) == json.loads(plan.to_json())


def test_the_report_gives_the_layouts_memory_and_each_stack_once(searched):
    """The memory per device is the chosen layout's peak, as the search priced it (pp 2 holds half the
    layers: the stage plan's own figure, every layer on the tensor axis, is larger and labelled as the
    stage plan's); the four alike layers' rows show once, as model.layers.{0..3}; the plan keeps them all."""
    from autotp.units import format_bytes

    plan = searched[False]
    c, text = plan.pipeline.chosen, plan.report()
    memory = next(line for line in text.splitlines() if line.startswith("Memory per device"))
    assert memory.startswith(f"Memory per device: {format_bytes(c.peak_bytes)} of "
                             f"{format_bytes(plan.memory.budget_bytes)} budget at its peak, the chosen layout's "
                             f"({c.describe()}")
    stage = next(line for line in text.splitlines() if line.startswith("The stage plan alone"))
    assert format_bytes(plan.memory.total_bytes) in stage and "not what a device of the layout holds" in stage
    assert c.pp > 1 and plan.memory.total_bytes > c.peak_bytes  # the two figures differ here
    modules = text.split("\nModules")[1].split("\nCollectives")[0]
    assert "model.layers.{0..3}.mlp.down_proj" in modules and "model.layers.1." not in modules
    assert {f"model.layers.{i}.mlp.down_proj" for i in range(4)} <= set(plan.module_styles())


def test_alike_layers_are_shown_once_and_unlike_ones_apart():
    """A run of layers with the same rows is one row per module; a layer whose row differs (it
    recomputes) starts a run of its own, and rows outside any stack stay as they are."""
    from autotp.planning.result.report import alike_layers

    rows = [["embed", "rowwise"]] + [[f"layers.{i}.mlp", "colwise", "yes" if i < 2 else ""] for i in range(5)] + [
        [f"layers.{i}", "replicate", "yes" if i < 2 else ""] for i in range(5)] + [["head", "colwise"]]
    assert alike_layers(rows) == [["embed", "rowwise"], ["layers.{0..1}.mlp", "colwise", "yes"],
                                  ["layers.{2..4}.mlp", "colwise", ""], ["layers.{0..1}", "replicate", "yes"],
                                  ["layers.{2..4}", "replicate", ""], ["head", "colwise"]]
    assert alike_layers([["h.0.attn", "colwise"], ["h.1.attn", "rowwise"]]) == [["h.0.attn", "colwise"],
                                                                               ["h.1.attn", "rowwise"]]


def test_bad_requests_are_refused_before_any_capture():
    model, (ids,) = M.hf_llama(n_layer=4)
    with pytest.raises(ValueError, match="give the number of devices"):
        autotp.plan(model, (2, 2), (ids,), pipeline=True)
    with pytest.raises(ValueError, match="mode='train'"):
        autotp.plan(model, 4, (ids,), mode="inference", pipeline=True)
    with pytest.raises(ValueError, match="no stack of alike layers"):
        autotp.plan(torch.nn.Linear(8, 8), 2, (torch.randn(4, 8),), pipeline=True)


def _parallelize_a_layout_plan(rank, world, plan):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, (ids,) = M.hf_llama(n_layer=4, hidden=2048, ffn=8192, heads=16, kv_heads=4, vocab=32000, seq=256, batch=2,
                               device="meta")
    before = {k: (v.shape, v.dtype, v.device) for k, v in model.state_dict().items()}
    try:
        autotp.parallelize(model, mesh, (ids,), plan=plan)
        return None
    except PlanError as err:
        after = {k: (v.shape, v.dtype, v.device) for k, v in model.state_dict().items()}
        return str(err), before == after


def test_parallelize_says_which_mesh_a_layout_runs_on_and_leaves_the_model(searched):
    plan = searched[False]
    c = plan.pipeline.chosen
    message, untouched = run_threads(_parallelize_a_layout_plan, 1, plan)[0]
    names = ("pp", "dp", "tp") if c.dp > 1 else ("pp", "tp")
    shape = (c.pp, c.dp, c.tp) if c.dp > 1 else (c.pp, c.tp)
    expected = f"a mesh of shape {shape} with axes named {names}"
    assert expected in message and c.describe() in message and untouched, message


def test_stages_going_round_the_ranks_are_cut_for_the_busiest_rank():
    """80 alike layers in 32 stages over 8 ranks (interleaved, 4 each): at most 3 layers a stage,
    and each rank 10 layers, not 9 on one and 11 on another."""
    cut = balanced_cut([1.0] * 80, 32, ranks=8, micro_batches=8)
    sizes = [b - a for a, b in cut]
    assert max(sizes) == 3
    assert {sum(sizes[k] for k in range(r, 32, 8)) for r in range(8)} == {10}
