"""Reference models for tests, examples, the CLI and benchmarks.

Plain PyTorch, nanoGPT style. Every model exports with
``torch.export.export(model, example_inputs, strict=False)``, on "cpu" or on "meta".

Each factory returns ``(model, example_inputs)``::

    model, inputs = tiny_llama()                  # real weights on CPU, seeded
    model, inputs = llama3_8b()                   # meta device: no memory, instant
    ep = torch.export.export(model, inputs, strict=False)

Module names follow Hugging Face where one exists (``layers.0.self_attn.q_proj``,
``layers.0.mlp.down_proj``, ``lm_head``), so plans read the same on both.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "MLP", "GPTConfig", "GPT", "LlamaConfig", "Llama", "BertConfig", "BertEncoder",
    "mlp", "tiny_gpt", "tiny_llama", "tiny_bert", "gpt2_small", "llama3_8b", "llama3_70b",
    "hf_llama", "hf_gpt2", "hf_bert",
]


# ---------------------------------------------------------------------------- MLP

class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x):  # (B, dim)
        return self.down_proj(F.gelu(self.up_proj(x)))  # (B, hidden) -> (B, dim)


class MLP(nn.Module):
    """``depth`` blocks of Linear(dim, hidden) -> GELU -> Linear(hidden, dim)."""

    def __init__(self, dim: int, hidden: int, depth: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(dim, hidden) for _ in range(depth))

    def forward(self, x):  # (B, dim)
        for layer in self.layers:
            x = layer(x)
        return x  # (B, dim)


# ---------------------------------------------------------------------------- GPT

@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    dim: int = 768
    ffn_dim: int | None = None  # None: 4 * dim
    max_seq_len: int = 1024
    bias: bool = True

    def __post_init__(self):
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", 4 * self.dim)
        if self.dim % self.n_head:
            raise ValueError(f"dim={self.dim} is not divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_head: int, bias: bool):
        super().__init__()
        self.n_head = n_head
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.o_proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x):  # (B, T, dim)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, -1).transpose(1, 2)  # (B, n_head, T, head_dim)
        k = self.k_proj(x).view(B, T, self.n_head, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n_head, T, head_dim)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, dim)
        return self.o_proj(y)


class GeluMLP(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, bias: bool = True):
        super().__init__()
        self.up_proj = nn.Linear(dim, ffn_dim, bias=bias)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=bias)

    def forward(self, x):  # (B, T, dim)
        return self.down_proj(F.gelu(self.up_proj(x)))  # (B, T, ffn_dim) -> (B, T, dim)


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        self.self_attn = CausalSelfAttention(cfg.dim, cfg.n_head, cfg.bias)
        self.post_attention_layernorm = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        self.mlp = GeluMLP(cfg.dim, cfg.ffn_dim, cfg.bias)

    def forward(self, x):  # (B, T, dim)
        x = x + self.self_attn(self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class GPT(nn.Module):
    """GPT-2: learned positions, pre-LayerNorm, causal MHA, GELU MLP, tied lm_head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.embed_positions = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied: one Parameter
        _init_normal(self, std=0.02, residual_std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, input_ids):  # (B, T) int64
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.embed_tokens(input_ids) + self.embed_positions(pos)  # (B, T, dim)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))  # (B, T, vocab_size)


# -------------------------------------------------------------------------- Llama

@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int = 8
    dim: int = 4096
    ffn_dim: int = 14336
    max_seq_len: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.dim % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(
                f"need dim % n_head == 0 and n_head % n_kv_head == 0, got "
                f"dim={self.dim}, n_head={self.n_head}, n_kv_head={self.n_kv_head}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., dim)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_cos_sin(T: int, head_dim: int, theta: float, device, dtype):
    """cos, sin of shape (T, head_dim), halves repeated (rotate_half layout)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # (head_dim/2,)
    pos = torch.arange(T, device=device, dtype=torch.float32)  # (T,)
    freqs = pos[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):  # (..., head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):  # x (B, h, T, head_dim); cos, sin (T, head_dim)
    return x * cos + rotate_half(x) * sin


class GQAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.dim // cfg.n_head
        self.q_proj = nn.Linear(cfg.dim, cfg.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):  # x (B, T, dim)
        B, T, _ = x.shape
        hd, rep = self.head_dim, self.n_head // self.n_kv_head
        q = self.q_proj(x).view(B, T, self.n_head, hd).transpose(1, 2)  # (B, n_head, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)  # (B, n_kv_head, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # repeat kv heads: (B, n_kv_head, T, hd) -> (B, n_kv_head, rep, T, hd) -> (B, n_head, T, hd)
        k = k[:, :, None].expand(B, self.n_kv_head, rep, T, hd).reshape(B, self.n_head, T, hd)
        v = v[:, :, None].expand(B, self.n_kv_head, rep, T, hd).reshape(B, self.n_head, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n_head, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * hd)  # (B, T, dim)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x):  # (B, T, dim)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, ffn_dim) -> (B, T, dim)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = GQAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x, cos, sin):  # (B, T, dim)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Llama(nn.Module):
    """LLaMA 3: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied lm_head."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        _init_normal(self, std=0.02, residual_std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, input_ids):  # (B, T) int64
        T = input_ids.shape[1]
        x = self.embed_tokens(input_ids)  # (B, T, dim)
        cos, sin = rope_cos_sin(T, self.cfg.dim // self.cfg.n_head, self.cfg.rope_theta,
                                x.device, x.dtype)  # (T, head_dim) each
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))  # (B, T, vocab_size)


# ------------------------------------------------------------- LLaMA with its own KV cache


class CachedAttention(GQAttention):
    """Grouped-query attention that keeps its keys and values in buffers of its own (non-persistent,
    ``(batch, kv heads, max_len, head_dim)``), written in place at the positions given: the KV cache
    of a decoding loop, in plain PyTorch (nanoGPT style)."""

    def __init__(self, cfg: LlamaConfig, batch: int, max_len: int):
        super().__init__(cfg)
        shape = (batch, cfg.n_kv_head, max_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x, cos, sin, pos):  # x (B, T, dim); pos (T,) the positions of x's tokens
        B, T, _ = x.shape
        hd, rep, L = self.head_dim, self.n_head // self.n_kv_head, self.k_cache.shape[2]
        q = self.q_proj(x).view(B, T, self.n_head, hd).transpose(1, 2)  # (B, n_head, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)  # (B, n_kv_head, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.k_cache.index_copy_(2, pos, k)  # (B, n_kv_head, L, hd), written at the positions
        self.v_cache.index_copy_(2, pos, v)
        keys = self.k_cache[:, :, None].expand(B, self.n_kv_head, rep, L, hd).reshape(B, self.n_head, L, hd)
        values = self.v_cache[:, :, None].expand(B, self.n_kv_head, rep, L, hd).reshape(B, self.n_head, L, hd)
        seen = torch.arange(L, device=x.device)[None, :] <= pos[:, None]  # (T, L): a token sees its past
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen)  # (B, n_head, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * hd))


class CachedLlamaBlock(LlamaBlock):
    def __init__(self, cfg: LlamaConfig, batch: int, max_len: int):
        super().__init__(cfg)
        self.self_attn = CachedAttention(cfg, batch, max_len)

    def forward(self, x, cos, sin, pos):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class CachedLlama(Llama):
    """LLaMA with a KV cache of ``max_len`` positions for ``batch`` sequences: ``forward(ids, pos)``
    runs the tokens ``ids`` (B, T) at positions ``pos`` (T,), writing their keys and values into the
    cache and attending to every position up to theirs. A prompt runs at ``arange(T)``, then each new
    token at its own position (:func:`greedy_with_cache`)."""

    def __init__(self, cfg: LlamaConfig, batch: int, max_len: int):
        super().__init__(cfg)
        self.layers = nn.ModuleList(CachedLlamaBlock(cfg, batch, max_len) for _ in range(cfg.n_layer))
        cos, sin = rope_cos_sin(max_len, cfg.dim // cfg.n_head, cfg.rope_theta, None, torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_len, head_dim)
        self.register_buffer("rope_sin", sin, persistent=False)
        _init_normal(self, std=0.02, residual_std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, input_ids, pos):  # (B, T) int64, (T,) int64
        x = self.embed_tokens(input_ids)  # (B, T, dim)
        cos, sin = self.rope_cos[pos].to(x.dtype), self.rope_sin[pos].to(x.dtype)  # (T, head_dim)
        for layer in self.layers:
            x = layer(x, cos, sin, pos)
        return self.lm_head(self.norm(x))  # (B, T, vocab_size)


@torch.no_grad()
def greedy_with_cache(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> list[list[int]]:
    """Greedy decoding with the model's own cache: the prompt once, then one token a call."""
    T = prompt.shape[1]
    logits = model(prompt, torch.arange(T))
    token = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
    out = [token]
    for i in range(new_tokens - 1):
        logits = model(token, torch.tensor([T + i]))
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
    return torch.cat(out, dim=1).tolist()


# --------------------------------------------------------------------------- BERT

@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30528
    n_layer: int = 12
    n_head: int = 12
    dim: int = 768
    ffn_dim: int = 3072
    max_seq_len: int = 512
    norm_eps: float = 1e-12


class BidirectionalSelfAttention(CausalSelfAttention):
    def forward(self, x):  # (B, T, dim)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, -1).transpose(1, 2)  # (B, n_head, T, head_dim)
        k = self.k_proj(x).view(B, T, self.n_head, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, n_head, T, head_dim), no mask
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, dim)
        return self.o_proj(y)


class BertBlock(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self_attn = BidirectionalSelfAttention(cfg.dim, cfg.n_head, bias=True)
        self.attn_layernorm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = GeluMLP(cfg.dim, cfg.ffn_dim)
        self.mlp_layernorm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, x):  # (B, T, dim), post-LayerNorm
        x = self.attn_layernorm(x + self.self_attn(x))
        x = self.mlp_layernorm(x + self.mlp(x))
        return x


class BertEncoder(nn.Module):
    """BERT encoder: token + position embeddings, post-LayerNorm blocks; returns (B, T, dim)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.embed_positions = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.embed_layernorm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.layers = nn.ModuleList(BertBlock(cfg) for _ in range(cfg.n_layer))
        _init_normal(self, std=0.02)

    def forward(self, input_ids):  # (B, T) int64
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.embed_layernorm(self.embed_tokens(input_ids) + self.embed_positions(pos))  # (B, T, dim)
        for layer in self.layers:
            x = layer(x)
        return x  # (B, T, dim)


def _init_normal(model: nn.Module, std: float, residual_std: float | None = None):
    """nanoGPT init: N(0, std) weights, zero biases; o_proj/down_proj at residual_std."""
    for name, p in model.named_parameters():  # a tied weight is visited once
        if p.dim() < 2:
            continue  # norms keep ones/zeros, biases below
        s = residual_std if residual_std and name.endswith(("o_proj.weight", "down_proj.weight")) else std
        nn.init.normal_(p, mean=0.0, std=s)
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and mod.bias is not None:
            nn.init.zeros_(mod.bias)


# ---------------------------------------------------------------------- factories

_BUILD_LOCK = threading.RLock()


def _serialized(factory):
    """One factory call at a time in this process: a build seeds the global generator and draws
    from it (and the Hugging Face imports are lazy), so two threads (``run_threads``' ranks) building
    at once would each get the other's random numbers."""

    @functools.wraps(factory)
    def build(*args, **kwargs):
        with _BUILD_LOCK:
            return factory(*args, **kwargs)

    return build


@contextlib.contextmanager
def _building(device, seed: int):
    """Build under `device`; seeded on real devices so two calls give identical weights."""
    device = torch.device(device)
    if device.type != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        yield


def _token_ids(vocab: int, batch: int, seq: int, device) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), device=device, dtype=torch.int64)  # (B, T)


@_serialized
def mlp(batch: int = 8, dim: int = 64, hidden: int = 256, depth: int = 2, *,
        device="cpu", dtype=torch.float32, seed: int = 0):
    with _building(device, seed):
        model = MLP(dim, hidden, depth).to(dtype)
        x = torch.randn(batch, dim, dtype=dtype)  # (B, dim)
    return model, (x,)


def _gpt(cfg: GPTConfig, batch, seq, device, dtype, seed):
    if seq > cfg.max_seq_len:
        raise ValueError(f"seq={seq} > max_seq_len={cfg.max_seq_len}")
    with _building(device, seed):
        model = GPT(cfg).to(dtype)
        ids = _token_ids(cfg.vocab_size, batch, seq, device)
    return model, (ids,)


def _llama(cfg: LlamaConfig, batch, seq, device, dtype, seed):
    with _building(device, seed):
        model = Llama(cfg).to(dtype)
        ids = _token_ids(cfg.vocab_size, batch, seq, device)
    return model, (ids,)


@_serialized
def tiny_gpt(batch: int = 2, seq: int = 16, n_layer: int = 2, dim: int = 64, n_head: int = 4,
             vocab: int = 128, *, device="cpu", dtype=torch.float32, seed: int = 0):
    cfg = GPTConfig(vocab_size=vocab, n_layer=n_layer, n_head=n_head, dim=dim, max_seq_len=max(seq, 16))
    return _gpt(cfg, batch, seq, device, dtype, seed)


@_serialized
def gpt2_small(batch: int = 1, seq: int = 1024, n_layer: int = 12, *,
               device="meta", dtype=torch.float32, seed: int = 0):
    """GPT-2 124M, vocab 50257 padded to 50304 (a multiple of 64, as nanoGPT does)."""
    cfg = GPTConfig(vocab_size=50304, n_layer=n_layer, n_head=12, dim=768, max_seq_len=1024)
    return _gpt(cfg, batch, seq, device, dtype, seed)


@_serialized
def tiny_llama(batch: int = 2, seq: int = 16, n_layer: int = 2, dim: int = 64, n_head: int = 4,
               n_kv_head: int = 2, ffn_dim: int = 128, vocab: int = 128, *,
               device="cpu", dtype=torch.float32, seed: int = 0):
    cfg = LlamaConfig(vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                      dim=dim, ffn_dim=ffn_dim, max_seq_len=max(seq, 16))
    return _llama(cfg, batch, seq, device, dtype, seed)


@_serialized
def cached_llama(batch: int = 2, prompt: int = 8, max_len: int = 32, n_layer: int = 2, dim: int = 64,
                 n_head: int = 4, n_kv_head: int = 2, ffn_dim: int = 128, vocab: int = 128, *,
                 device="cpu", dtype=torch.float32, seed: int = 0):
    """A small :class:`CachedLlama` and the inputs of its prompt: ``(ids (batch, prompt), arange(prompt))``."""
    cfg = LlamaConfig(vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                      dim=dim, ffn_dim=ffn_dim, max_seq_len=max_len)
    with _building(device, seed):
        model = CachedLlama(cfg, batch, max_len).to(dtype)
        ids = _token_ids(vocab, batch, prompt, device)
    return model, (ids, torch.arange(prompt, device=device))


@_serialized
def llama3_8b(batch: int = 1, seq: int = 2048, n_layer: int = 32, *,
              device="meta", dtype=torch.float32, seed: int = 0):
    cfg = LlamaConfig(vocab_size=128256, n_layer=n_layer, n_head=32, n_kv_head=8,
                      dim=4096, ffn_dim=14336, max_seq_len=8192)
    return _llama(cfg, batch, seq, device, dtype, seed)


@_serialized
def llama3_70b(batch: int = 1, seq: int = 2048, n_layer: int = 80, *,
               device="meta", dtype=torch.float32, seed: int = 0):
    cfg = LlamaConfig(vocab_size=128256, n_layer=n_layer, n_head=64, n_kv_head=8,
                      dim=8192, ffn_dim=28672, max_seq_len=8192)
    return _llama(cfg, batch, seq, device, dtype, seed)


def llama3_70b_long(batch: int = 8, seq: int = 4096, **kwargs):
    """The Llama 3 70B shape at batch 8 x 4096 tokens, on meta: a run that activations decide (for
    ``autotp plan examples.models:llama3_70b_long --mesh 8x8 --memory-budget 60GB``)."""
    return llama3_70b(batch=batch, seq=seq, **kwargs)


@_serialized
def tiny_bert(batch: int = 2, seq: int = 16, n_layer: int = 2, dim: int = 64, n_head: int = 4,
              ffn_dim: int = 128, vocab: int = 128, *, device="cpu", dtype=torch.float32, seed: int = 0):
    cfg = BertConfig(vocab_size=vocab, n_layer=n_layer, n_head=n_head, dim=dim, ffn_dim=ffn_dim,
                     max_seq_len=max(seq, 16))
    with _building(device, seed):
        model = BertEncoder(cfg).to(dtype)
        ids = _token_ids(cfg.vocab_size, batch, seq, device)
    return model, (ids,)


# ----------------------------------------------------------- Hugging Face (configs only)

def _hf_build(model_cls, config, vocab, batch, seq, device, dtype, seed, **kwargs):
    with _building(device, seed):
        model = model_cls(config, **kwargs).to(dtype)
        ids = _token_ids(vocab, batch, seq, device)
    model.eval()  # dropout off: forward is a pure function of the inputs
    return model, (ids,)


@_serialized
def hf_llama(batch: int = 2, seq: int = 16, n_layer: int = 2, hidden: int = 64, ffn: int = 128,
             heads: int = 4, kv_heads: int = 2, vocab: int = 128, *,
             device="cpu", dtype=torch.float32, seed: int = 0):
    """transformers' LlamaForCausalLM from a config (no weights downloaded)."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    config = HFLlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=n_layer,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max(seq, 2048), rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    return _hf_build(LlamaForCausalLM, config, vocab, batch, seq, device, dtype, seed)


@_serialized
def hf_gpt2(batch: int = 2, seq: int = 16, n_layer: int = 2, hidden: int = 64, heads: int = 4,
            vocab: int = 128, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """transformers' GPT2LMHeadModel from a config. Note: GPT-2 uses Conv1D (weight (in, out))."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=max(seq, 1024), n_embd=hidden, n_layer=n_layer,
                        n_head=heads, bos_token_id=None, eos_token_id=None, use_cache=False,
                        attn_implementation="sdpa")
    return _hf_build(GPT2LMHeadModel, config, vocab, batch, seq, device, dtype, seed)


@_serialized
def hf_bert(batch: int = 2, seq: int = 16, n_layer: int = 2, hidden: int = 64, ffn: int = 128,
            heads: int = 4, vocab: int = 128, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """transformers' BertModel (no pooler) from a config."""
    from transformers import BertConfig as HFBertConfig, BertModel

    config = HFBertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n_layer,
                          num_attention_heads=heads, intermediate_size=ffn,
                          max_position_embeddings=max(seq, 512), attn_implementation="sdpa")
    return _hf_build(BertModel, config, vocab, batch, seq, device, dtype, seed,
                     add_pooling_layer=False)


def output_tensor(out: Any) -> torch.Tensor:
    """The tensor a model returns: itself, or a Hugging Face ModelOutput's logits / last_hidden_state."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot find the output tensor in a {type(out).__name__}")
