"""The parallel module: a ``GraphModule`` on local shards that switches graphs with ``train()``/``eval()``.

A traced graph holds one mode of the model: dropout that drops or not, batch norm that updates its
running statistics or reads them, and whatever else ``forward()`` decides from ``self.training``.
So :class:`ParallelModule` keeps one graph per mode, over the same parameters and buffers, and
``train(mode)`` / ``eval()`` runs the graph of that mode, as the model's own ``train()`` /
``eval()`` would switch it.

The graph of the mode the module was built in comes from ``autotp.parallelize``. The other one is
made the first time the module switches to it (:class:`ModeSwitch`): a copy of the model with its
tensors on the meta device, taken at ``parallelize`` (the user's own model is not kept, nor read
again), is traced in that mode. Where the graph is the same op for op (no dropout, no batch norm),
the same plan runs it; else the mesh's first rank plans the new graph (in the first plan's mode, train
or inference) with every parameter pinned where it already is (no weight moves) and every rank gets
that plan, so the first switch to a mode
is collective: every rank calls ``train()`` / ``eval()``, as every rank calls ``forward``. The
switches after it swap the graph only.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import re
from typing import Any, Optional

import torch
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autotp.planning.result.plan import Plan
from autotp.runtime.agreement import agreed_plan, dropout_seed
from autotp.runtime.guard import SizeNotTraced
from autotp.runtime.interface import Parallelized, default_loss
from autotp.runtime.rewrite import GraphRewrite
from autotp.runtime.state import build_graph, put, register_state
from autotp.tracing.graph import OpGraph
from autotp.tracing.inputs import Modes, describe_modes

__all__ = ["ParallelModule", "ModeSwitch", "build_parallel_module", "meta_copy",
           "op_signature", "refuse_cast"]


def meta_copy(model: nn.Module) -> Optional[nn.Module]:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no memory), to trace
    again later; None where the model cannot be copied (then a later switch of mode says so)."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None and id(b) not in memo:
                memo[id(b)] = b.detach().to("meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - a model that cannot be copied is traced in one mode only
        return None


class ModeSwitch:
    """What the parallel module needs to make the graph of another mode: the meta copy of the model,
    the example inputs (on meta), how they were traced, the mesh, and how the first plan was made."""

    def __init__(self, skeleton: Optional[nn.Module], example_inputs: Any, dynamic_dims: Any, mesh: Any,
                 memory_budget: Any, recompute: Optional[bool]) -> None:
        self.skeleton = skeleton
        self.example_inputs = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"),
                                                                 example_inputs)
        self.dynamic_dims = dynamic_dims
        self.mesh = mesh
        self.memory_budget = memory_budget
        self.recompute = recompute
        # what users read from the model itself (a Hugging Face model's config), kept on the module
        self.attributes = {name: getattr(skeleton, name, None) for name in _MODEL_ATTRIBUTES}

    def example_of(self, args: tuple, kwargs: dict) -> Any:
        """A call's inputs as example inputs: positional as a tuple, keywords as a dict of every input
        by name (positional ones named by the model's ``forward``)."""
        if not kwargs:
            return tuple(args)
        names = list(inspect.signature(self.skeleton.forward).parameters)
        return {**dict(zip(names, args)), **kwargs}

    def graph_for(self, module: "ParallelModule", modes: Modes, example_inputs: Any = None,
                  prefix: Optional[str] = None) -> tuple[torch.fx.Graph, Any, tuple]:
        """The graph (on ``module``'s state), the plan and the ops (:func:`op_signature`) of ``module``'s
        model in ``modes`` (True: train, False: eval, or the mix it was built in), traced on the example
        inputs (``example_inputs``: others, such as a call's inputs at a size the first trace
        specialized)."""
        from autotp.mesh import MeshSpec
        from autotp.tracing.export import capture

        if self.skeleton is None:
            raise RuntimeError(f"this parallel module runs the model in {describe_modes(module.graph_modes)} mode only: "
                               f"autotp could not copy the model to trace it in {describe_modes(modes)} mode; put the "
                               f"model in {describe_modes(modes)} mode before autotp.parallelize")
        first = module.plan
        inputs = self.example_inputs if example_inputs is None else _on_meta(example_inputs)
        graph = capture(self.skeleton, inputs, self.dynamic_dims, training=modes, device=self.mesh.device_type)
        spec = MeshSpec.of(self.mesh)
        ops = op_signature(graph)
        if ops == module.autotp_ops and example_inputs is None:
            plan = first
        else:
            pins = first.storage_pins(graph)  # every weight and buffer stays where it is stored
            # the first plan's mode, not the new one's: a train plan's graph in eval mode may still run a
            # backward (fine-tuning with dropout off), and only a train plan reduces its gradients
            plan = agreed_plan(graph, spec, self.mesh, first.hardware, first.mode, self.memory_budget, 0.0,
                                first.optimizer, self.recompute, keep=pins, hardware_source=first.hardware_source)
        plan.check_matches(graph, spec)
        fx_graph = build_graph(graph, plan, self.mesh, module, dropout_seed(self.mesh, graph),
                               prefix=prefix if prefix is not None else _prefix(modes))
        return fx_graph, plan, ops


def _on_meta(inputs: Any) -> Any:
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to("meta"), inputs)


def _shape_key(args: tuple, kwargs: dict) -> tuple:
    """What tells a call's graph apart: each tensor's shape and dtype, in order, keywords by name."""
    def one(x: Any) -> Any:
        return (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else type(x).__name__
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _prefix(modes: Modes) -> str:
    """The graph's node-name prefix of a mode: ``train_``, ``eval_``, ``mixed_``."""
    return ("train" if modes else "eval") + "_" if isinstance(modes, bool) else "mixed_"


def op_signature(graph: Any) -> tuple:
    """What two captures of one model must share to be one graph: every node the same op on the same
    arguments (a dropout's train flag and a batch norm's ``training`` are arguments). Kept instead of
    the capture, which holds the model's tensors."""
    if graph.exported is None:
        return ()
    # a model traced on meta (the copy) names the meta device where the real one names its own
    return tuple((x.name, x.op, str(x.target), _DEVICE.sub("device", str(x.args)), _DEVICE.sub("device", str(x.kwargs)))
                 for x in graph.exported.graph.nodes)


@functools.lru_cache(maxsize=64)
def _input_names(forward: Any) -> tuple[str, ...]:
    """The inputs a graph's generated ``forward`` takes (export's codegen names them as the model's)."""
    return tuple(n for n in inspect.signature(forward).parameters if n != "self")


log = logging.getLogger(__name__)

_MODEL_ATTRIBUTES = ("config", "generation_config", "name_or_path")

_DEVICE = re.compile(r"device\(type='[^']*'(, index=\d+)?\)")


class ParallelModule(torch.fx.GraphModule, Parallelized):
    """What ``autotp.parallelize`` returns (module docstring). Besides the ``GraphModule``, it has
    ``plan`` (the plan of the graph that runs now), ``plans`` (per mode, ``True`` for train, the plans
    made so far), ``graph_training`` (the mode of the graph that runs now: the top module's),
    ``graph_modes`` (every module's: :data:`autotp.tracing.inputs.Modes`) and ``autotp_placements``;
    and what users read from the model: its ``config``, ``generation_config`` and ``name_or_path``
    where it has them; ``save_pretrained`` writes the whole model as Hugging Face does (a method
    :mod:`autotp.weights.export` gives the class: the runtime does not import the weights). A keyword
    argument the trace did not see is a ``TypeError`` that says how to give it to ``autotp.parallelize``."""

    def _autotp_init(self, graph: Any, plan: Any, switch: Optional[ModeSwitch], check_inputs: Optional[int]) -> None:
        """Called once when built: the graph just built is the one of the traced mode. Per mode: the fx
        graph, its plan and its ops (:func:`op_signature`)."""
        self.autotp_check_inputs = check_inputs
        # the model's modes as given (a frozen submodule in eval mode keeps its own), until train() or
        # eval() sets every module
        self.graph_modes = graph.modes
        self.graph_training = bool(graph.training)
        self._autotp_modes = {self.graph_modes: (self.graph, plan, op_signature(graph))}
        self._autotp_switch = switch
        # graphs for sizes the first trace specialized (a batch of one, one new token), by mode and
        # the call's shapes: the graph and its plan, made on the first such call
        self._autotp_variants: dict[tuple, tuple[torch.fx.GraphModule, Any]] = {}
        for name in _MODEL_ATTRIBUTES:  # what users read from a Hugging Face model
            if getattr(switch, "attributes", {}).get(name) is not None:
                setattr(self, name, switch.attributes[name])
        nn.Module.train(self, self.graph_training)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            inputs = _input_names(type(self).forward)
            unknown = [k for k in kwargs if k not in inputs]
            if unknown:
                traced = ", ".join(inputs)
                raise TypeError(f"this parallel module was traced with the inputs ({traced}) and was given "
                                f"{', '.join(unknown)}, which the trace did not see and the plan does not cover; give "
                                f"them to autotp.parallelize in the example inputs, e.g. example_inputs="
                                f"{{{', '.join(repr(n) + ': ...' for n in [*inputs, *unknown])}}}")
        if len(args) + len(kwargs) < len(_input_names(type(self).forward)):
            inputs = _input_names(type(self).forward)
            missing = [n for n in inputs[len(args):] if n not in kwargs]
            it = "it" if len(missing) == 1 else "them"
            hint = " (an attention mask of ones for none)" if any("mask" in n for n in missing) else ""
            raise TypeError(f"this parallel module was traced with the inputs ({', '.join(inputs)}) and runs only "
                            f"with all of them; {', '.join(missing)} not given. Give {it}{hint}, or parallelize "
                            f"with example inputs without {it}")
        if self._autotp_variants:  # the call's shapes read only once a graph for other sizes exists
            variant = self._autotp_variants.get((self.graph_modes, _shape_key(args, kwargs)))
            if variant is not None:
                return variant[0](*args, **kwargs)
        try:
            return super().__call__(*args, **kwargs)
        except SizeNotTraced:  # raised by the input check, before anything ran
            if self._autotp_switch is None:
                raise
        key = (self.graph_modes, _shape_key(args, kwargs))
        # every rank is given the same inputs, so every rank comes here at the same call
        prefix = f"{_prefix(self.graph_modes)}{len(self._autotp_variants) + 1}_"
        example = self._autotp_switch.example_of(args, kwargs)
        fx_graph, plan, _ = self._autotp_switch.graph_for(self, self.graph_modes, example, prefix)
        module = torch.fx.GraphModule(self, fx_graph, class_name="AutotpParallelGraph")
        self._autotp_variants[key] = (module, plan)
        log.info("autotp: traced and planned again for inputs of shapes %s (a size the first trace specialized); "
                 "every weight and buffer stays where it is stored", key[1])
        return module(*args, **kwargs)

    def step(self, *args: Any, target: Any = None, loss_fn: Optional[Any] = None, **kwargs: Any) -> torch.Tensor:
        """One training step (:class:`autotp.runtime.interface.Parallelized`): the forward on the
        inputs, the loss (``loss_fn(output, target)``, else the model's own: ``labels=`` given), its
        backward; returns the loss, detached, on every rank, the gradients left on the parameters.
        Collective, as the forward is."""
        output = self(*args, **kwargs)
        loss = loss_fn(output, target) if loss_fn is not None else default_loss(output)
        loss.backward()
        return loss.detach()

    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, **options: Any) -> torch.Tensor:
        """Generate as a Hugging Face model's ``generate`` does, with a KV cache split like the attention
        (:mod:`autotp.runtime.generation`): greedy or sampled (``do_sample``, ``temperature``,
        ``top_k``, ``top_p``), ``max_new_tokens``, ``eos_token_id``, ``pad_token_id``,
        ``max_cache_len`` (default: the prompt's length plus ``max_new_tokens``, or a longer cache of
        this batch size already held), ``generator``, and what
        the model's ``generation_config`` asks of the scores (a repetition penalty, a forced end
        token, ...), applied by ``transformers``' own processors; ``compile`` (True, or
        ``torch.compile``'s keyword arguments) runs the decode step as one compiled graph. A causal LM
        returns the prompts followed by the new tokens; an encoder-decoder, the decoder's start token
        followed by the new tokens. Collective: every rank calls it with the same prompts, and every
        rank returns the same tokens."""
        from autotp.runtime.generation import generate

        return generate(self, input_ids, attention_mask, **options)

    def _autotp_cache_graphs(self, batch: int, max_cache_len: int, prompt_len: int) -> Any:
        from autotp.runtime.generation import CacheGraphs

        graphs = getattr(self, "_autotp_generation", {})
        self._autotp_generation = graphs
        key = (batch, max_cache_len)
        if key not in graphs:
            graphs[key] = CacheGraphs(self, self._autotp_switch, batch, max_cache_len, prompt_len)
            for shorter in [k for k in graphs if k[0] == batch and k[1] < max_cache_len]:
                del graphs[shorter]  # the longer cache serves every call the shorter served: its memory is freed
        return graphs[key]

    @property
    def generation_plans(self) -> dict[tuple, dict[str, Any]]:
        """The plans of ``generate``'s graphs, by (batch, cache length): ``{"prompt": plan, "token": plan}``
        (and ``"prompt of <length>"`` for a prompt length the first prompt graph, its rows split, does
        not hold; ``plan.report()`` of the token's shows what one decoded token runs)."""
        return {key: dict(graphs.plans) for key, graphs in getattr(self, "_autotp_generation", {}).items()}

    @property
    def device(self) -> torch.device:
        """The device this rank's shards are on (what a Hugging Face model's ``device`` says)."""
        for p in self.parameters():
            return p.to_local().device if hasattr(p, "to_local") else p.device
        return torch.device("cpu")

    @property
    def variant_plans(self) -> dict[tuple, Any]:
        """The plans of the graphs made for sizes the first trace specialized, by (mode, the call's shapes)."""
        return {key: plan for key, (_, plan) in self._autotp_variants.items()}

    @property
    def plan(self) -> Any:
        return self._autotp_modes[self.graph_modes][1]

    @property
    def autotp_ops(self) -> tuple:
        return self._autotp_modes[self.graph_modes][2]

    @property
    def plans(self) -> dict[Any, Any]:
        return {mode: entry[1] for mode, entry in self._autotp_modes.items()}

    def _apply(self, fn: Any, recurse: bool = True) -> "ParallelModule":
        """``.to()``, ``.half()``, ``.bfloat16()``, ``.float()``, ``.double()`` and ``.cuda()`` come here:
        a change of the floating dtype is refused before anything is cast (the graph was traced and
        planned for the model's dtype: its casts, masks and costs depend on it); anything else, as
        ``nn.Module`` does."""
        if getattr(self, "_autotp_modes", None) is not None:
            refuse_cast(self, fn)
        return super()._apply(fn, recurse)

    def train(self, mode: bool = True) -> "ParallelModule":
        """Every module of the model in train (``mode=True``) or eval mode, as ``nn.Module.train`` sets
        them: a module built with a submodule in the other mode (a frozen backbone) runs it in ``mode``
        too from here on, as the model would after ``model.train(mode)``."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        modes = getattr(self, "_autotp_modes", None)
        if modes is not None and mode != self.graph_modes:
            if mode not in modes:
                if self._autotp_switch is None:
                    raise RuntimeError(f"this parallel module was built from a plan and graph alone and runs the "
                                       f"model in {describe_modes(self.graph_modes)} mode only; build it with "
                                       f"autotp.parallelize to switch it to {describe_modes(mode)} mode")
                modes[mode] = self._autotp_switch.graph_for(self, mode)
            self.graph = modes[mode][0]  # recompiles forward
            self.graph_modes = mode
            self.graph_training = mode
        return nn.Module.train(self, mode)


def refuse_cast(module: nn.Module, fn: Any) -> None:
    """Raise before ``module._apply(fn)`` casts a parallel module's floating weights to another dtype
    (``ParallelModule._apply``): ``fn`` is tried on an empty meta tensor of their dtype."""
    current = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if current is None:
        return
    try:
        probe = fn(torch.empty(0, dtype=current, device="meta"))
    except Exception:  # noqa: BLE001 - a move to a device (meta cannot be copied out): no cast
        return
    if isinstance(probe, torch.Tensor) and probe.dtype != current:
        raise TypeError(
            f"this parallel module was traced and planned with {str(current).removeprefix('torch.')} weights "
            f"and cannot be cast to {str(probe.dtype).removeprefix('torch.')} afterwards (its graph's casts, "
            f"masks and costs are the traced dtype's); cast the model before parallelizing it "
            f"(model.to({probe.dtype}), then autotp.parallelize), or run it under torch.autocast. Nothing was "
            f"changed")


# -- building ----------------------------------------------------------------------------------------

def build_parallel_module(graph: OpGraph, plan: Plan, mesh: DeviceMesh, model: nn.Module,
                          seed: int | None = None, switch: ModeSwitch | None = None,
                          check_inputs: int | None = 0) -> ParallelModule:
    """The parallel module of this rank: its state (:func:`autotp.runtime.state.register_state`) and the graph of
    :class:`autotp.runtime.rewrite.GraphRewrite`. ``seed``: the base seed of the dropout masks
    (:mod:`autotp.local.dropout`), equal on every rank; default ``torch.initial_seed()``. ``switch``: how to
    make the graph of the model's other mode when ``train()``/``eval()`` asks for it; without it the
    module runs the traced mode only. ``check_inputs``: how many calls of each graph compare the inputs
    across the ranks (:class:`autotp.runtime.guard.SameOnEveryRank`; None: every call; default none,
    ``autotp.parallelize`` checks its first calls)."""
    root = nn.Module()
    placements = register_state(root, graph, plan, mesh, model)
    rewrite = GraphRewrite(graph, plan, mesh, root, seed, check_inputs=check_inputs)
    rewrite.emit()
    gm = ParallelModule(root, rewrite.fx, class_name="AutotpParallelModule")
    # GraphModule copies only what the graph touches: register tied names and unused state too
    present = set(dict(gm.named_parameters(remove_duplicate=False))) | set(dict(gm.named_buffers()))
    for name, param in root.named_parameters(remove_duplicate=False):
        if name not in present:
            put(gm, name, param, "parameter")
    persistent = set(model.state_dict().keys())
    for name, buf in root.named_buffers():
        # GraphModule re-registers the buffers it reads as persistent: restore the model's choice
        put(gm, name, buf, "buffer", persistent=name in persistent)
    # by name on the module, where they outlive .to() and .half() (which make new parameters)
    gm.autotp_placements = placements  # type: ignore[assignment]
    # what save_pretrained writes as the model's own would: its class (the config's ``architectures``)
    # and its state dict's order (the files' split)
    gm.autotp_model_class = type(model).__name__
    gm.autotp_state_keys = tuple(model.state_dict().keys())
    rewrite.finish(gm)
    gm._autotp_init(graph, plan, switch, check_inputs)
    return gm
