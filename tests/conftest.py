"""One torch thread per test process.

``make test`` runs two pytest workers on two cores, and the tests' tensors are tiny: a second
intra-op thread per worker computes nothing faster, but every op that splits its work (a
convolution over its batch) waits at the end for a thread the other worker has taken the core
from, one scheduler slice at a time. The exactness check of every convolution strategy on a 2 x 2
mesh took 3 to 16 s on a busy machine, and 0.5 s on one thread. The spawned ranks of
``examples.ranks.run_ranks`` set one thread each as well.

The multi-process tests start their ranks from a fork server that has imported torch, transformers,
autotp and the model families the ranks build once (``examples.ranks.preload``): a rank that imported
them itself took about 5 s of a core, twice per run.
"""

from __future__ import annotations

import torch

from examples.ranks import preload

torch.set_num_threads(1)
# what the ranks of the multi-process tests import: each model family's module is 0.3 to 1 s a rank
preload(["torch", "transformers", "autotp", "examples.models", "torch._dynamo", "torch.distributed.checkpoint",
         "torch.distributed.pipelining"] + [f"transformers.models.{m}.modeling_{m}" for m in
                                            ("llama", "gpt2", "bert", "bart", "gpt_neo", "qwen2", "qwen3_moe")])
