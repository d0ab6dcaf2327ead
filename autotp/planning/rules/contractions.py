"""Ops that contract a dim: linear, matmuls, the embedding lookup and attention.

These carry the Megatron options: a weight split by its output features (colwise) gives a split
output; split by its input features (rowwise) gives a partial sum; a row-split embedding table
gives a partial sum too (each rank looks up its rows, zeros elsewhere: :func:`local_embedding` runs
it as a masked lookup). Attention that drops its weights runs with its kernel's draws seeded per
piece (:func:`local_attention`).
"""

from __future__ import annotations

from typing import Any, Optional

from autotp.local.collectives import MaskedEmbedding
from autotp.local.dropout import SeededAttention, attention_dropout_p
from autotp.local.site import LocalSite
from autotp.placement import P, R, S
from autotp.planning.rules.common import AxisChoice, broadcast_in, divisible, is_relaxed
from autotp.tracing.graph import OpNode


def linear_choices(node: OpNode, n: int) -> list[AxisChoice]:
    x, w = node.input_infos[0], node.input_infos[1]
    has_bias = len(node.inputs) == 3
    out = node.output
    last = out.ndim - 1
    b = (lambda p: (p,)) if has_bias else (lambda p: ())
    choices: list[AxisChoice] = [((R, R, *b(R)), R)]
    if divisible(w.shape[0], n):
        choices.append(((R, S(0), *b(S(0))), S(last)))  # colwise
    if divisible(w.shape[1], n):
        choices.append(((S(x.ndim - 1), S(1), *b(P)), P))  # rowwise; the bias is added once
    for d in range(out.ndim - 1):
        if divisible(out.shape[d], n):
            choices.append(((S(d), R, *b(R)), S(d)))  # batch / sequence
    choices.append(((P, R, *b(P)), P))
    return choices


def matmul_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """mm / bmm / matmul: split rows, columns, the contraction (partial) or a batch dim."""
    a, b = node.input_infos[0], node.input_infos[1]
    out = node.output
    if a.ndim < 2 or b.ndim < 2:
        return [((R, R), R)]
    choices: list[AxisChoice] = [((R, R), R), ((P, R), P), ((R, P), P)]
    if divisible(a.shape[-2], n):
        choices.append(((S(a.ndim - 2), R), S(out.ndim - 2)))
    if divisible(b.shape[-1], n):
        choices.append(((R, S(b.ndim - 1)), S(out.ndim - 1)))
    if divisible(a.shape[-1], n):
        choices.append(((S(a.ndim - 1), S(b.ndim - 2)), P))
    for d in range(out.ndim - 2):
        if divisible(out.shape[d], n):
            choices.append(((broadcast_in(a, out, d), broadcast_in(b, out, d)), S(d)))
    return choices


def addmm_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """addmm(bias (N,), a (M, K), b (K, N)): a matmul plus a bias broadcast over rows (HF Conv1D)."""
    bias, a, b = node.input_infos[0], node.input_infos[1], node.input_infos[2]
    if a.ndim != 2 or b.ndim != 2:
        return [((R, R, R), R)]
    bias_cols = S(bias.ndim - 1) if bias.ndim >= 1 and bias.shape[-1] == b.shape[1] else R
    choices: list[AxisChoice] = [((R, R, R), R), ((P, P, R), P)]
    if divisible(a.shape[0], n):
        choices.append(((R, S(0), R), S(0)))  # rows
    if divisible(b.shape[1], n) and bias_cols != R:
        choices.append(((bias_cols, R, S(1)), S(1)))  # columns: colwise
    if divisible(a.shape[1], n):
        choices.append(((P, S(1), S(0)), P))  # contraction: rowwise, the bias added once
    return choices


def embedding_choices(node: OpNode, n: int) -> list[AxisChoice]:
    w, idx = node.input_infos[0], node.input_infos[1]
    out = node.output
    choices: list[AxisChoice] = [((R, R), R)]
    if divisible(w.shape[1], n):
        choices.append(((S(1), R), S(out.ndim - 1)))  # colwise: split the embedding dim
    if divisible(w.shape[0], n):
        choices.append(((S(0), R), P))  # rowwise: each rank looks up its rows, zeros elsewhere
    for d in range(idx.ndim):
        if divisible(idx.shape[d], n):
            choices.append(((R, S(d)), S(d)))
    return choices


def sdpa_choices(node: OpNode, n: int) -> list[AxisChoice]:
    q, k = node.input_infos[0], node.input_infos[1]
    k_in = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k_in, R)]
    for d in range(q.ndim - 2):  # batch, heads: attention is independent across both (not the rows)
        if not (divisible(q.shape[d], n) and divisible(k.shape[d], n)):
            continue
        extra = tuple(broadcast_in(m, node.output, d) if m.ndim == node.output.ndim else R
                      for m in node.input_infos[3:])
        choices.append(((S(d), S(d), S(d), *extra), S(d)))
    # the queries split along their sequence, keys and values whole: each query row attends on its
    # own (a high-resolution image's tokens, too many and too few heads to split otherwise). An
    # explicit mask splits with them; ``is_causal`` runs on a rank's rows with their offset
    # (rules/attention.py), not under dropout, whose draws are placed otherwise
    d = q.ndim - 2
    causal = node.args.get("is_causal", False)
    if d >= 0 and not (causal and (is_relaxed() or float(node.args.get("dropout_p") or 0.0) > 0)) \
            and divisible(q.shape[d], n):
        extra = tuple(broadcast_in(m, node.output, d) if m.ndim == node.output.ndim else R
                      for m in node.input_infos[3:])
        choices.append(((S(d), R, R, *extra), S(d)))
    return choices


RULES = {
    "aten.linear.default": linear_choices,
    "aten.mm.default": matmul_choices,
    "aten.addmm.default": addmm_choices,
    "aten.bmm.default": matmul_choices,
    "aten.matmul.default": matmul_choices,
    "aten.embedding.default": embedding_choices,
    "aten.scaled_dot_product_attention.default": sdpa_choices,
}


def local_embedding(site: LocalSite) -> Optional[Any]:
    """A table split by rows: this rank looks up the indices in its rows, zeros elsewhere (a partial
    sum). None for a table split otherwise (the op as it is)."""
    w = site.strategy.inputs[0]
    axes = [a for a, p in enumerate(w) if p.is_shard and p.dim == 0]
    if not axes:
        return None
    start, stop = site.piece_of(site.node.input_infos[0].shape[0], w, axes[:1])
    return site.call_module(MaskedEmbedding(start, stop - start), "masked_embedding", site.args, site.kwargs)


def local_attention(site: LocalSite) -> Optional[Any]:
    """Attention with ``dropout_p > 0``: its kernel draws the dropped weights from the global
    generator, forked and seeded from the node's own stream, alike where ranks hold the same rows.
    None without dropout (the op as it is)."""
    if attention_dropout_p(site.args, site.kwargs) <= 0:
        return None
    stream = site.new_stream()
    module = SeededAttention(site.target, site.seed, stream, site.shard_key(site.strategy.output or ()))
    return site.call_module(module, "attention", site.args, site.kwargs)


LOCAL = {"aten.embedding.default": local_embedding, "aten.scaled_dot_product_attention.default": local_attention}
