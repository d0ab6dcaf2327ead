"""The reference models in examples/models.py: shapes, export, parameter counts, and
agreement with the Hugging Face implementations they imitate (weights copied across)."""

import time

import pytest
import torch
import torch.nn as nn

from examples import models as M

SMALL = ["mlp", "tiny_gpt", "tiny_llama", "tiny_bert", "hf_llama", "hf_gpt2", "hf_bert"]
OWN_SMALL = ["mlp", "tiny_gpt", "tiny_llama", "tiny_bert"]


def _first_tensor(out):
    return out if isinstance(out, torch.Tensor) else out[0]  # HF ModelOutput -> logits / hidden


@pytest.mark.parametrize("factory, shape", [
    ("mlp", (8, 64)),
    ("tiny_gpt", (2, 16, 128)),
    ("tiny_llama", (2, 16, 128)),
    ("tiny_bert", (2, 16, 64)),
    ("hf_llama", (2, 16, 128)),
    ("hf_gpt2", (2, 16, 128)),
    ("hf_bert", (2, 16, 64)),
])
def test_forward_shape_on_cpu(factory, shape):
    model, inputs = getattr(M, factory)()
    out = _first_tensor(model(*inputs))
    assert out.shape == shape
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("factory", SMALL)
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_exports_non_strict(factory, device):
    model, inputs = getattr(M, factory)(device=device)
    ep = torch.export.export(model, inputs, strict=False)
    assert any(n.target == torch.ops.aten.linear.default or n.target == torch.ops.aten.addmm.default
               for n in ep.graph.nodes if n.op == "call_function")
    out = _first_tensor(ep.module()(*inputs))
    if device == "cpu" and factory in OWN_SMALL:
        torch.testing.assert_close(out, model(*inputs))


@pytest.mark.parametrize("factory", OWN_SMALL + ["hf_llama", "hf_gpt2", "hf_bert"])
def test_seed_gives_identical_weights_and_inputs(factory):
    m1, in1 = getattr(M, factory)(seed=3)
    m2, in2 = getattr(M, factory)(seed=3)
    m3, _ = getattr(M, factory)(seed=4)
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n
    torch.testing.assert_close(in1, in2, rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(m1.parameters(), m3.parameters()))


def test_dtype_argument():
    model, (ids,) = M.tiny_llama(dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert ids.dtype == torch.int64
    assert model(ids).dtype == torch.bfloat16


def test_gpt_lm_head_is_tied_to_embedding():
    model, _ = M.tiny_gpt()
    assert model.lm_head.weight is model.embed_tokens.weight
    model, _ = M.gpt2_small()
    assert model.lm_head.weight is model.embed_tokens.weight


def test_gpt2_small_parameter_count():
    model, (ids,) = M.gpt2_small()
    assert ids.shape == (1, 1024) and ids.device.type == "meta"
    V, C, L, T, F = 50304, 768, 12, 1024, 4 * 768
    per_layer = (2 * C) + 4 * (C * C + C) + (2 * C) + (C * F + F) + (F * C + C)
    expected = V * C + T * C + L * per_layer + 2 * C  # lm_head tied: counted once
    n = sum(p.numel() for p in model.parameters())
    assert n == expected
    assert abs(n - 124.44e6) / 124.44e6 < 0.01  # GPT-2 small, 124M (vocab 50257)


def test_llama3_8b_parameter_count():
    model, (ids,) = M.llama3_8b()
    assert ids.shape == (1, 2048)
    V, C, L, F, H, KV = 128256, 4096, 32, 14336, 32, 8
    hd = C // H
    per_layer = C * H * hd + 2 * C * KV * hd + H * hd * C + 3 * C * F + 2 * C
    expected = 2 * V * C + L * per_layer + C  # untied lm_head
    n = sum(p.numel() for p in model.parameters())
    assert n == expected
    assert abs(n - 8.03e9) / 8.03e9 < 0.01  # Llama 3 8B: 8,030,261,248


def test_llama3_70b_builds_instantly_on_meta():
    t0 = time.perf_counter()
    model, (ids,) = M.llama3_70b()
    assert time.perf_counter() - t0 < 10
    assert all(p.is_meta for p in model.parameters())
    assert ids.is_meta and ids.shape == (1, 2048)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 70.55e9) / 70.55e9 < 0.01  # Llama 3 70B: 70,553,706,496


def test_hf_llama_overrides_build_on_meta():
    model, (ids,) = M.hf_llama(n_layer=1, hidden=4096, ffn=14336, heads=32, kv_heads=8,
                                vocab=128256, seq=2048, batch=1, device="meta")
    assert ids.shape == (1, 2048) and ids.is_meta
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (1024, 4096)
    assert all(p.is_meta for p in model.parameters())


# ---- same function as the Hugging Face model it imitates, with its weights copied across

def test_llama_matches_hf_llama():
    ours, (ids,) = M.tiny_llama()
    hf, _ = M.hf_llama()
    sd = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v
          for k, v in ours.state_dict().items()}
    hf.load_state_dict(sd, strict=True)
    torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_gpt_matches_hf_gpt2():
    ours, (ids,) = M.tiny_gpt()
    hf, _ = M.hf_gpt2()
    for blk in hf.transformer.h:
        blk.mlp.act = nn.GELU()  # ours is exact GELU (as nanoGPT); GPT-2 uses the tanh form
    s = ours.state_dict()
    sd = {"transformer.wte.weight": s["embed_tokens.weight"],
          "transformer.wpe.weight": hf.state_dict()["transformer.wpe.weight"].clone(),
          "transformer.ln_f.weight": s["norm.weight"], "transformer.ln_f.bias": s["norm.bias"],
          "lm_head.weight": s["lm_head.weight"]}
    sd["transformer.wpe.weight"][:16] = s["embed_positions.weight"]
    for i in range(2):
        o, h = f"layers.{i}.", f"transformer.h.{i}."
        a = o + "self_attn."
        sd[h + "ln_1.weight"], sd[h + "ln_1.bias"] = s[o + "input_layernorm.weight"], s[o + "input_layernorm.bias"]
        sd[h + "ln_2.weight"] = s[o + "post_attention_layernorm.weight"]
        sd[h + "ln_2.bias"] = s[o + "post_attention_layernorm.bias"]
        # Conv1D keeps weights as (in, out): transpose ours
        sd[h + "attn.c_attn.weight"] = torch.cat([s[a + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")]).T
        sd[h + "attn.c_attn.bias"] = torch.cat([s[a + p + ".bias"] for p in ("q_proj", "k_proj", "v_proj")])
        sd[h + "attn.c_proj.weight"], sd[h + "attn.c_proj.bias"] = s[a + "o_proj.weight"].T, s[a + "o_proj.bias"]
        sd[h + "mlp.c_fc.weight"], sd[h + "mlp.c_fc.bias"] = s[o + "mlp.up_proj.weight"].T, s[o + "mlp.up_proj.bias"]
        sd[h + "mlp.c_proj.weight"] = s[o + "mlp.down_proj.weight"].T
        sd[h + "mlp.c_proj.bias"] = s[o + "mlp.down_proj.bias"]
    hf.load_state_dict(sd, strict=True)
    torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_bert_matches_hf_bert():
    ours, (ids,) = M.tiny_bert()
    hf, _ = M.hf_bert()
    s, sd = ours.state_dict(), {}
    e = "embeddings."
    sd[e + "word_embeddings.weight"] = s["embed_tokens.weight"]
    sd[e + "position_embeddings.weight"] = hf.state_dict()[e + "position_embeddings.weight"].clone()
    sd[e + "position_embeddings.weight"][:16] = s["embed_positions.weight"]
    sd[e + "token_type_embeddings.weight"] = torch.zeros(2, 64)  # ours has no token types
    sd[e + "LayerNorm.weight"], sd[e + "LayerNorm.bias"] = s["embed_layernorm.weight"], s["embed_layernorm.bias"]
    names = {"self_attn.q_proj": "attention.self.query", "self_attn.k_proj": "attention.self.key",
             "self_attn.v_proj": "attention.self.value", "self_attn.o_proj": "attention.output.dense",
             "attn_layernorm": "attention.output.LayerNorm", "mlp.up_proj": "intermediate.dense",
             "mlp.down_proj": "output.dense", "mlp_layernorm": "output.LayerNorm"}
    for i in range(2):
        for ours_name, hf_name in names.items():
            for p in ("weight", "bias"):
                sd[f"encoder.layer.{i}.{hf_name}.{p}"] = s[f"layers.{i}.{ours_name}.{p}"]
    hf.load_state_dict(sd, strict=True)
    torch.testing.assert_close(ours(ids), hf(ids).last_hidden_state, rtol=1e-5, atol=1e-5)
