"""Command line: ``autotp plan MODULE:FACTORY ...`` and ``autotp profile ...``.

``autotp plan examples.models:llama3_8b --mesh 8 --hardware h100-sxm`` imports the factory (a
function returning ``(model, example_inputs)``), plans, and prints the report; ``--devices 16``
instead of ``--mesh`` chooses the mesh shape too. An error (a model the trace refuses, a budget no
plan fits, a bad flag) prints its message alone and exits with 2; ``--debug`` prints the traceback too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import Any, Callable


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"8"`` → ``(8,)``; ``"2x4"`` → ``(2, 4)``."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape):
        raise argparse.ArgumentTypeError(f"mesh {text!r}: expected a shape such as 8 or 2x4")
    return shape


def load_factory(spec: str) -> Callable[[], Any]:
    """``"package.module:function"`` or ``"path/to/file.py:function"`` → the function (the current
    directory is importable, and a file's own directory while it is imported)."""
    if ":" not in spec:
        raise SystemExit(f"autotp plan: {spec!r} is not MODULE:FACTORY or FILE.py:FACTORY "
                         f"(e.g. examples.models:llama3_8b or ./my_models.py:build)")
    module_name, attr = spec.rsplit(":", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        module = _import_file(module_name)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise SystemExit(f"autotp plan: cannot import module {module_name!r}: {err} (for a file give its path, "
                             f"e.g. ./{module_name.replace('.', '/')}.py:{attr})") from err
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SystemExit(f"autotp plan: module {module_name!r} has no {attr!r}") from None


def _import_file(path: str) -> Any:
    import importlib.util

    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise SystemExit(f"autotp plan: no file {path!r} (from {os.getcwd()})")
    name = "autotp_factory_" + os.path.splitext(os.path.basename(full))[0]
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, os.path.dirname(full))  # the file's own imports of its neighbours
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(full))
    return module


def build_model(spec: str) -> tuple[Any, Any]:
    """Call the factory ``spec`` names; its ``(model, example_inputs)``, or a clear exit."""
    import torch

    from autotp.words import with_article

    factory = load_factory(spec)
    if not callable(factory):
        raise SystemExit(f"autotp plan: {spec} is {with_article(type(factory).__name__)}, not a function returning "
                         f"(model, example_inputs)")
    try:
        built = factory()
    except TypeError as err:
        if "argument" not in str(err):
            raise
        raise SystemExit(f"autotp plan: {spec} could not be called with no arguments ({err}); the CLI calls the "
                         f"factory as factory(): give its arguments defaults") from err
    if not (isinstance(built, tuple) and len(built) == 2):
        what = f"a tuple of {len(built)}" if isinstance(built, tuple) else with_article(type(built).__name__)
        raise SystemExit(f"autotp plan: {spec} returned {what}; expected (model, example_inputs): a torch.nn.Module "
                         f"and the inputs model(*example_inputs) is called with")
    model, example_inputs = built
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"autotp plan: {spec} returned ({type(model).__name__}, ...); its first item must be the "
                         f"model, a torch.nn.Module")
    return model, example_inputs


def run_plan(args: argparse.Namespace) -> int:
    import autotp

    model, example_inputs = build_model(args.factory)
    names = tuple(args.axis_names.split(",")) if args.axis_names else None
    from autotp.mesh import MeshSpec

    if args.devices is not None:
        if names:
            raise SystemExit("autotp plan: --axis-names names the axes of --mesh; with --devices the search names them")
        mesh = args.devices  # a device count: the mesh shape is chosen too
    else:
        mesh = MeshSpec.of(args.mesh, names)
    pins = {}
    for item in args.pin:
        if "=" not in item:
            raise SystemExit(f"autotp plan: --pin {item!r}: expected PARAM=PLACEMENTS, e.g. lm_head.weight=R")
        name, placements = item.split("=", 1)
        pins[name] = placements
    from cost_models import OptimizerSpec

    try:
        sizes = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, None: None}
        args.master_dtype = args.master_dtype.lower() if args.master_dtype else None
        args.state_dtype = args.state_dtype.lower() if args.state_dtype else None
        for flag, value in (("--master-dtype", args.master_dtype), ("--optimizer-state-dtype", args.state_dtype)):
            if value not in sizes:
                raise ValueError(f"{flag} {value!r}: expected float32, bfloat16 or float16")
        optimizer = OptimizerSpec("sgd" if args.optimizer == "none" else args.optimizer,
                                  state_dtype_bytes=sizes[args.state_dtype], master_dtype_bytes=sizes[args.master_dtype])
        plan = autotp.plan(model, mesh, example_inputs, hardware=args.hardware, mode=args.mode,
                           memory_budget=args.memory_budget, time_limit_s=args.time_limit, pin=pins or None,
                           dynamic_dims=None if args.dynamic else False, optimizer=optimizer,
                           recompute={"auto": None, "all": True, "off": False}[args.recompute],
                           pipeline=args.pipeline)
    except (autotp.MemoryBudgetError, autotp.CaptureError, ValueError) as err:
        # the message says what failed and what to do; the traceback is autotp's own, for --debug
        if args.debug:
            traceback.print_exc()
        print(f"autotp plan: {err}", file=sys.stderr)
        return 2
    print(plan.report(explain=args.explain == "*"))
    if args.explain not in (None, "*"):
        try:
            print("\n" + str(plan.explain(args.explain)))
        except ValueError as err:
            print(f"autotp plan: --explain {args.explain}: {err}", file=sys.stderr)
            return 2
    if args.json:
        plan.save(args.json)
        print(f"\nplan written to {args.json}")
    if args.html:
        with open(args.html, "w") as f:
            f.write(plan.report("html"))
        print(f"report written to {args.html}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from cost_models import DEFAULT_HARDWARE, builtin_profile_names

    parser = argparse.ArgumentParser(prog="autotp", description="Automatic tensor parallelism for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a model on a mesh and print the report")
    p.add_argument("factory", help="MODULE:FACTORY or FILE.py:FACTORY, a function of no arguments returning "
                                   "(model, example_inputs)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--mesh", type=parse_mesh, help="mesh shape: 8 or 2x4")
    where.add_argument("--devices", type=int, help="a device count: the mesh shape is chosen too, the cheapest of "
                                                   "its shapes on one or two axes (the report lists them)")
    p.add_argument("--pipeline", action="store_true",
                   help="with --devices, train mode: price pipeline stages x data x tensor parallel layouts too "
                        "(micro-batches, schedule, ZeRO stage, recompute; an expert axis for Mixture-of-Experts "
                        "models, a context axis at long sequence); the report lists them and names the mesh "
                        "autotp.parallelize runs the saved plan on, ('pp', 'tp'), ('pp', 'dp', 'tp') or "
                        "('pp', 'cp', 'tp') "
                        "(docs/pipelines.md#pipeline-stages-data-and-tensor-parallelism-priced-together)")
    p.add_argument("--axis-names", default=None, help="comma-separated axis names (default tp, or dp,tp for 2 axes)")
    p.add_argument("--hardware", default=None,
                   help=f"built-in profile name ({', '.join(builtin_profile_names())}) or a profile JSON path "
                        f"(default: {DEFAULT_HARDWARE}, as autotp.plan; autotp.parallelize defaults to the profile of the "
                        "mesh's device, cpu-gloo on CPU; the report says which priced the plan)")
    p.add_argument("--mode", choices=("train", "inference"), default="train",
                   help="train: the model traced in the mode its factory left it in, forward and backward priced; "
                        "inference: traced in eval mode (no dropout), forward only (default train)")
    p.add_argument("--memory-budget", default=None, help="bytes per device, e.g. 40GB or 16GiB")
    p.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit in seconds")
    p.add_argument("--pin", action="append", default=[], metavar="PARAM=PLACEMENTS",
                   help="fix a weight's layout, e.g. lm_head.weight=R or layers.0.mlp.up_proj.weight=S(0) (repeatable)")
    p.add_argument("--dynamic", action="store_true",
                   help="trace the batch and sequence dims as dynamic: the report lists them, and a parallel "
                        "module built from the saved plan runs at other sizes")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd_momentum", "sgd", "adafactor", "none"),
                   default="adamw", help="the optimizer whose state the memory counts (default adamw)")
    p.add_argument("--master-dtype", default=None,
                   help="mixed precision: the dtype of the optimizer's master weights, e.g. float32")
    p.add_argument("--optimizer-state-dtype", dest="state_dtype", default=None,
                   help="the dtype of the optimizer state (default: the parameter's, or the master's)")
    p.add_argument("--recompute", choices=("auto", "all", "off"), default="auto",
                   help="activation recompute of repeated layers: chosen by the planner when memory is short "
                        "(auto), every repeated layer (all), or none (off)")
    p.add_argument("--explain", nargs="?", const="*", default=None, metavar="MODULE",
                   help="after the report, why modules stay replicated: each placement their largest weight could "
                        "have, priced by solving again (all replicated modules, repeated layers once; or MODULE)")
    p.add_argument("--json", default=None, help="write the plan as JSON to this path")
    p.add_argument("--html", default=None, help="write the report as HTML to this path")
    p.add_argument("--debug", action="store_true",
                   help="on an error, print its traceback before the message (default: the message alone)")
    p.set_defaults(run=run_plan)

    from autotp.profiling import command as profile_command

    profile_parser = sub.add_parser("profile", help="measure the interconnect and the device, write a hardware profile")
    profile_command.add_arguments(profile_parser)
    profile_parser.set_defaults(run=profile_command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
