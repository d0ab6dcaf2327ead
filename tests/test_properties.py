"""Property tests: random small models x meshes x modes, each exact against one process.

Hypothesis draws a stack of blocks (MLPs, attention with a random number of heads, LayerNorm and
RMSNorm), its width, batch and sequence length, a mesh ((2,), (4,) or (2, 2)), a mode and how
tight the memory budget is (a little to a lot above the least any plan needs, so that plans shard
in many different ways). For each case the planner plans, and the ranks (threads of this process,
``examples.ranks.run_threads``) build the parallel module and check:

- outputs and, in train mode, every parameter gradient equal the model in one process;
- the collectives that ran equal ``plan.collectives()``, kind, axis and bytes.

A failure prints the drawn case (``seed`` included: it seeds the weights and inputs), which
rebuilds the same model. The default run is derandomized (the same cases every time, so CI is
stable); ``make test-slow`` runs many more, drawn afresh. Set ``AUTOTP_PROPERTY_EXAMPLES`` to
choose how many.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.helpers.properties import Case, check

pytestmark = pytest.mark.timeout(900)


cases = st.builds(
    Case,
    blocks=st.lists(st.sampled_from(["mlp", "attention", "layer_norm", "rms_norm"]), min_size=1, max_size=4).map(tuple),
    dim=st.sampled_from([8, 12, 16, 24]),
    heads=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([4, 8]),
    batch=st.sampled_from([1, 2, 4]),
    seq=st.sampled_from([3, 4, 8]),
    mesh=st.sampled_from([(2,), (4,), (2, 2)]),
    mode=st.sampled_from(["train", "inference"]),
    slack=st.sampled_from([0.02, 0.1, 0.5]),
    seed=st.integers(0, 2**16),
)


_EXAMPLES = int(os.environ.get("AUTOTP_PROPERTY_EXAMPLES", "0"))
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)


@settings(max_examples=_EXAMPLES or 6, derandomize=True, **_COMMON)  # the slow case below draws 150
@given(case=cases)
def test_random_models_are_exact_on_every_mesh(case):
    event(check(case))


@pytest.mark.slow
@settings(max_examples=_EXAMPLES or 150, **_COMMON)
@given(case=cases)
def test_many_random_models_are_exact_on_every_mesh(case):
    event(check(case))
