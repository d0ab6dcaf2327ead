"""The OpGraph: what capture produces and every later stage reads.

An :class:`OpGraph` is a flat, topologically ordered tuple of :class:`OpNode` values, one per
tensor-producing node of the exported ``torch.fx`` graph, plus the graph outputs. It carries only
plain data (shapes, dtypes, FLOPs, bytes, module paths, the parameter map) so the planner never
touches torch.fx; the exported program rides along in ``OpGraph.exported`` for the rewrite.

>>> from autotp.tracing.graph import TensorInfo
>>> TensorInfo((2, 3), "float32").nbytes
24
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from autotp.units import format_bytes

# Roles of nodes.
PARAMETER = "parameter"
BUFFER = "buffer"
INPUT = "input"  # a user input
CONSTANT = "constant"  # a lifted constant tensor
OP = "op"

_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as torch prints it without ``torch.``."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class TensorInfo:
    """Global shape and dtype of one tensor."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument of an op: the ``index``-th entry of ``OpNode.inputs``."""

    index: int

    def __repr__(self) -> str:
        return f"%{self.index}"


@dataclass(frozen=True)
class SizeArg:
    """A size argument computed from a dynamic dim: its expression and its example value."""

    expression: str
    hint: int

    def __repr__(self) -> str:
        return f"{self.expression}={self.hint}"


_MISSING = object()


@dataclass(frozen=True)
class OpArgs:
    """An op's arguments as typed data, named by the op's schema, defaults filled in.

    Values are Python scalars, strings, ``None``, tuples (lists become tuples), torch dtypes and
    devices, :class:`TensorArg` for a tensor (``List[Tensor]``: a tuple of them) and
    :class:`SizeArg` for a symbolic size. Equal arguments compare and hash equal, which is what
    layer tying and the strategy caches key on.

    >>> a = OpArgs(("self", "dim0", "dim1"), (TensorArg(0), 0, -1))
    >>> a["dim1"], a.get("dim2", 5), a
    (-1, 5, (self=%0, dim0=0, dim1=-1))
    """

    names: tuple[str, ...] = ()
    values: tuple[Any, ...] = ()

    def __getitem__(self, name: str) -> Any:
        try:
            return self.values[self.names.index(name)]
        except ValueError:
            raise KeyError(f"no argument {name!r}; the op has {list(self.names)}") from None

    def get(self, name: str, default: Any = None) -> Any:
        return self.values[self.names.index(name)] if name in self.names else default

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def items(self) -> tuple[tuple[str, Any], ...]:
        return tuple(zip(self.names, self.values))

    def int(self, name: str, ndim: int | None = None, default: Any = _MISSING) -> int:
        """An integer argument (a SizeArg reads as its example value); with ``ndim``, a dim index
        made non-negative."""
        value = self.get(name, default) if default is not _MISSING else self[name]
        value = value.hint if isinstance(value, SizeArg) else value
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"argument {name!r} is {value!r}, not an int")
        return value + ndim if ndim is not None and value < 0 else value

    def ints(self, name: str, ndim: int | None = None) -> tuple[int, ...] | None:
        """A list-of-int argument (None stays None); with ``ndim``, dims made non-negative."""
        value = self[name]
        if value is None:
            return None
        items = (value,) if isinstance(value, int) else tuple(value)
        hints = tuple(v.hint if isinstance(v, SizeArg) else v for v in items)
        return tuple(v + ndim if ndim is not None and v < 0 else v for v in hints)

    def is_tensor(self, name: str) -> bool:
        return isinstance(self.get(name), TensorArg)

    def __repr__(self) -> str:
        return "(" + ", ".join(f"{k}={v!r}" for k, v in self.items()) + ")"


@dataclass(frozen=True)
class OpNode:
    """One node of the graph.

    ``inputs`` names the tensor-producing node behind each tensor argument, one entry per
    occurrence (``mul(h, h)`` lists ``h`` twice), positional then keyword arguments;
    ``input_infos`` gives their tensors; ``args`` holds every argument by its schema name, tensors
    as :class:`TensorArg` indices into ``inputs``. ``outputs`` holds one
    :class:`TensorInfo` per tensor the op returns (usually one). ``flops`` is the forward FLOP
    count as ``torch.utils.flop_counter`` counts it; ``bytes_read``/``bytes_written`` are zero
    for ops that only create views.
    """

    name: str
    role: str
    target: str
    inputs: tuple[str, ...]
    input_infos: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    module_path: str = ""
    module_type: str = ""
    module_stack: tuple[str, ...] = ()
    param_fqn: str | None = None
    requires_grad: bool = False
    is_view: bool = False
    args: OpArgs = OpArgs()
    persistent: bool = True  # a buffer: in the model's state_dict (False: a cache, a mask)

    @property
    def output(self) -> TensorInfo:
        if len(self.outputs) != 1:
            raise ValueError(f"node {self.name} ({self.target}) has {len(self.outputs)} outputs, not one")
        return self.outputs[0]

    @property
    def is_placeholder(self) -> bool:
        return self.role != OP


@dataclass(frozen=True)
class ParameterInfo:
    """A parameter of the original model: its canonical name, aliases (tied names) and tensor."""

    fqn: str
    node: str
    info: TensorInfo
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class OpGraph:
    """The captured model: nodes in topological order and what the planner needs to know.

    ``outputs`` names the nodes whose values the model returns, in order. ``exported`` is the
    ``torch.export.ExportedProgram`` the graph came from (``None`` for a graph loaded from data).
    Shapes are the example's; ``dynamic`` and ``symbolic`` say which sizes may vary.
    """

    nodes: tuple[OpNode, ...]
    outputs: tuple[str, ...]
    parameters: tuple[ParameterInfo, ...]
    model_type: str = ""
    alias_placeholders: Mapping[str, str] = field(default_factory=dict)
    exported: Any = field(default=None, repr=False, compare=False)
    # dynamic dims (autotp.tracing.dynamic): the inputs' dims traced as symbols, and per node with any
    # symbolic size its outputs' dims as expressions in those symbols (None: static)
    dynamic: tuple[Any, ...] = ()
    symbolic: Mapping[str, tuple[tuple[Any, ...], ...]] = field(default_factory=dict, repr=False, compare=False)
    # the stacks of alike layers traced at three layers and unrolled (autotp/tracing/repeats.py), as
    # "path (n layers)"; empty for a whole trace
    unrolled: tuple[str, ...] = field(default=(), compare=False)
    training: bool = True  # the model's mode when traced (train: dropout drops, batch norm updates its statistics)
    # the modules traced in the other mode than the model's own (a frozen backbone in eval mode)
    other_mode: tuple[str, ...] = field(default=(), compare=False)
    # the op names the capture's own passes erased (an attention mask's subgraph, autotp/tracing/masks.py),
    # each with the op that followed it (None: the last): torch.fx had counted them, so the unroll
    # counts them in too, where they were, when it names the layers it copies
    erased: tuple[tuple[str, Optional[str]], ...] = field(default=(), compare=False)
    # outputs nothing reads whole (a pipeline's step returns the loss alone, not the logits beside
    # it: autotp/planning/search/step_reads.py): left as the plan holds them, neither priced as
    # gathered whole nor held whole
    unread_outputs: tuple[str, ...] = field(default=(), compare=False)
    @property
    def modes(self) -> Any:
        """The modes the model was traced in (:data:`autotp.tracing.inputs.Modes`)."""
        return (self.training, self.other_mode) if self.other_mode else self.training

    _index: Mapping[str, int] = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    _consumers: Mapping[str, tuple[str, ...]] = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    _ops: tuple[OpNode, ...] = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        index = {n.name: i for i, n in enumerate(self.nodes)}
        consumers: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for src in dict.fromkeys(n.inputs):
                consumers[src].append(n.name)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_consumers", {k: tuple(v) for k, v in consumers.items()})
        object.__setattr__(self, "_ops", tuple(n for n in self.nodes if n.role == OP))

    def __getitem__(self, name: str) -> OpNode:
        return self.nodes[self._index[name]]

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self.nodes)

    def position(self, name: str) -> int:
        return self._index[name]

    def consumers(self, name: str) -> tuple[str, ...]:
        """Names of the nodes that read ``name`` (each once)."""
        return self._consumers[name]

    def gradient_reads(self, name: str) -> int:
        """How many gradients flow back into ``name``'s output in a training step, which autograd
        then adds up: one per read by a node that carries a gradient (a node reading it twice counts
        twice), and one more if the model returns it. 0 for a node without a gradient, or with
        several outputs (each of its items is read, and summed, on its own)."""
        node = self[name]
        if not node.requires_grad or len(node.outputs) != 1 or not node.output.is_float:
            return 0
        reads = sum(self[c].inputs.count(name) for c in self._consumers[name] if self[c].requires_grad)
        return reads + self.outputs.count(name)

    def ops(self) -> tuple[OpNode, ...]:
        return self._ops

    def total_flops(self) -> float:
        """Forward FLOPs of the whole graph."""
        return float(sum(n.flops for n in self.nodes))

    def parameter_numel(self) -> int:
        return sum(p.info.numel for p in self.parameters)

    def parameter_bytes(self) -> int:
        return sum(p.info.nbytes for p in self.parameters)

    def parameter(self, fqn: str) -> ParameterInfo:
        for p in self.parameters:
            if p.fqn == fqn or fqn in p.aliases:
                return p
        raise KeyError(f"no parameter named {fqn!r}")

    def summary(self) -> str:
        ops = self.ops()
        return (
            f"{self.model_type or 'model'}: {len(ops)} ops, {len(self.parameters)} parameters "
            f"({self.parameter_numel() / 1e6:.1f}M elements, {format_bytes(self.parameter_bytes())}), "
            f"{self.total_flops() / 1e9:.1f} GFLOP forward"
        )
