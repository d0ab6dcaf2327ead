"""Weights: the values in a parallel module's parameters, from nothing, from files, to files.

The last stage, after the runtime has built the module. Nothing here plans or rewrites.

- ``meta``        ``meta_init``: build a model with parameters on the meta device, buffers real
- ``loading``     ``load_weights``: each rank reads only its shards from safetensors or a checkpoint
- ``checkpoint``  sharded ``save``/``load`` (``torch.distributed.checkpoint``), ``full_state_dict``
- ``export``      ``save_pretrained``: the whole model as Hugging Face files, one tensor gathered at a time
                  (the parallel modules' ``save_pretrained`` method, given them on import)
- ``initialize``  ``init_weights``: the model's own init code, run on the shards
"""

from autotp.weights import export  # noqa: E402,F401 - gives the parallel modules save_pretrained
