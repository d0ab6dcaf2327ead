"""autotp: automatic tensor parallelism for PyTorch models.

``autotp.plan(model, mesh, example_inputs)`` chooses how to split every op across a device mesh;
``autotp.parallelize(...)`` runs the model that way. See README.md and docs/design.md.
"""

from cost_models import OptimizerSpec

from autotp.parallel import parallelize
from autotp.planning.errors import MemoryBudgetError, PlanError
from autotp.planning.plan import Plan, load_plan
from autotp.planning.planner import plan
from autotp.planning.program import Collective
from autotp.planning.rules import register_rule, unregister_rule
from autotp.planning.rules.check import check_rule
from autotp.tracing.export import CaptureError, capture
from autotp.tracing.graph import OpGraph, OpNode, TensorInfo
from autotp.weights import checkpoint
from autotp.weights.initialize import init_weights
from autotp.weights.loading import load_weights
from autotp.weights.meta import meta_init

__all__ = ["capture", "CaptureError", "OpGraph", "OpNode", "TensorInfo", "plan", "Plan", "PlanError", "load_plan",
           "Collective", "MemoryBudgetError", "parallelize", "checkpoint", "load_weights", "meta_init", "init_weights",
           "OptimizerSpec", "register_rule", "unregister_rule", "check_rule"]
__version__ = "0.1.0"
