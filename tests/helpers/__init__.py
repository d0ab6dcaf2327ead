"""What the tests share: the references they compare with and the models they build.

- ``exactness``        one training step of a parallel module against the model in one process
- ``observed``         what a run communicates, collective by collective, against the plan
- ``host_reads``       host reads (a GPU's syncs) and host-made tensors of autotp's code, counted
- ``fake_device``      a parallel module on a device that is not the CPU, run with fake tensors
- ``local_exactness``  every strategy of an op run on pieces and put back together
- ``blocks``           fused-projection models and per-layer collective counts
- ``properties``       random small models and their exactness check
- ``plans``            a small model planned so that it shards
- ``captures``         autotp.plan's captures shared between its calls on one model

Imported as ``tests.helpers.<module>`` (the repository root is on pytest's path).
"""
