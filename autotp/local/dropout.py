"""Dropout on shards: one mask where ranks hold the same values, independent masks where they hold
different pieces (as Megatron's model-parallel RNG tracker does).

Left alone, every rank would draw its dropout mask from its own global generator: ranks seeded
alike would give head 0 on rank 0 and head H/2 on rank 1 the same mask (correlated, not the
model's dropout), and ranks seeded differently would give a replicated activation different masks
(the replicas drift apart). The rewrite therefore runs each active dropout of a train-mode graph
as a :class:`ShardedDropout` that draws its mask from a generator of its own, seeded per call from

- the module's base seed, the same on every rank (``autotp.parallelize`` takes it from the first
  rank's ``torch.initial_seed()``);
- the call count and the dropout's place in the graph, so calls and dropouts differ;
- the rank's coordinates on the mesh axes that split the tensor, so different pieces get
  independent masks and ranks that hold the same piece (replicated, or partial sums) the same.

Every other random op of the graph (``rand``, ``randn``, ``randint``, ``randperm``, their ``_like``
forms, ``bernoulli``, ``normal``, ``uniform``, ``multinomial``, ``exponential``, ``poisson``: a model
that drops class labels for classifier-free guidance, stochastic depth drawn as a tensor) runs as a
:class:`SharedRandom` seeded the same way, from the op's own stream: a value held whole is drawn the
same on every rank (left to the global generators, ranks seeded differently would hold different
"replicated" values, and nothing would say so), and a piece is drawn independently of the others.
Attention that drops its weights (``scaled_dot_product_attention`` with ``dropout_p > 0``, whose
kernels draw from the global generator and take none) runs as a :class:`SeededAttention`: the global
generator forked, seeded the same way for the call, and put back.

What this does not give: the mask a single-device run draws (its generator walks the whole tensor
in one order; each rank here draws only its piece), so a run with dropout on equals a single
device in distribution, not value by value. The call count lives in the module, not in its
``state_dict``: a resumed run starts the count again. A layer the plan recomputes
(:mod:`autotp.planning.costs.recompute`) sets the count back for its second run and draws the same masks; a
forward that the user's own code runs twice for one step draws new ones. Under ``torch.compile`` the module runs eagerly (a graph
break at each active dropout). With dropout off (``eval()``, ``p=0``) the module is the plain op
and runs are exact.

>>> import torch
>>> d = ShardedDropout(0.5, base_seed=0, stream=3, shard_key=(1,))
>>> out, mask = d(torch.ones(1000))
>>> 0.4 < mask.float().mean().item() < 0.6, set(out.unique().tolist()) == {0.0, 2.0}
(True, True)
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
from torch import nn

__all__ = ["ShardedDropout", "SharedRandom", "SeededAttention", "RANDOM_OPS", "attention_dropout_p"]

_MASK = (1 << 63) - 1
_GLOBAL_RNG = threading.Lock()  # ranks run as threads of one process (tests) share the global generator


class _Seeded(nn.Module):
    """A module that draws from a stream of its own: a seed per call from the base seed, the call
    count, the stream and the shard key."""

    def __init__(self, base_seed: int, stream: int, shard_key: tuple[int, ...]) -> None:
        super().__init__()
        self.base_seed, self.stream, self.shard_key = int(base_seed), int(stream), tuple(shard_key)
        self.calls = 0

    def seed(self) -> int:
        """This call's seed: equal on ranks with equal shard keys, independent otherwise."""
        return hash((self.base_seed, self.calls, self.stream, self.shard_key)) & _MASK


class ShardedDropout(_Seeded):
    """``aten.native_dropout`` on this rank's piece: returns ``(output, keep mask)``."""

    def __init__(self, p: float, base_seed: int, stream: int, shard_key: tuple[int, ...]) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability {p}: expected a number in [0, 1]")
        super().__init__(base_seed, stream, shard_key)
        self.p = float(p)

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream}, shard_key={self.shard_key}"

    # @torch.compiler.disable  # runs eagerly under torch.compile: a graph break, no guard on ``calls``
    def forward(self, x: torch.Tensor, *rest) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator(device=x.device).manual_seed(self.seed())
        self.calls += 1
        if self.p == 1.0:
            mask = torch.zeros_like(x, dtype=torch.bool)
            return x * 0, mask
        keep = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32) >= self.p
        return x * keep * (1.0 / (1.0 - self.p)), keep


# The random ops of an exported graph, and the overload of each that takes a generator (``None``: the
# op's own overload takes a ``generator`` keyword).
RANDOM_OPS: dict[str, Optional[str]] = {
    "aten.rand.default": "generator", "aten.randn.default": "generator", "aten.randint.default": "generator",
    "aten.randint.low": "low_generator", "aten.randperm.default": "generator", "aten.rand_like.default": "generator",
    "aten.randn_like.default": "generator", "aten.randint_like.default": "generator",
    "aten.randint_like.low_dtype": "low_generator_dtype", "aten.randint_like.Tensor": "Tensor_generator",
    "aten.bernoulli.default": None, "aten.bernoulli.p": None, "aten.bernoulli.Tensor": None,
    "aten.normal.Tensor_float": None, "aten.normal.float_Tensor": None, "aten.normal.Tensor_Tensor": None,
    "aten.normal.float_float": None, "aten.uniform.default": None, "aten.multinomial.default": None,
    "aten.exponential.default": None, "aten.poisson.default": None,
}


class SharedRandom(_Seeded):
    """One random op of the graph, drawn from a generator of its own: the same values on ranks with
    equal shard keys (a tensor held whole: every rank), independent pieces otherwise."""

    def __init__(self, op: torch._ops.OpOverload, base_seed: int, stream: int, shard_key: tuple[int, ...]) -> None:
        super().__init__(base_seed, stream, shard_key)
        name = f"aten.{op._schema.name.split('::')[1]}.{op._overloadname}"
        if name not in RANDOM_OPS:
            raise ValueError(f"{name} is not one of autotp's random ops: expected one of {sorted(RANDOM_OPS)}")
        overload = RANDOM_OPS[name]
        self.op = getattr(op.overloadpacket, overload) if overload else op
        self.name = name

    def extra_repr(self) -> str:
        return f"{self.name}, stream={self.stream}, shard_key={self.shard_key}"

    def forward(self, *args, **kwargs) -> torch.Tensor:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        device = kwargs.get("device") or (tensors[0].device if tensors else torch.device("cpu"))
        generator = torch.Generator(device=device).manual_seed(self.seed())
        self.calls += 1
        return self.op(*args, **kwargs, generator=generator)


def attention_dropout_p(args: tuple, kwargs: dict) -> float:
    """``dropout_p`` of a ``scaled_dot_product_attention`` call's arguments (0.0 where not given)."""
    p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    return float(p or 0.0)


class SeededAttention(_Seeded):
    """``scaled_dot_product_attention`` with ``dropout_p > 0``, its kernel's draws made under the
    global generator of its device forked and seeded for this call: the same dropped weights on
    ranks with equal shard keys, independent ones on different pieces (heads, batch, rows), and the
    caller's generator state as it was. The backward replays the forward's mask (the kernels keep it,
    or the seed they drew it from)."""

    def __init__(self, op: torch._ops.OpOverload, base_seed: int, stream: int, shard_key: tuple[int, ...]) -> None:
        super().__init__(base_seed, stream, shard_key)
        self.op = op

    def extra_repr(self) -> str:
        return f"stream={self.stream}, shard_key={self.shard_key}"

    def forward(self, *args, **kwargs) -> torch.Tensor:
        device = args[0].device
        seed = self.seed()
        self.calls += 1
        with _GLOBAL_RNG, torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
            if device.type == "cpu":
                torch.random.default_generator.manual_seed(seed)
            else:
                module = torch.get_device_module(device.type)
                with module.device(device):
                    module.manual_seed(seed)
            return self.op(*args, **kwargs)
