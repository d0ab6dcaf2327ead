"""One torch thread per test process.

``make test`` runs two pytest workers on two cores, and the tests' tensors are tiny: a second
intra-op thread per worker computes nothing faster, but every op that splits its work (a
convolution over its batch) waits at the end for a thread the other worker has taken the core
from, one scheduler slice at a time. The exactness check of every convolution strategy on a 2 x 2
mesh took 3 to 16 s on a busy machine, and 0.5 s on one thread. The spawned ranks of
``examples.ranks.run_ranks`` set one thread each as well.

The multi-process tests start their ranks from a fork server that has imported torch, transformers
and autotp once (``examples.ranks.preload``): a rank that imported them itself took about 4 s of a
core, twice per run, and the suite starts a few dozen runs.
"""

from __future__ import annotations

import torch

from examples.ranks import preload

torch.set_num_threads(1)
preload(["torch", "transformers", "autotp", "examples.models"])
