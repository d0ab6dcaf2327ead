"""autotp: automatic tensor parallelism for PyTorch models.

``autotp.plan(model, mesh, example_inputs)`` chooses how to split every op across a device mesh;
``autotp.parallelize(...)`` runs the model that way. The names below are the whole public surface
(docs/api.md lists each); README.md starts a user, docs/design.md is the design.

The package follows the pipeline, each stage importing only the ones before it:

- ``tracing/``    model and example inputs -> ``OpGraph`` (``autotp.capture``)
- ``local/``      how an op runs on a rank's pieces: collectives and the modules ops run inside
- ``planning/``   ``OpGraph``, mesh and hardware -> ``Plan`` (``autotp.plan``), its report and explain
- ``runtime/``    ``Plan`` -> the parallel module on local shards (``autotp.parallelize``)
- ``weights/``    the module's values: ``meta_init``, ``load_weights``, ``checkpoint``, ``init_weights``
- ``profiling/``  ``autotp profile``: the cluster measured into a hardware profile
- ``placement``, ``ops``, ``mesh``, ``units``: the words every stage shares
- ``parallel``, ``cli``: the faces, which put the stages together
"""

from autotp.parallel import parallelize
from autotp.planning.choices.check import check_rule
from autotp.planning.costs.program import Collective
from autotp.planning.errors import MemoryBudgetError, PlanError
from autotp.planning.planner import plan
from autotp.planning.result.plan import Plan, load_plan
from autotp.planning.rules import register_rule, unregister_rule
from autotp.runtime.module import ParallelModule
from autotp.tracing.export import CaptureError, capture
from autotp.tracing.graph import OpGraph, OpNode, TensorInfo
from autotp.weights import checkpoint
from autotp.weights.initialize import init_weights
from autotp.weights.loading import load_weights
from autotp.weights.meta import meta_init
from cost_models import OptimizerSpec

__all__ = ["capture", "CaptureError", "OpGraph", "OpNode", "TensorInfo", "plan", "Plan", "PlanError", "load_plan",
           "Collective", "MemoryBudgetError", "parallelize", "ParallelModule", "checkpoint", "load_weights", "meta_init", "init_weights",
           "OptimizerSpec", "register_rule", "unregister_rule", "check_rule"]
__version__ = "0.1.0"
