"""A device count instead of a mesh (autotp/planning/search/mesh_search.py): the plan of least predicted step
over the shapes of that many devices, each planned as a mesh given directly would be."""

import dataclasses
import json
from types import SimpleNamespace

import pytest

import autotp
from autotp.planning.planner import plan_graph
from autotp.planning.result.plan import PredictedTime
from autotp.planning.search.mesh_search import mesh_shapes, search_meshes
from cost_models import load_profile
from examples import models as M


def test_the_shapes_of_a_device_count():
    assert mesh_shapes(16) == [(16,), (2, 8), (4, 4), (8, 2)]
    assert mesh_shapes(7) == [(7,)] and mesh_shapes(1) == [(1,)]
    for bad in (0, -4, True, 2.5):
        with pytest.raises(ValueError, match="expected a device count"):
            mesh_shapes(bad)


class _Plan(SimpleNamespace):
    """What the search reads of a plan: its mesh, predicted time and peak memory."""

    def predicted_time(self):
        return self.time


def _fake(shape, compute_s, communication_s, peak=1.0):
    return _Plan(mesh=SimpleNamespace(shape=shape), time=PredictedTime(compute_s, communication_s),
                 memory=SimpleNamespace(peak_bytes=peak), mesh_search=())


def test_the_search_keeps_the_fastest_and_says_why_the_others_lost(monkeypatch):
    from autotp.planning.search import mesh_search

    monkeypatch.setattr(mesh_search, "replace", lambda obj, **kw: SimpleNamespace(chosen=obj, **kw))
    times = {(16,): (1.0, 5.0), (2, 8): (1.0, 1.0), (4, 4): (1.5, 1.2), (8, 2): (3.0, 1.0)}
    out = search_meshes(16, 8, lambda shape: _fake(shape, *times[shape]))
    assert out.chosen.mesh.shape == (2, 8)
    assert [c.shape for c in out.mesh_search] == [(2, 8), (4, 4), (8, 2), (16,)]
    assert [c.why for c in out.mesh_search] == ["", "compute +500.000 ms", "compute +2000.000 ms",
                                                "communication +4000.000 ms"]
    assert [c.links for c in out.mesh_search] == [("inter_node", "intra_node")] * 3 + [("inter_node",)]
    # a shape no plan fits is listed last with the least it needs; none fitting raises the least of all
    def plan_on(shape):
        if shape in ((16,), (8, 2)):
            raise autotp.MemoryBudgetError("too small", 3 * 2**30 if shape == (16,) else 2 * 2**30)
        return _fake(shape, *times[shape])

    out = search_meshes(16, 8, plan_on)
    assert [c.shape for c in out.mesh_search][-2:] == [(8, 2), (16,)]
    assert out.mesh_search[-2].why == "no plan fits the memory budget (least 2.0 GiB)"
    # a shape whose solve found no plan in its time is listed with the solver's words
    from autotp.planning.solve.ilp import SolverError

    def timed_out(shape):
        if shape == (4, 4):
            raise SolverError("the ILP solvers failed: HiGHS: no plan found within its time limit of 1.0 s")
        return plan_on(shape)

    out = search_meshes(16, 8, timed_out)
    assert out.chosen.mesh.shape == (2, 8)
    assert next(c for c in out.mesh_search if c.shape == (4, 4)).why.startswith("the solver found no plan: ")
    with pytest.raises(autotp.MemoryBudgetError, match="no mesh of 16 devices has a plan that fits") as err:
        search_meshes(16, 8, lambda shape: plan_on((16,)) if shape != (8, 2) else plan_on((8, 2)))
    assert err.value.minimum_bytes == 2 * 2**30


def _model():
    return M.hf_llama(n_layer=2, hidden=512, ffn=1024, heads=8, kv_heads=4, vocab=4000, seq=128, batch=8,
                      device="meta")


def test_a_device_count_plans_each_shape_and_the_plan_says_so(tmp_path):
    # large enough that splitting pays, few nodes: a two-axis plan in a second
    model, inputs = M.mlp(batch=4096, dim=4096, hidden=16384, depth=2, device="meta")
    profile = dataclasses.replace(load_profile("h100-sxm"), devices_per_node=2)  # 4 devices: two nodes of 2
    chosen = autotp.plan(model, 4, inputs, hardware=profile)
    listed = {c.shape: c for c in chosen.mesh_search}
    assert set(listed) == {(4,), (2, 2)}
    assert chosen.mesh.shape == chosen.mesh_search[0].shape and not chosen.mesh_search[0].why
    assert chosen.predicted_time().total_s == chosen.mesh_search[0].step_s
    assert chosen.predicted_time().total_s <= min(c.step_s for c in chosen.mesh_search)
    # one axis of four crosses the two nodes: all its collectives are priced on the slow link, and it loses
    assert listed[(4,)].links == ("inter_node",) and listed[(2, 2)].links == ("inter_node", "intra_node")
    assert chosen.mesh.shape == (2, 2) and listed[(4,)].why.startswith("communication +")
    # the one-axis shape, planned alone, is priced as the search priced it
    alone = plan_graph(autotp.capture(model, inputs), (4,), profile)
    assert listed[(4,)].step_s == alone.predicted_time().total_s
    text = chosen.report()
    assert "Mesh search: 2 shapes of 4 devices (2 per node)" in text and "init_device_mesh" in text
    path = tmp_path / "plan.json"
    chosen.save(path)
    loaded = autotp.load_plan(path)
    assert loaded.mesh_search == chosen.mesh_search and loaded.mesh.shape == chosen.mesh.shape
    assert json.loads(path.read_text())["mesh_search"][0]["shape"] == list(chosen.mesh.shape)


@pytest.mark.slow
def test_the_search_takes_the_fastest_shape_as_each_planned_alone():
    model, inputs = _model()
    profile = dataclasses.replace(load_profile("h100-sxm"), devices_per_node=2)  # 4 devices: two nodes of 2
    chosen = autotp.plan(model, 4, inputs, hardware=profile)
    graph = autotp.capture(model, inputs)
    alone = {shape: plan_graph(graph, shape, profile) for shape in mesh_shapes(4)}
    steps = {shape: p.predicted_time().total_s for shape, p in alone.items()}
    best = min(steps, key=steps.get)
    assert chosen.mesh.shape == best and chosen.parameter_placements == alone[best].parameter_placements
    assert [c.step_s for c in chosen.mesh_search] == sorted(steps.values())
    # a budget between the shapes' least: those under it are listed as not fitting, the plan fits
    least = {}
    for shape in mesh_shapes(4):
        with pytest.raises(autotp.MemoryBudgetError) as err:
            plan_graph(graph, shape, profile, memory_budget=1)
        least[shape] = err.value.minimum_bytes
    assert len(set(least.values())) == 2  # the shapes need different least budgets
    budget = max(least.values()) * 0.999
    plan = autotp.plan(model, 4, inputs, hardware=profile, memory_budget=budget)
    missed = {c.shape for c in plan.mesh_search if c.step_s is None}
    # a stated least is a budget a plan fits (a stopped least solve states a plan's peak, above the
    # least): under it a shape may or may not fit, at or over it a shape fits
    assert not missed & {s for s, b in least.items() if b <= budget} and plan.memory.peak_bytes <= budget
