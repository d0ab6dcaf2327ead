"""autotp: automatic tensor parallelism for PyTorch models.

``autotp.plan(model, mesh, example_inputs)`` chooses how to split every op across a device mesh;
``autotp.parallelize(...)`` runs the model that way. See README.md and docs/design.md.
"""

from cost_models import OptimizerSpec

from autotp import checkpoint
from autotp.capture import CaptureError, capture
from autotp.graph import OpGraph, OpNode, TensorInfo
from autotp.plan import Plan, PlanError, load_plan
from autotp.initialize import init_weights
from autotp.loading import load_weights
from autotp.meta import meta_init
from autotp.parallel import parallelize
from autotp.planner import plan
from autotp.program import Collective
from autotp.rules import register_rule, unregister_rule
from autotp.rules.check import check_rule
from autotp.solver import MemoryBudgetError

__all__ = ["capture", "CaptureError", "OpGraph", "OpNode", "TensorInfo", "plan", "Plan", "PlanError", "load_plan",
           "Collective", "MemoryBudgetError", "parallelize", "checkpoint", "load_weights", "meta_init", "init_weights",
           "OptimizerSpec", "register_rule", "unregister_rule", "check_rule"]
__version__ = "0.1.0"
