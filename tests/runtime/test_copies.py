"""The runtime's local copies are the ones the cost model prices (``redistribute.step_copies``).

Each redistribution step of the runtime (``autotp.local.collectives.RedistributeStep``) runs forward and
backward on a fake process group of 2 ranks, under a dispatch mode that records every kernel that
writes a new tensor from another one (clone, cat, stack, copy). Their bytes (read plus written)
must equal the list ``step_copies`` gives, forward and backward, for a tensor whose sharded dim is
leading and for one whose dim is not.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from autotp.local.collectives import RedistributeStep
from autotp.placement import P, R, S
from autotp.planning.costs.redistribute import conversion_steps, step_copies

_COPY_OPS = ("aten.clone.", "aten.cat.", "aten.stack.", "aten.copy.", "aten.copy_.", "aten._to_copy.")
# collectives that copy their input into a fresh output inside the op, where a dispatch mode does not
# see it; test_the_functional_all_reduce_clones_its_input checks it with the profiler, which does
_CLONING_OPS = ("_c10d_functional.all_reduce.",)


class _Copies(TorchDispatchMode):
    """Bytes read plus written by each copy kernel run inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func).startswith(_COPY_OPS):
            written = out if isinstance(out, torch.Tensor) else args[0]
            self.bytes.append(2.0 * written.numel() * written.element_size())
        elif str(func).startswith(_CLONING_OPS):  # its clone runs inside, below this mode
            self.bytes.append(2.0 * args[0].numel() * args[0].element_size())
        return out


@pytest.fixture()
def two_fake_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _src_shape(shape, placement, n):
    """The local shape a tensor of ``shape`` has on one rank under ``placement``."""
    if not placement.is_shard:
        return shape
    return tuple(s // n if d == placement.dim else s for d, s in enumerate(shape))


_PAIRS = [(R, S(0)), (R, S(1)), (R, P), (S(0), R), (S(1), R), (S(1), S(2)), (S(0), S(2)), (P, R), (P, S(0)),
          (P, S(1))]


# (1, 8, 16): dim 1 is leading, so only all_to_all and R -> P copy; dim 0 (size 1) cannot be split
_CASES = [pytest.param(shape, a, b, id=f"{a}-{b}-{shape[0]}x8x16") for shape in ((4, 8, 16), (1, 8, 16))
          for a, b in _PAIRS if shape[0] > 1 or S(0) not in (a, b)]


@pytest.mark.parametrize("shape, src, dst", _CASES)
@pytest.mark.parametrize("reduce_grad", [False, True], ids=["slice-grad", "reduce-grad"])
def test_runtime_copies_equal_the_priced_ones(two_fake_ranks, shape, src, dst, reduce_grad):
    n = 2
    grad_axes = (0,) if reduce_grad else ()
    step, = conversion_steps((src,), (dst,), (n,), grad_axes)
    module = RedistributeStep(src, dst, "tp", two_fake_ranks, n, rank=0,
                              reduce_grad=step.backward == "reduce_scatter")
    leaf = torch.randn(_src_shape(shape, src, n), requires_grad=True)
    x = leaf * 2.0  # not a leaf: the gradient leaves the step into a kernel, as in a model
    forward, backward = _Copies(), _Copies()
    with forward:
        y = module(x)
    g = torch.ones_like(y)
    with backward:
        y.backward(g)
    nbytes = torch.Size(shape).numel() * 4.0
    want_forward, want_backward = step_copies(step, shape, n, nbytes)
    assert sorted(forward.bytes) == sorted(want_forward), f"{step}: forward copies"
    assert sorted(backward.bytes) == sorted(want_backward), f"{step}: backward copies"
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape


def test_a_dim_the_other_axes_cut_to_size_one_is_leading(two_fake_ranks):
    """On a (2, 2) mesh, a (2, 8, 16) tensor split on dim 0 over the first axis is (1, ., 16) on
    each rank: gathering its dim 1 over the second axis needs no copy, as the runtime shows on that
    local tensor; a (4, 8, 16) one, (2, ., 16) on each rank, needs both."""
    for shape, copies in (((2, 8, 16), 0), ((4, 8, 16), 2)):
        step, = conversion_steps((S(0), S(1)), (S(0), R), (2, 2))
        assert step.cuts == ((0, 2),)
        nbytes = torch.Size(shape).numel() * 4.0
        forward, _ = step_copies(step, shape, 2, nbytes)
        assert len(forward) == copies
        seen = _Copies()
        with seen:
            RedistributeStep(S(1), R, "tp", two_fake_ranks, 2, rank=0)(torch.randn(shape[0] // 2, 4, 16))
        assert sorted(seen.bytes) == sorted(forward)


def test_the_functional_all_reduce_clones_its_input(two_fake_ranks):
    """The runtime's all_reduce (P -> R, and the gradient reduction's backward) writes a clone of its
    input: one copy kernel of the input's bytes, which the profiler sees inside the collective."""
    from torch.profiler import ProfilerActivity, profile

    from autotp.planning.costs.redistribute import all_reduce_copies
    from autotp.local.collectives import GradAllReduce

    x = torch.randn(4, 8, 16)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        RedistributeStep(P, R, "tp", two_fake_ranks, 2, rank=0)(x)
    copies = [e for e in prof.events() if e.name == "aten::copy_"]
    assert [e.input_shapes[0] for e in copies] == [[4, 8, 16]]
    assert all_reduce_copies(x.numel() * 4.0) == (2.0 * x.numel() * 4,)

    leaf = torch.randn(4, 8, 16, requires_grad=True)
    y = GradAllReduce("tp", two_fake_ranks)(leaf * 2.0)
    seen = _Copies()
    with seen:
        y.backward(torch.ones_like(y))
    assert sorted(seen.bytes) == sorted(all_reduce_copies(x.numel() * 4.0))


def test_a_gradient_reduction_prices_its_clone():
    from autotp.mesh import MeshSpec
    from autotp.planning.costs.costing import CostModel
    from autotp.tracing.graph import TensorInfo
    from cost_models import load_profile

    cost = CostModel(MeshSpec.of((2,)), load_profile("cpu-gloo"), "train")
    info = TensorInfo((4, 256, 768), "float32")
    assert cost.grad_reduce_s(info, (R,), 0) == pytest.approx(
        cost.collective_s("all_reduce", 0, info.nbytes) + cost.copy_s(2 * info.nbytes, "float32"))


def test_a_gather_on_a_later_dim_costs_more_than_on_the_first():
    """The cost model sees the copies: the same all_gather costs more on a non-leading dim, by
    exactly the two copy kernels, and nothing more on the first dim."""
    from autotp.mesh import MeshSpec
    from autotp.planning.costs.costing import CostModel
    from autotp.tracing.graph import TensorInfo
    from cost_models import load_profile

    cost = CostModel(MeshSpec.of((2,)), load_profile("cpu-gloo"), "inference")
    info = TensorInfo((4, 256, 768), "float32")
    first = cost.edge_s(info, (S(0),), (R,), False)
    last = cost.edge_s(info, (S(2),), (R,), False)
    assert first == pytest.approx(cost.collective_s("all_gather", 0, info.nbytes))
    assert last == pytest.approx(first + cost.copy_s(info.nbytes, "float32") + cost.copy_s(2 * info.nbytes, "float32"))
