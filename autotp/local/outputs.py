"""An output returned as the plan holds it: a DTensor over the plan's mesh, not gathered whole.

A pipeline's step reads the loss alone of the model's outputs (:mod:`autotp.planning.search.step_reads`);
the plan leaves the others (the logits) as it places them. The last stage's graph returns each of
them through :class:`HeldOutput`, which wraps this rank's piece as a ``DTensor`` of the plan's
placements; a step drops it, and a call that returns the output (``PipelineModule.forward``, a
step with a ``loss_fn`` of its own) gathers it with ``full_tensor()``. Only placements DTensor
says alike are held so (:func:`held_placements`: whole, an even split of a dim, a sum); any other
output is gathered in the graph, as a module's output always is.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autotp.placement import Placement

__all__ = ["HeldOutput", "held_placements"]


def held_placements(placements: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]) -> Optional[list]:
    """DTensor's placements for autotp's ``placements`` of a tensor of ``shape``, where they mean the
    same: R, an even split ``S(d)`` (neither blocked nor uneven, its dim cut once), P (a sum); None
    for any other."""
    out, cuts = [], [1] * len(shape)
    for p, n in zip(placements, mesh_shape):
        if p.routed:
            return None
        if p.kind == "R":
            out.append(Replicate())
        elif p.kind == "P":
            out.append(Partial("sum"))
        elif p.is_blocked or p.is_uneven or p.dim >= len(shape):
            return None
        else:
            cuts[p.dim] *= n
            out.append(Shard(p.dim))
    if any(size % c for size, c in zip(shape, cuts)):
        return None
    return out


class HeldOutput(nn.Module):
    """This rank's piece of an output, returned as a DTensor of the plan's placements (module docstring)."""

    def __init__(self, mesh: DeviceMesh, placements: Sequence, shape: Sequence[int]) -> None:
        super().__init__()
        self.mesh, self.placements, self.shape = mesh, tuple(placements), torch.Size(shape)

    def extra_repr(self) -> str:
        return f"{list(self.shape)} as {list(self.placements)}"

    def forward(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=torch.empty(self.shape, device="meta").stride())
