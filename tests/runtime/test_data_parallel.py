"""The data axis's runtime (``autotp/runtime/data_parallel.py``) over a plain ``ParallelModule``: a
tensor-parallel module on the tensor axis of a dp 2 x tp 2 mesh, one replica of the data axis,
equals one process (the pipeline's stages use it too: tests/runtime/test_pipeline_runtime.py)."""

from __future__ import annotations

import pytest
import torch

from autotp.layout import Layout
from examples.ranks import run_threads
from tests.helpers.plans import sharded_mlp

DP, TP = 2, 2


def _replica(rank, world, graph, plan, model, x, zero, steps):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.layout import DATA, TENSOR
    from autotp.runtime.data_parallel import DataParallel
    from autotp.runtime.module import build_parallel_module

    layout = Layout(dp=DP, tp=TP, zero=zero)
    mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=layout.axis_names)
    pm = build_parallel_module(graph, plan, layout.sub_mesh(mesh, TENSOR), model)
    dp = DataParallel([pm], layout.data, layout.sub_mesh(mesh, DATA))
    rows = x.chunk(DP)[layout.sub_mesh(mesh, DATA).get_local_rank()]  # this replica's rows of the batch
    for _ in range(steps):  # a second step: the reducer's hooks count afresh, FSDP2 gathers again
        pm.zero_grad(set_to_none=True)
        with dp.step():
            pm(rows).pow(2).mean().backward()
    # ZeRO 0: the tensor axis's shards; ZeRO 3: FSDP2's pieces of them over the data axis
    grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
    return dp.gradient_reducer is not None, dp.fsdp_units, grads


@pytest.mark.parametrize("zero", [0, 3])
def test_a_parallel_module_as_one_replica_equals_one_process(zero):
    """Each replica runs its half of the batch on its tensor-parallel module; ZeRO 0 averages the
    gradients in buckets, ZeRO 3 shards the module under FSDP2: either way every rank's gradients
    are one process's over the whole batch."""
    model, graph, plan = sharded_mlp(TP)
    x = torch.randn(8 * DP, 64, generator=torch.Generator().manual_seed(0))  # 8 rows a replica, as traced
    model(x).pow(2).mean().backward()
    for reduced, units, grads in run_threads(_replica, DP * TP, graph, plan, model, x, zero, 2):
        assert (reduced, units) == ((True, 0) if zero == 0 else (False, 1))
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_a_mesh_that_is_not_the_data_axis_is_refused():
    """The data axis's runtime takes the data axis's one-axis sub-mesh; the whole mesh is refused
    before any module is touched."""
    from types import SimpleNamespace

    from autotp.runtime.data_parallel import DataParallel

    module = torch.nn.Linear(2, 2)
    whole = SimpleNamespace(mesh=torch.empty(DP, TP))
    with pytest.raises(ValueError, match=r"the data axis 'dp' has 2 replicas; the mesh given for it has shape \(2, 2\), "
                                         r"expected the one-axis sub-mesh \(2,\), e.g. mesh\['dp'\]"):
        DataParallel([module], Layout(dp=DP, tp=TP).data, whole)
    with pytest.raises(TypeError, match="data is Layout; expected the layout's DataAxis"):
        DataParallel([module], Layout(dp=DP, tp=TP), whole)
    assert not module._forward_pre_hooks and type(module) is torch.nn.Linear
