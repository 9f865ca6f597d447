"""Absorbed DeepSeek-V3 latent attention in moecompile's generation (moecompile/integrations/mla.py) against HF's own
eager generate and forward (float32, CPU): greedy tokens with a left-padded prompt, the first step's logits, eager
and compiled, the latent cache the step reads, long prompts on HF's forward, and absorption turned off."""
import types

import pytest
import torch
import transformers
from hf_moe import tiny_moe, token_ids
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from moecompile import backend
from moecompile.core.errors import MoECompileError
from moecompile.generation import Generator, generate
from moecompile.integrations import mla

NEW = 5


def _variant():
    """tiny-deepseek-v3 with a query LoRA, YaRN rope scaling (its softmax mscale) and non-interleaved rope."""
    base = tiny_moe("tiny-deepseek-v3").config.to_dict()
    config = transformers.DeepseekV3Config.from_dict({
        **base, "q_lora_rank": 16, "rope_interleave": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0}})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    assert model.model.layers[0].self_attn.scaling != model.model.layers[0].self_attn.qk_head_dim ** -0.5
    return model


def _model(which: str):
    model = tiny_moe("tiny-deepseek-v3") if which == "tiny" else _variant()
    model.generation_config.eos_token_id = None
    return model


def _prompt():
    ids = token_ids(batch=2, length=7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def _hf(model, ids, mask):
    """HF's greedy tokens and the prompt's last logits, HF's own attention and cache."""
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits[:, -1]
    return tokens, logits


@pytest.mark.parametrize("which, compiled", [("tiny", False), ("variant", False), ("variant", True)])
def test_absorbed_tokens_and_first_logits_match_hf(which, compiled):
    model = _model(which)
    ids, mask = _prompt()
    expected, logits = _hf(model, ids, mask)
    gen = Generator(model, 2, 7 + NEW, compile=compiled, options={"inductor": False})
    assert len(gen.absorbed) == model.config.num_hidden_layers
    assert torch.equal(gen(ids, NEW, attention_mask=mask), expected)
    assert (gen.prefill_logits - logits).abs().max() <= 1e-4 * logits.abs().max()
    # HF's forward is back once the Generator's calls return
    assert all("forward" not in vars(m) for m in mla.mla_attentions(model))
    if compiled:  # a second call compiles nothing: each swapped-in forward is the same object (Dynamo guards on it)
        backend.clear_records()
        assert torch.equal(gen(ids, NEW, attention_mask=mask), expected)
        assert not backend.records()


def test_absorbed_forward_looks_nothing_up_in_transformers(monkeypatch):
    """The swapped forward has its RoPE function already: an import of transformers' lazy modules inside traced code
    breaks torch 2.11's Dynamo ("Bad import result"), so the forward must not reach mla._hf_module."""
    model = _model("variant")
    ids, mask = _prompt()
    attentions = mla.mla_attentions(model)
    with mla.absorbed(attentions):
        monkeypatch.setattr(mla, "_hf_module", lambda: pytest.fail("transformers looked up inside the forward"))
        with torch.no_grad():
            absorbed = model(ids[:, -1:]).logits
    with torch.no_grad():
        assert torch.allclose(absorbed, model(ids[:, -1:]).logits, rtol=1e-4, atol=1e-5)


def test_generate_takes_absorb_mla_and_off_is_hf_attention(monkeypatch):
    """The decode step reads the latent cache (kv_lora_rank and the rope key per token, one "head") through the
    absorbed forward, never HF's attention; absorb_mla=False calls HF's attention and gives the same tokens."""
    calls = []
    hf_forward = DeepseekV3Attention.forward

    def counted(self, *args, **kwargs):
        calls.append(self.layer_idx)
        return hf_forward(self, *args, **kwargs)

    monkeypatch.setattr(DeepseekV3Attention, "forward", counted)
    model = _model("tiny")
    ids, mask = _prompt()
    expected, _ = _hf(model, ids, mask)
    calls.clear()
    gen = Generator(model, 2, 7 + NEW, compile=False)
    gen.prefill(ids, mask)
    gen.decode(NEW - 1)
    assert calls == [] and torch.equal(gen.out, expected)
    config = model.config
    for layer in gen.cache.layers:
        assert layer.keys.shape == (2, 1, 7 + NEW, config.kv_lora_rank)
        assert layer.values.shape == (2, 1, 7 + NEW, config.qk_rope_head_dim)
    off = generate(model, ids, NEW, attention_mask=mask, compile=False, absorb_mla=False)
    assert torch.equal(off, expected)
    assert len(calls) == (NEW + 1) * config.num_hidden_layers  # the cache's first eager token, prompt, steps


def test_long_prompt_runs_hf_forward_then_absorbed_steps(monkeypatch):
    """A prompt past the break-even length goes through HF's forward (cheaper expanded); the steps after it read
    what it cached, absorbed."""
    calls = []
    hf_forward = DeepseekV3Attention.forward

    def counted(self, hidden_states, *args, **kwargs):
        calls.append(hidden_states.shape[1])
        return hf_forward(self, hidden_states, *args, **kwargs)

    model = _model("tiny")
    attention = model.model.layers[0].self_attn
    length = next(t for t in range(1, 64) if not mla.absorbs(attention, t))
    ids = token_ids(batch=1, length=length)
    expected = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    monkeypatch.setattr(DeepseekV3Attention, "forward", counted)
    got = generate(model, ids, NEW, compile=False)
    assert torch.equal(got, expected)
    assert calls == [length] * model.config.num_hidden_layers


def test_break_even_and_the_default_in_one_place():
    real = types.SimpleNamespace(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    # per head and cached token: t * (2 * 512 + 64) against 512 * 256 + t * 320
    assert mla.absorbs(real, 1) and mla.absorbs(real, 170) and not mla.absorbs(real, 171)
    mixtral = tiny_moe("tiny-mixtral")
    assert mla.resolve(mixtral, None) == [] and mla.resolve(_model("tiny"), False) == []
    with pytest.raises(MoECompileError, match="absorb_mla=True"):
        mla.resolve(mixtral, True)
