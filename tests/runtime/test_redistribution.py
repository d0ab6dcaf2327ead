"""Every redistribution on a (2, 2) mesh gives each rank the shard it must hold, forward and backward.

For every pair of placements ``src -> dst`` over R, P, S(0) and S(1) on both axes, four threaded
ranks run the runtime's steps (:func:`autotp.planning.costs.redistribute.conversion_steps`, executed by
:class:`autotp.local.collectives.RedistributeStep`) on their piece of a known tensor, and the result is
compared with the piece ``dst`` names, cut from the full tensor by ``autotp.runtime.shards.local_shard``
(axis 0 splits first, then axis 1 splits each piece: DTensor's layout). A partial source holds the
full value times a rank factor that sums to a known total; a partial result is judged by its sum
over the ranks of its partial axes. The gradient fed back is the ``dst`` piece of a known
gradient; each rank must get back the ``src`` piece of it.

On a (2, 2, 2) mesh (``make test-slow``) the steps of every pair are simulated rank by rank in one
process by the same rules, and each step is checked to leave a valid layout.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from examples.ranks import run_threads

MESH = (2, 2)
KINDS = ("R", "P", "S0", "S1")


def _placement(kind):
    from autotp.placement import Placement

    return Placement("S", int(kind[1])) if kind.startswith("S") else Placement(kind)


def _piece(full, placements, coordinate):
    """This rank's value under ``placements``: P axes hold ``(c + 1) * value`` (their sum over the
    axis is ``3 * value`` on a mesh axis of 2)."""
    from autotp.placement import Placement
    from autotp.runtime.shards import local_shard

    whole = [Placement("R") if p.is_partial else p for p in placements]
    out = local_shard(full, tuple(whole), coordinate, MESH)
    for p, c in zip(placements, coordinate):
        if p.is_partial:
            out = out * (c + 1)
    return out


def _every_pair(rank, world):
    """Each pair's result and input gradient on this rank (judged by the test, which sees all ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.planning.costs.redistribute import conversion_steps, is_convertible
    from autotp.local.collectives import RedistributeStep

    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    coordinate = mesh.get_coordinate()
    out = {}
    for src_kinds, dst_kinds in itertools.product(itertools.product(KINDS, repeat=2), repeat=2):
        src, dst = tuple(map(_placement, src_kinds)), tuple(map(_placement, dst_kinds))
        if src == dst or not is_convertible(src, dst):
            continue
        x = _piece(FULL, src, coordinate).clone().requires_grad_(True)
        y = x
        for step in conversion_steps(src, dst, MESH):
            a = step.axis
            y = RedistributeStep(step.src, step.dst, ("dp", "tp")[a], mesh.get_group(a), MESH[a], coordinate[a])(y)
        if not any(p.is_partial for p in dst):  # the gradient of a partial value has no piece to compare
            y.backward(_piece(GRAD, dst, coordinate))
        out[(src_kinds, dst_kinds)] = (y.detach(), None if x.grad is None else x.grad.detach())
    return coordinate, out


_GEN = torch.Generator().manual_seed(3)
FULL = torch.randint(-8, 8, (4, 8), generator=_GEN).float()
GRAD = torch.randint(-8, 8, (4, 8), generator=_GEN).float()


def test_every_redistribution_on_a_2d_mesh_gives_each_rank_its_shard():
    from autotp.placement import Placement

    results = run_threads(_every_pair, 4)
    by_coordinate = {tuple(coordinate): out for coordinate, out in results}
    pairs = results[0][1]
    assert len(pairs) > 150, len(pairs)  # 16 x 16 pairs less the identities and the S -> P ones
    wrong = []
    for (src_kinds, dst_kinds) in pairs:
        src, dst = tuple(map(_placement, src_kinds)), tuple(map(_placement, dst_kinds))
        total = 3.0 ** sum(p.is_partial for p in src)
        whole_dst = tuple(Placement("R") if p.is_partial else p for p in dst)
        name = f"{''.join(src_kinds)} -> {''.join(dst_kinds)}"
        for coordinate, out in by_coordinate.items():
            # sum the result over the ranks that differ from this one only on dst's partial axes
            partners = [c for c in by_coordinate
                        if all(c[a] == coordinate[a] or dst[a].is_partial for a in range(len(MESH)))]
            y = sum(by_coordinate[c][(src_kinds, dst_kinds)][0] for c in partners)
            want = _piece(FULL * total, whole_dst, list(coordinate))
            if y.shape != want.shape or not torch.equal(y, want):
                wrong.append(f"{name} forward at {coordinate}")
            grad = out[(src_kinds, dst_kinds)][1]
            if not any(p.is_partial for p in dst):
                want_grad = _piece(GRAD, tuple(Placement("R") if p.is_partial else p for p in src), list(coordinate))
                if grad is None or not torch.equal(grad, want_grad):
                    wrong.append(f"{name} backward at {coordinate}")
    assert not wrong, f"{len(wrong)} wrong: {wrong[:12]}"


def _simulate(src, dst, mesh, full):
    """Every rank's piece after running ``conversion_steps(src, dst)``, simulated in one process by
    the runtime's rules (slice, gather, all_to_all, sums), as ``{coordinate: tensor}``."""
    import math

    from autotp.placement import Placement
    from autotp.planning.costs.redistribute import conversion_steps
    from autotp.runtime.shards import local_shard

    coords = list(itertools.product(*(range(n) for n in mesh)))
    parts = math.prod(n for p, n in zip(src, mesh) if p.is_partial)
    whole = tuple(Placement("R") if p.is_partial else p for p in src)
    pieces = {c: local_shard(full, whole, list(c), mesh) / parts for c in coords}
    for step in conversion_steps(src, dst, mesh):
        a, n, s, d = step.axis, mesh[step.axis], step.src, step.dst
        after = {}
        for c in coords:
            group = [pieces[c[:a] + (i,) + c[a + 1:]] for i in range(n)]
            x, me = pieces[c], c[a]
            if s.is_replicate:
                after[c] = x.chunk(n, d.dim)[me] if d.is_shard else (x.clone() if me == 0 else torch.zeros_like(x))
            elif s.is_shard:
                after[c] = torch.cat([g.chunk(n, d.dim)[me] for g in group], s.dim) if d.is_shard else torch.cat(group, s.dim)
            else:
                total = sum(group)
                after[c] = total.chunk(n, d.dim)[me] if d.is_shard else total
        pieces = after
    return pieces


@pytest.mark.slow  # about 10 s of Python: the 2-D test above runs the same steps by default
def test_every_redistribution_on_a_3d_mesh_lands_on_the_pieces_dst_names():
    """(2, 2, 2), R/P/S(0)/S(1) on each axis: the steps, simulated rank by rank, end with each rank
    holding the piece ``dst`` names (partial results judged by their sums); no step gathers or
    splits a dim that a later axis splits."""
    from autotp.placement import Placement
    from autotp.planning.costs.redistribute import conversion_steps, is_convertible
    from autotp.runtime.shards import local_shard

    mesh = (2, 2, 2)
    full = torch.arange(8 * 8, dtype=torch.float64).reshape(8, 8)
    wrong, checked = [], 0
    for src_kinds, dst_kinds in itertools.product(itertools.product(KINDS, repeat=3), repeat=2):
        src, dst = tuple(map(_placement, src_kinds)), tuple(map(_placement, dst_kinds))
        if src == dst or not is_convertible(src, dst):
            continue
        current = list(src)
        for step in conversion_steps(src, dst, mesh):
            dims = {p.dim for p in (step.src, step.dst) if p.is_shard}
            if any(current[b].is_shard and current[b].dim in dims for b in range(step.axis + 1, 3)):
                wrong.append(f"{src_kinds}->{dst_kinds}: {step} while {current}")
            current[step.axis] = step.dst
        pieces = _simulate(src, dst, mesh, full)
        whole = tuple(Placement("R") if p.is_partial else p for p in dst)
        for c in pieces:
            partners = [k for k in pieces if all(k[a] == c[a] or dst[a].is_partial for a in range(3))]
            got = sum(pieces[k] for k in partners)
            if not torch.allclose(got, local_shard(full, whole, list(c), mesh)):
                wrong.append(f"{src_kinds}->{dst_kinds} at {c}")
                break
        checked += 1
    assert checked == 2680, checked  # 64 x 64 pairs, less the identities and those that turn S into P
    assert not wrong, f"{len(wrong)} wrong: {wrong[:8]}"
