"""Train a Hugging Face model on 2 ranks: built on meta, parallelized, loaded from safetensors.

    torchrun --nproc-per-node 2 examples/train_hf.py

Rank 0 first saves a random Llama with ``save_pretrained``, standing in for a downloaded
checkpoint. Every rank then builds the model on the meta device (no memory), lets autotp plan and
shard it, reads only its own shards of the safetensors files, and trains three steps. On GPUs, use
``"nccl"`` and ``init_device_mesh("cuda", (2,))``.
"""

import os, tempfile
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM
import autotp

dist.init_process_group("gloo")
config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=2048)  # the other fields: LlamaConfig's defaults
path = os.path.join(tempfile.gettempdir(), "autotp-train-hf")
if dist.get_rank() == 0: LlamaForCausalLM(config).save_pretrained(path)  # stands in for a download
dist.barrier()
with autotp.meta_init():                                     # parameters on meta: no memory yet
    model = LlamaForCausalLM(config)
ids = torch.randint(0, config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
mesh = init_device_mesh("cpu", (2,))
pmodel = autotp.parallelize(model, mesh, {"input_ids": ids, "labels": ids}, memory_budget="40MiB")
autotp.load_weights(pmodel, path)                            # each rank reads only its shards
optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
for step in range(3):
    loss = pmodel(input_ids=ids, labels=ids).loss
    loss.backward(); optimizer.step(); optimizer.zero_grad()
    if dist.get_rank() == 0: print(f"step {step}: loss {loss.item():.4f}")
if dist.get_rank() == 0: print(pmodel.plan.report())
dist.destroy_process_group()
