"""The parallel module at batch and sequence sizes other than the example's (autotp.tracing.dynamic).

Each model is captured and planned once at its example sizes (batch 4 x 16 tokens) under a memory
budget that forces sharding, then run on two threaded ranks at other sizes, with no new plan: the
outputs and every gradient must equal the original model's in one process at those sizes. Sizes
the plan cannot take (a dim it splits that does not divide, a static dim, unequal dims the model
needs equal) are refused before any collective, with the input, dim, size and divisor named.
"""

from __future__ import annotations

import functools

import pytest
import torch

from examples import models
from examples.ranks import run_threads
from tests.helpers.observed import CollectiveLog, tensor_of

pytestmark = pytest.mark.timeout(600)

FACTORIES = ("mlp", "tiny_gpt", "tiny_llama", "tiny_bert", "hf_llama", "hf_gpt2", "hf_bert")
# the default run: one of each kind (an MLP, a causal LM of ours, GPT-2's Conv1D, an HF encoder);
# the others under -m slow
_SLOW = ("tiny_gpt", "tiny_bert", "hf_llama")
EXAMPLE = {"batch": 4, "seq": 16}
# (batch, seq) to run at: smaller, larger, and a sequence the example's is not a multiple of
OTHER_SIZES = ((2, 8), (6, 24), (8, 12))


def _model(name: str):
    """The model, the same seeded weights at every call (room for 32 positions); one layer of the
    language models (a second, alike, doubled the capture and the plan and tested nothing more)."""
    return getattr(models, name)(device="cpu", **({} if name == "mlp" else {"seq": 32, "n_layer": 1}))[0]


def _inputs(name: str, batch: int, seq: int) -> tuple:
    g = torch.Generator().manual_seed(batch * 1000 + seq)
    if name == "mlp":
        return (torch.randn(batch, 64, generator=g),)
    return (torch.randint(0, 128, (batch, seq), generator=g),)


@functools.lru_cache(maxsize=None)  # several tests read the same prepared model: planned once (both are values)
def _prepare(name: str, world: int = 2, mode: str = "train", budget_scale: float = 1.05, dynamic_dims=None):
    """``(graph, plan)`` at the example sizes, planned to a budget just above the minimum."""
    import autotp
    from autotp.planning.planner import plan_graph

    graph = autotp.capture(_model(name), _inputs(name, EXAMPLE["batch"], EXAMPLE["seq"]), dynamic_dims=dynamic_dims)
    # without recompute: these plans are to shard (tests/planning/test_recompute.py runs recompute at other sizes)
    try:
        plan_graph(graph, (world,), "cpu-gloo", mode, 1.0, recompute=False)
    except autotp.MemoryBudgetError as err:
        budget = int(err.minimum_bytes * budget_scale) + 1
    return graph, plan_graph(graph, (world,), "cpu-gloo", mode, budget, recompute=False)


def _run_at_sizes(rank, world, name, prepared, sizes):
    """Build from ``prepared``, then per (batch, seq): outputs and gradients against one process."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    graph, plan = prepared
    pm = build_parallel_module(graph, plan, mesh, _model(name))
    ref = _model(name)
    assert {"colwise", "rowwise"} & set(plan.module_styles().values()), "the plan does not shard"
    errors = []
    for batch, seq in sizes:
        inp = _inputs(name, batch, seq)
        for m in (pm, ref):
            m.zero_grad(set_to_none=True)
        out = pm(*inp)
        out_ref = ref(*inp)
        o, r = tensor_of(out), tensor_of(out_ref)
        assert o.shape == r.shape, f"{name} at {batch}x{seq}: output shape {list(o.shape)}, expected {list(r.shape)}"
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5 * r.abs().max().item())
        target = torch.randn(r.shape, generator=torch.Generator().manual_seed(7))
        (o - target).pow(2).mean().backward()
        (r - target).pow(2).mean().backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        gmax = max(g.abs().max().item() for g in grads.values() if g is not None)
        for n, p in pm.named_parameters():
            full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(full, grads[n], rtol=1e-4, atol=1e-5 * gmax,
                                       msg=lambda m, n=n: f"{name} at {batch}x{seq}, gradient of {n}: {m}")
        errors.append((batch, seq, (o - r).abs().max().item()))
    return errors


@pytest.mark.parametrize("name", [pytest.param(f, marks=pytest.mark.slow) if f in _SLOW else f for f in FACTORIES])
def test_other_batch_and_sequence_sizes_are_exact(name):
    prepared = _prepare(name)
    graph = prepared[0]
    dims = {(d.input, d.dim) for d in graph.dynamic}
    expected = {("x", 0)} if name == "mlp" else {("input_ids", 0), ("input_ids", 1)}
    assert dims == expected, f"{name}: dynamic dims {sorted(dims)}, expected {sorted(expected)}"
    run_threads(_run_at_sizes, 2, name, prepared, ((EXAMPLE["batch"], EXAMPLE["seq"]), *OTHER_SIZES))


def _refused(rank, world, name, prepared, inputs):
    """Each call must raise before any collective; returns the messages."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    graph, plan = prepared
    pm = build_parallel_module(graph, plan, mesh, _model(name))
    messages = []
    for inp in inputs:
        log = CollectiveLog(mesh)
        with log, pytest.raises(ValueError) as info:
            pm(*inp)
        assert not log.counts(), f"collectives ran before the error: {dict(log.counts())}"
        messages.append(str(info.value))
    return messages


def test_static_dims_refuse_other_sizes_gpt2_regression():
    """GPT-2 built for 8 x 64 and called with 16 x 32 once returned logits of shape [8, 64, vocab]: with
    dynamic dims it is exact (above); with every dim static it must refuse, naming the dim."""
    prepared = _prepare("hf_gpt2", dynamic_dims=False)
    assert not prepared[0].dynamic
    ids = torch.zeros(8, 8, dtype=torch.int64)
    messages = run_threads(_refused, 2, "hf_gpt2", prepared, [(ids,)])[0]
    assert "input 'input_ids': dim 0 has size 8, but this parallel module was built for size 4" in messages[0]


def test_explicit_dynamic_dims_and_bad_ones():
    import autotp

    model, inp = _model("tiny_llama"), _inputs("tiny_llama", 4, 16)
    graph = autotp.capture(model, inp, dynamic_dims={"input_ids": (1,)})
    assert [(d.input, d.dim) for d in graph.dynamic] == [("input_ids", 1)]
    with pytest.raises(ValueError, match=r"dynamic_dims names \['ids'\], which are not tensor arguments"):
        autotp.capture(model, inp, dynamic_dims={"ids": (0,)})
    with pytest.raises(ValueError, match=r"dynamic_dims\['input_ids'\] = \[2\]: the example input_ids has 2 dims"):
        autotp.capture(model, inp, dynamic_dims={"input_ids": (2,)})
    with pytest.raises(TypeError, match="dynamic_dims is a list"):
        autotp.capture(model, inp, dynamic_dims=[0, 1])
    with pytest.raises(TypeError, match="dynamic_dims is an int"):  # the article as it is said
        autotp.capture(model, inp, dynamic_dims=1)


def test_sizes_the_plan_cannot_split_are_refused_before_any_collective():
    """Where the plan splits a dynamic dim over the 2 ranks, an odd size is refused by name; so is a
    size below the range the trace holds for. Which dim a plan splits is the planner's choice: the
    test reads it from the plan's requirements, and checks that some model here has one on each."""
    from autotp.tracing.dynamic import requirements

    split = {}
    for name in ("tiny_llama", "hf_bert"):
        prepared = _prepare(name)
        graph, plan = prepared
        for req in requirements(graph.symbolic, graph.nodes, plan.strategies, (2,)):
            dim = next(d.dim for d in graph.dynamic if d.symbol == req.expression)
            split.setdefault(dim, (name, prepared, req))
    assert set(split) == {0, 1}, f"no plan here splits both batch and sequence: {split}"
    for dim, (name, prepared, req) in split.items():
        sizes = [4, 16]
        sizes[dim] += 1  # odd
        small = [4, 16]
        small[dim] = 1
        messages = run_threads(_refused, 2, name, prepared, [_inputs(name, *sizes), _inputs(name, *small)])[0]
        assert messages[0].startswith(
            f"input 'input_ids': dim {dim} has size {sizes[dim]}, but the plan splits it over 2 ranks "
            f"(tensor {req.tensor}) and needs a multiple of 2"), messages[0]
        assert messages[1].startswith(
            f"input 'input_ids': dim {dim} has size 1, but this parallel module was traced for sizes "), messages[1]


def test_report_lists_dynamic_dims_and_what_the_plan_needs():
    graph, plan = _prepare("hf_bert")
    text = plan.report()
    assert "input_ids dim 0: example 4, any size >= 2" in text, text
    # BERT's 512 position embeddings bound the sequence: the trace found it
    assert "input_ids dim 1: example 16, any size >= 2 and <= 512, a multiple of 2" in text, text


NEW_TOKENS = 16


def build():
    """A small random Llama (seeded, built one thread at a time) and a 12-token prompt."""
    return models.hf_llama(n_layer=2, hidden=128, ffn=256, heads=8, kv_heads=4, vocab=512, seq=12)


def greedy(model, prompt: torch.Tensor, steps: int) -> list[int]:
    """``steps`` tokens, each the argmax of the logits of the whole sequence so far (no cache: the
    module sees every length from the prompt's on)."""
    ids = prompt
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(ids).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, prompt.shape[1]:].tolist()


def _generate(rank, world, prepared, prompt):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    graph, plan = prepared
    pm = build_parallel_module(graph, plan, mesh, build()[0])
    return greedy(pm, prompt, NEW_TOKENS)


def test_greedy_generation_under_inference_mode_equals_one_process():
    """Greedy decoding without a cache on two ranks: an inference plan for a 12-token prompt runs
    every length from 12 to 27 under torch.inference_mode() and picks the same tokens as one process."""
    import autotp
    from autotp.planning.planner import plan_graph

    model, (prompt,) = build()
    prompt = prompt[:1]
    graph = autotp.capture(model, (prompt,), dynamic_dims=None)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = plan_graph(graph, (2,), "cpu-gloo", "inference", 0.8 * full_bytes)
    assert {"colwise", "rowwise"} <= set(plan.module_styles().values())
    assert [(d.input, d.dim) for d in plan.dynamic_dims] == [("input_ids", 1)]  # batch 1 is static
    expected = greedy(model, prompt, NEW_TOKENS)
    assert len(set(expected)) > 1, "a degenerate reference (one token repeated) would prove little"
    for tokens in run_threads(_generate, 2, (graph, plan), prompt):
        assert tokens == expected


def _with_given_plans(rank, world, static_plan, dynamic_plan):
    from torch.distributed.device_mesh import init_device_mesh

    import autotp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = models.tiny_llama(n_layer=1)[0]
    example, other = _inputs("tiny_llama", 4, 16), _inputs("tiny_llama", 2, 8)
    static = autotp.parallelize(model, mesh, example, plan=static_plan)
    with pytest.raises(ValueError, match="dim 0 has size 2, but this parallel module was built for size 4"):
        static(*other)
    dynamic = autotp.parallelize(model, mesh, example, plan=dynamic_plan)
    return (dynamic(*other) - model(*other)).abs().max().item()


def test_a_given_plan_is_built_as_it_was_traced():
    """``parallelize(plan=...)`` traces the model as the plan was traced (the graphs differ: a symbolic
    trace keeps full-range slices a static one drops), so a saved plan of either kind fits."""
    import autotp

    model, example = models.tiny_llama(n_layer=1)[0], _inputs("tiny_llama", 4, 16)
    static_plan = autotp.plan(model, (1,), example, hardware="cpu-gloo")
    dynamic_plan = autotp.Plan.from_json(autotp.plan(model, (1,), example, hardware="cpu-gloo",
                                                     dynamic_dims=None).to_json())
    assert not static_plan.dynamic_dims and dynamic_plan.dynamic_dims
    assert len(static_plan.nodes) != len(dynamic_plan.nodes)
    assert run_threads(_with_given_plans, 1, static_plan, dynamic_plan)[0] < 1e-5


class _Branchy(torch.nn.Module):
    """Branches on the parity of the sequence: the trace keeps one branch and records the condition."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):  # (B, T, 8)
        return self.lin(x) * (2.0 if x.shape[1] % 2 == 0 else 3.0)


def _branchy(rank, world, graph, plan, model):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = build_parallel_module(graph, plan, mesh, model)
    ok = (pm(torch.ones(2, 6, 8)) - model(torch.ones(2, 6, 8))).abs().max().item()
    log = CollectiveLog(mesh)
    with log, pytest.raises(ValueError) as info:
        pm(torch.ones(2, 7, 8))
    assert not log.counts()
    return ok, str(info.value)


def test_conditions_the_trace_recorded_from_the_model_are_checked():
    import autotp
    from autotp.planning.planner import plan_graph

    graph = autotp.capture(_Branchy(), (torch.ones(4, 16, 8),), dynamic_dims=None)
    plan = plan_graph(graph, (2,), "cpu-gloo", "train")
    ok, message = run_threads(_branchy, 2, graph, plan, _Branchy())[0]
    assert ok < 1e-6
    assert message.startswith("the inputs break a condition on sizes that the model's code relies on"), message
    assert "% 2" in message, message


class _Positions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, x):  # (B, T, 8), T <= 16
        return x + self.pos[:x.shape[1]]


def test_a_slice_to_a_dynamic_length_is_not_the_whole_dim():
    """``pos[:T]`` equals ``pos`` at the example's T = 16 only: with T dynamic, splitting the sliced dim
    on both sides would give each rank 8 rows of ``pos`` for 4 rows of ``x`` at T = 8."""
    import autotp
    from autotp.planning.choices.strategies import all_strategies

    choices = {}
    for dynamic_dims in (None, False):
        graph = autotp.capture(_Positions(), (torch.randn(4, 16, 8),), dynamic_dims=dynamic_dims)
        strategies = all_strategies(graph, (2,))
        (node,) = [n for n in graph.nodes if n.target == "aten.slice.Tensor"]
        choices[dynamic_dims] = {str(s) for s in strategies[node.name]}
    assert "(S(0)) -> S(0)" not in choices[None] and "(S(1)) -> S(1)" in choices[None]
    assert "(S(0)) -> S(0)" in choices[False]  # static: the slice is the whole dim, splitting it is exact
