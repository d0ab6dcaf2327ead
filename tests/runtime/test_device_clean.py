"""The runtime makes nothing on the CPU for a mesh on another device: parallel modules over a fake
process group of 2 (one rank's view: rank 0's, or the last pipeline stage's), their mesh and tensors
on the meta device, run with fake tensors (``tests/helpers/fake_device.py``). A tensor the runtime
makes on the CPU meets the mesh's tensors in its next op and raises, as on a GPU; tests inject one
into the loss and into generate's loop and see it caught. Covered: train and eval steps, batch norm,
dropout, generate (prompt, decode steps, loop; no host read per token), a pipeline stage's step and
forward, checkpoint save/load (DCP stood in) and full_state_dict. Fake tensors compute nothing: these
check devices, not values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autotp
from autotp.placement import S
from autotp.planning.planner import plan_graph
from autotp.runtime.guard import DEFAULT_INPUT_CHECKS
from autotp.runtime.module import build_parallel_module
from autotp.tracing.loss import WithLoss
from examples.models import tiny_llama
from tests.helpers.fake_device import DEVICE, DEVICE_MISMATCH, fake_ranks, fake_tensors
from tests.helpers.host_reads import HostReads


def _cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=7)


def _llama_with_loss():
    # vocabulary 2048: the split loss pays off from here (tests/runtime/test_losses.py)
    model, (ids,) = tiny_llama(batch=2, seq=32, n_layer=1, dim=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab=2048,
                               device="meta")
    return WithLoss(model, _cross_entropy), (ids, ids)


def _on_device(example):
    return tuple(torch.zeros(t.shape, dtype=t.dtype, device=DEVICE) for t in example)


def _step(model, example, pin=None, mode="train", backward=True, plan_of=None, planned=None):
    """One call of ``model``'s parallel module, and its backward, on fake tensors of the mesh's device;
    returns the output's device, the gradients' devices, the plan (``plan_of(graph)`` where given) and the
    kinds of module the parallel module runs. ``planned``: the (graph, plan) of ``model`` made already."""
    graph = planned[0] if planned else autotp.capture(model, example)
    with fake_ranks() as mesh:
        if planned:
            plan = planned[1]
        else:
            plan = plan_of(graph) if plan_of else plan_graph(graph, (2,), "cpu-gloo", mode, pin=pin)
        with fake_tensors():
            pm = build_parallel_module(graph, plan, mesh, model)
            out = pm(*_on_device(example))
            out = out if isinstance(out, torch.Tensor) else out[0]
            if backward:
                out.float().sum().backward()
            grads = {p.grad.device for p in pm.parameters() if p.grad is not None}
    return out.device, grads, plan, {type(m).__name__ for m in pm.modules()}


@pytest.fixture(scope="module")
def llama_with_loss():
    """The Llama with its loss, its graph and its plan with the head split by vocabulary (the split
    loss): captured and planned once for the train step and the harness's check of it."""
    model, example = _llama_with_loss()
    graph = autotp.capture(model, example)
    with fake_ranks():
        plan = plan_graph(graph, (2,), "cpu-gloo", "train", pin={"lm_head.weight": "S(0)"})
    return model, example, (graph, plan)


def test_a_train_step_with_the_vocabulary_split_loss_stays_on_the_device(llama_with_loss):
    model, example, planned = llama_with_loss
    out, grads, plan, _ = _step(model, example, planned=planned)
    loss = next(n for n in plan.nodes if n.target == "aten.cross_entropy_loss.default")
    assert plan.strategy(loss.name).inputs[0] == (S(1),)  # the split loss ran
    assert out == DEVICE and grads == {DEVICE}


class _MadeOnTheHost:
    """``torch`` as a module of autotp sees it, but the factory ``name`` makes its tensor on the CPU:
    the mistake of a tensor made with no ``device=``."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        made = getattr(torch, attr)
        if attr != self._name:
            return made

        def on_the_host(*args, **kwargs):
            kwargs.pop("device", None)
            return made(*args, **kwargs).to("cpu")

        return on_the_host


def test_the_harness_fails_a_cpu_tensor_made_inside_the_runtime(llama_with_loss, monkeypatch):
    """The split loss's zeros (``torch.where(mine, picked, zeros)``) made on the CPU: the step raises."""
    import autotp.local.losses as losses

    model, example, planned = llama_with_loss
    monkeypatch.setattr(losses, "torch", _MadeOnTheHost("zeros_like"))
    with pytest.raises(Exception, match=DEVICE_MISMATCH):
        _step(model, example, planned=planned)


def test_an_eval_step_stays_on_the_device():
    model, example = _llama_with_loss()
    model.eval()
    with torch.no_grad():
        out, *_ = _step(model, example, mode="inference", backward=False)
    assert out == DEVICE


def test_batch_norm_in_training_and_its_backward_stay_on_the_device():
    from tests.runtime.test_batch_norm import ConvNet, _plan_at_the_floor

    with torch.device("meta"):
        model = ConvNet(8).train()
    x = torch.zeros(4, 3, 8, 8, device="meta")
    out, grads, plan, _ = _step(model, (x,), plan_of=_plan_at_the_floor)  # 8 channels: split (test_batch_norm.py)
    norms = [n for n in plan.nodes if n.target == "aten.batch_norm.default"]
    assert norms and all(plan.strategy(n.name).inputs[0] == (S(1),) for n in norms)  # channels split
    assert out == DEVICE and grads == {DEVICE}


def test_gpt2_dropout_masks_and_their_backward_stay_on_the_device():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=4, use_cache=False,
                        attn_implementation="eager", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).train()
    ids = torch.zeros(2, 8, dtype=torch.int64, device="meta")
    out, grads, plan, kinds = _step(model, (ids,), pin={"transformer.h.0.mlp.c_fc.weight": "S(1)"})
    assert "ShardedDropout" in kinds, sorted(kinds)  # the masks on shards ran
    assert out == DEVICE and grads == {DEVICE}



# -- generate ----------------------------------------------------------------------------------------

PROMPT = 8  # tokens of each of the 2 prompts
CACHE = PROMPT + DEFAULT_INPUT_CHECKS + 1  # generate's cache: every call below fits it


def _tiny_llama_for_generate():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    with autotp.meta_init():
        return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="class")
def generating():
    """A tiny Llama's parallel module on the fake mesh, attention split by heads, with its cache graphs
    (a prompt's, one token's) traced, planned and its cache pieces allocated for 2 prompts and CACHE
    positions. The traces run before fake mode (``torch.export`` makes fake tensors of its own); the
    pieces are made on the mesh's device there, as on a GPU, and a CPU one would meet the graph's."""
    model = _tiny_llama_for_generate()
    ids = torch.zeros(2, PROMPT, dtype=torch.int64, device=DEVICE)
    pin = {f"model.layers.0.self_attn.{w}_proj.weight": "S(0)" for w in "qkv"}
    with fake_ranks() as mesh:
        plan = autotp.plan(model, (2,), (ids,), hardware="cpu-gloo", mode="inference", pin=pin)
        pm = autotp.parallelize(model, mesh, (ids,), plan=plan)
        graphs = pm._autotp_cache_graphs(2, CACHE, PROMPT)
        yield pm, graphs


def _prompts():
    ids = torch.zeros(2, PROMPT, dtype=torch.int64, device=DEVICE)
    return ids, torch.ones(2, PROMPT, dtype=torch.int64, device=DEVICE)


def _steps(graphs):
    """A list that the decode graph's calls append to."""
    calls = []
    graphs.graphs["token"].register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


class TestATinyLlamaOnTheFakeDevice:
    """generate and autotp.checkpoint over one parallel module (the ``generating`` fixture)."""

    def test_prefill_and_decode_steps_stay_on_the_device(self, generating):
        """Greedy with a mask, the mask inferred by Hugging Face's code, and sampling seeded from the first
        rank: the prompt's graph, every decode step and the loop between them make nothing on the CPU.
        Reads of a value on the host (Hugging Face's checks of the special tokens, the loop's one read,
        the input check's) are answered 0: fake tensors hold no value."""
        pm, graphs = generating
        cache = {n: b for n, b in pm.named_buffers() if n.startswith("autotp_kv_")}
        assert cache and {b.device for b in cache.values()} == {DEVICE}
        assert any(b.shape[1] == 1 for b in cache.values())  # 2 kv heads split over 2 ranks: one each
        ids, mask = _prompts()
        steps = _steps(graphs)
        with fake_tensors(answer=0):
            outs = [pm.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None),
                    pm.generate(ids, max_new_tokens=4, pad_token_id=0, eos_token_id=None),
                    pm.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, top_k=5,
                                eos_token_id=None)]
        assert len(steps) == 3 * 3  # 3 decode steps a call, after the prompt's
        assert [(o.device, tuple(o.shape)) for o in outs] == [(DEVICE, (2, PROMPT + 4))] * 3

    def test_no_host_read_per_decoded_token(self, generating):
        """Past the input check's first calls of the decode graph (``check_inputs``: 8), 6 new tokens make
        the reads and copies to the host that 2 do, in any code (the harness's count: autotp's,
        transformers' processors') and in autotp's (``HostReads``: also tensors made from host values)."""
        pm, graphs = generating
        ids, mask = _prompts()
        seen = {}
        assert pm.autotp_check_inputs == DEFAULT_INPUT_CHECKS
        with fake_tensors(answer=0):
            pm.generate(ids, attention_mask=mask, max_new_tokens=DEFAULT_INPUT_CHECKS + 1)
        for n in (2, 6):
            with fake_tensors(answer=0) as syncs, HostReads() as autotp_reads:
                pm.generate(ids, attention_mask=mask, max_new_tokens=n)
            seen[n] = (syncs.reads, syncs.copies, autotp_reads.reads, autotp_reads.made)
        assert seen[2][0], "the loop's one read at the end of the call: the count sees reads"
        assert seen[6] == seen[2], seen

    def test_the_harness_fails_a_cpu_tensor_made_inside_generate(self, generating, monkeypatch):
        """The pad tokens the loop puts after a finished sequence's end made on the CPU: generate raises.
        (A CPU tensor handed to a graph, such as the mask over the cache, is refused by the graph's own
        input check, naming it.)"""
        import autotp.runtime.generation as generation

        pm, _ = generating
        ids, mask = _prompts()
        monkeypatch.setattr(generation, "torch", _MadeOnTheHost("full_like"))
        with fake_tensors(answer=0), pytest.raises(Exception, match=DEVICE_MISMATCH):
            pm.generate(ids, attention_mask=mask, max_new_tokens=4)

    def test_checkpoint_save_and_load_hand_and_make_tensors_on_the_device(self, generating, monkeypatch):
        """DCP cannot write or read fake tensors (it gathers its plans as objects over the process group),
        so it is stood in for where autotp calls it: every tensor handed to the writer is on the mesh's
        device; the reader writes each given tensor in place, as DCP does, and the module's tensors stay
        there. Neither copies to the host; full_state_dict copies each whole tensor to the host at one place."""
        import autotp.weights.checkpoint as checkpoint

        pm, _ = generating
        dcp = _CheckpointStandIn()
        monkeypatch.setattr(checkpoint, "dcp", dcp)
        with fake_tensors(answer=1) as syncs:
            autotp.checkpoint.save(pm, "unused")
            autotp.checkpoint.load(pm, "unused")
            held = {n: _local(t).device for n, t in pm.state_dict().items()}
            copied = len(syncs.copies)
            full = autotp.checkpoint.full_state_dict(pm)
        assert set(dcp.saved) == set(dcp.loaded) == set(pm.state_dict()) and dcp.sharded
        assert set(dcp.saved.values()) == set(dcp.loaded.values()) == set(held.values()) == {DEVICE}
        assert copied == 0, syncs.copies
        assert set(full) == set(pm.state_dict()) and {t.device.type for t in full.values()} == {"cpu"}
        assert len(syncs.copies) == len(full) and len(set(syncs.copies)) == 1, syncs.copies
        assert syncs.copies[0].startswith("weights/checkpoint.py")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class _CheckpointStandIn:
    """``torch.distributed.checkpoint`` as autotp's checkpoint module calls it: ``save`` records the device
    of each tensor handed to it (of a DTensor, its local piece); ``load`` writes each given tensor's local
    piece in place from the host, as DCP copies a file's values into them."""

    def __init__(self):
        self.saved, self.loaded, self.sharded = {}, {}, False

    def save(self, state, checkpoint_id):
        self.saved = {n: _local(t).device for n, t in state.items()}
        self.sharded = any(hasattr(t, "to_local") and t.to_local().shape != t.shape for t in state.values())

    def load(self, state, checkpoint_id):
        for name, t in state.items():
            _local(t).copy_(torch.zeros(_local(t).shape, dtype=t.dtype))
            self.loaded[name] = _local(t).device


# -- a pipeline stage --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pipelined():
    """A tiny Llama cut in 2 stages (pp 2) under 1F1B, 2 micro-batches: the model on meta, its inputs
    (labels: the loss weighed by valid targets) and the plan."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    with autotp.meta_init():
        model = LlamaForCausalLM(config)
    ids = torch.zeros(4, 8, dtype=torch.int64, device=DEVICE)
    inputs = {"input_ids": ids, "labels": ids}
    layout = {"pp": 2, "tp": 1, "dp": 1, "schedule": "1f1b", "micro_batches": 2}
    return model, inputs, autotp.plan(model, 2, inputs, hardware="cpu-gloo", pipeline=layout)


@pytest.mark.parametrize("rank", [pytest.param(0, marks=pytest.mark.slow), 1])  # the last stage by default
def test_a_pipeline_stage_s_step_and_forward_stay_on_the_device(pipelined, rank):
    """Rank 0 runs the first stage (forward, sends, receives gradients, backward), rank 1 the last
    (receives, forward, the weighed loss, backward, sends), each a training step and a forward. The fake
    process group answers every send and receive at once (a received tensor holds no value, as every fake
    tensor); the schedule's warm-up vote reads a value on the host, answered 1 (static shapes, as every
    rank votes)."""
    model, inputs, plan = pipelined
    with fake_ranks(names=("pp", "tp"), shape=(2, 1), rank=rank) as mesh:
        pm = autotp.parallelize(model, mesh, inputs, plan=plan)
        with fake_tensors(answer=1) as syncs:
            loss = pm.step(**inputs)
            out = pm(**inputs)
            grads = {p.grad.device for p in pm.parameters()}
    assert pm.stage_indices == (rank,) and grads == {DEVICE}
    assert (loss is None and out is None) if rank == 0 else (loss.device == out.logits.device == DEVICE)
    assert syncs.copies == [], syncs.copies
