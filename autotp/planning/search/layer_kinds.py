"""A stack of layers of a few kinds (DeepSeek-V3's three dense layers, then 58 Mixture-of-Experts
ones), priced for the pipeline search from one layer of each kind.

:func:`autotp.tracing.repeats.find_stacks` finds a stack only where every layer is alike; a stack
whose layers come in runs of alike layers (each layer alike the first of its run, as
:func:`autotp.tracing.repeats` compares them) is a :class:`KindStack`. The pipeline search needs
each layer's costs, not each layer's graph: :func:`representatives_only` cuts the stack, for the
capture only, to the first layer of each run (the model's own modules, put back afterwards), and
:func:`expand_units` writes each layer's unit as its run's first layer's, its weights under names
of their own (so a stage holds the weights of its own layers, and a data axis shards and gathers
each layer's).

A plan made so prices the layouts; it is no plan of the whole model's graph, so
``autotp.parallelize`` refuses it (``PipelineChoice.kinds`` says it was made so).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Iterator, Mapping, Optional, Sequence

from torch import nn

from autotp.tracing.repeats import layers_alike

__all__ = ["KindStack", "find_kind_stack", "representatives_only", "expand_units"]


@dataclass(frozen=True)
class KindStack:
    """A stack of layers in runs of alike layers: its module path, and each run's first layer and
    length, in order."""

    path: str
    runs: tuple[tuple[int, int], ...]  # (first layer, layers in the run)

    @property
    def count(self) -> int:
        return sum(n for _, n in self.runs)

    def layer(self, index: int) -> str:
        return f"{self.path}.{index}" if self.path else str(index)

    def layers(self) -> list[str]:
        """The paths of the first layer of each run, as :func:`representatives_only` numbers them."""
        return [self.layer(k) for k in range(len(self.runs))]

    @property
    def kind_of_layer(self) -> tuple[int, ...]:
        """Each layer's run, by index into :attr:`runs`."""
        return tuple(k for k, (_, n) in enumerate(self.runs) for _ in range(n))


def find_kind_stack(model: nn.Module, least: int = 4, most_kinds: int = 4) -> Optional[KindStack]:
    """The longest ``nn.ModuleList`` or ``nn.Sequential`` of at least ``least`` layers numbered
    ``0, 1, ...`` that falls into runs of alike layers, no more than ``most_kinds`` runs and fewer
    runs than half its layers; None where the model has none."""
    best: Optional[KindStack] = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < least:
            continue
        if list(module._modules) != [str(i) for i in range(len(module))]:
            continue
        layers = list(module._modules.values())
        runs: list[list[int]] = []
        for i, layer in enumerate(layers):
            if runs and layers_alike(layers[runs[-1][0]], runs[-1][0], layer, i):
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
        if len(runs) > most_kinds or 2 * len(runs) > len(layers):
            continue
        if best is None or len(layers) > best.count:
            best = KindStack(path, tuple((a, n) for a, n in runs))
    return best


@contextlib.contextmanager
def representatives_only(model: nn.Module, stack: KindStack) -> Iterator[list[str]]:
    """Within the block, ``stack``'s container holds the first layer of each run only (as layers
    ``0, 1, ...``); yields their paths. The container is put back as it was on leaving."""
    container = model.get_submodule(stack.path) if stack.path else model
    kept = dict(container._modules)
    container._modules.clear()
    for k, (first, _) in enumerate(stack.runs):
        container._modules[str(k)] = kept[str(first)]
    try:
        yield [stack.layer(k) for k in range(len(stack.runs))]
    finally:
        container._modules.clear()
        container._modules.update(kept)


def expand_units(units: Sequence, parameters: Mapping[str, tuple], stack: KindStack) -> tuple[tuple, dict]:
    """The units of the representatives' plan (before the stack, one per run, after it) written out
    for every layer of ``stack``, and the parameters' bytes with each layer's weights under names of
    its own (``name@layer``); the weights before and after the stack keep theirs."""
    outside = set(units[0].parameters) | set(units[-1].parameters)
    params = {n: v for n, v in parameters.items() if n in outside}
    out = [units[0]]
    for i, k in enumerate(stack.kind_of_layer):
        rep = units[1 + k]
        names = tuple(n if n in outside else f"{n}@{i}" for n in rep.parameters)
        for n, new in zip(rep.parameters, names):
            params[new] = parameters[n]
        out.append(replace(rep, parameters=names))
    out.append(units[-1])
    return tuple(out), params
