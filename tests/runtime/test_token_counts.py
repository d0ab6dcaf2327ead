"""A loss that averages over valid targets, weighed across micro-batches as one process weighs it
(autotp/runtime/pipeline/token_counts.py): found in the traced graph, counted from the inputs alone, and the
weighed micro-batch losses sum to the batch's loss. The pipeline step that uses it runs in
tests/runtime/test_pipeline_runtime.py (a right-padded batch with ignored labels)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.runtime.pipeline.module import PipelineModule
from autotp.runtime.pipeline.token_counts import scale_factors, token_mean


class _Classifier(nn.Module):
    """Per-token logits and, given targets, a loss: the cross-entropy alone, or plus an auxiliary term,
    or with class weights."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(8, 5)

    def forward(self, x, targets):
        logits = self.proj(x)
        flat = logits.reshape(-1, 5)
        t = F.pad(targets, (0, 1), value=-100)[:, 1:].reshape(-1)  # a causal LM's shift
        if self.kind == "weighted":
            return F.cross_entropy(flat, t, weight=torch.arange(1.0, 6.0))
        loss = F.cross_entropy(flat, t)
        return loss + 0.1 * logits.pow(2).mean() if self.kind == "aux" else loss


def _inputs():
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 5, (4, 6), generator=torch.Generator().manual_seed(1))
    for row, length in enumerate((2, 6, 4, 1)):
        targets[row, length:] = -100
    return x, targets


def test_the_counts_come_from_the_graph_and_weigh_micro_batches_as_one_process():
    model = _Classifier("plain")
    x, targets = _inputs()
    graph = autotp.capture(model, (x, targets))
    found = token_mean(graph.exported, 0)
    assert found is not None and found.exact and found.ignore_index == -100
    counts = found.counts({"x": x, "targets": targets}, 2)
    # by hand: each row's next-token targets that are not ignored, two rows a micro-batch
    shifted = (targets[:, 1:] != -100).sum(1)
    assert counts.tolist() == [int(shifted[:2].sum()), int(shifted[2:].sum())] == [6, 3]
    means = torch.stack([model(x[:2], targets[:2]), model(x[2:], targets[2:])])
    weighed = (means * scale_factors(counts, counts.sum(), micro_batches=2, replicas=1)).sum() / 2
    torch.testing.assert_close(weighed, model(x, targets))
    assert not torch.allclose(means.mean(), model(x, targets))  # the mean of means is not the batch's


def test_a_loss_beside_other_terms_is_found_inexact_and_weighted_classes_are_left_alone():
    x, targets = _inputs()
    aux = token_mean(autotp.capture(_Classifier("aux"), (x, targets)).exported, 0)
    assert aux is not None and not aux.exact
    assert token_mean(autotp.capture(_Classifier("weighted"), (x, targets)).exported, 0) is None


def test_a_pipeline_refuses_a_loss_it_cannot_weigh_when_the_counts_differ():
    """Every rank counts the whole batch it is given, so every rank refuses alike, before any send."""
    x, targets = _inputs()
    aux = token_mean(autotp.capture(_Classifier("aux"), (x, targets)).exported, 0)
    chosen = SimpleNamespace(dp=1, micro_batches=2)
    fake = SimpleNamespace(_token_mean=aux, plan=SimpleNamespace(pipeline=SimpleNamespace(chosen=chosen)),
                           _inputs=lambda args, kwargs, replica=True: dict(kwargs))
    with pytest.raises(ValueError, match=r"unequal numbers of valid targets \(\[6, 3\]\).*loss_fn"):
        PipelineModule._loss_factors(fake, (), {"x": x, "targets": targets})
    even = targets.clamp(min=0)
    even[:, 3:] = -100  # every micro-batch 4 valid targets: the mean of means is exact, so it runs
    assert PipelineModule._loss_factors(fake, (), {"x": x, "targets": even}) is None
