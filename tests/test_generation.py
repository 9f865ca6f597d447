"""Greedy decoding paths against HF's own eager generate, for every HF MoE family the backend recognises (float32,
CPU): moecompile.generate (the compiled decode step; its CUDA graph is tested in test_gpu_generation.py), left-padded
prompts, and HF's generate with the "moecompile" experts implementation."""
import pytest
import torch
from hf_moe import FAMILIES, tiny_moe, token_ids

from moecompile.errors import MoECompileError
from moecompile.generation import Generator, _stop_at_eos, generate, greedy_token, static_cache

NEW = 5
NO_EOS = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def _hf_greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=NEW, **NO_EOS, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decode_step_matches_hf(family):
    model = tiny_moe(family)
    model.generation_config.eos_token_id = None
    ids = token_ids(batch=2, length=6)
    expected = _hf_greedy(model, ids)
    # aot_eager: the moecompile passes and ops without inductor's code generation (inductor is tested elsewhere)
    got = generate(model, ids, NEW, options={"inductor": False})
    assert torch.equal(got, expected)
    again = generate(model, ids, NEW, options={"inductor": False})  # the kept Generator, its cache reset
    assert torch.equal(again, expected)


@pytest.mark.parametrize("family", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_decode_step_on_direct_experts_matches_hf(family, monkeypatch):
    """The decode step with its experts on routed_experts (direct_experts, made to take these few experts) and the
    per-token sum in the graph: HF's greedy tokens."""
    from moecompile import backend
    from moecompile.passes import direct_experts

    monkeypatch.setattr(direct_experts, "MAX_ASSIGNMENTS_PER_EXPERT", 1.0)
    model = tiny_moe(family)
    model.generation_config.eos_token_id = None
    ids = token_ids(batch=2, length=6)
    backend.clear_records()
    got = generate(model, ids, NEW, options={"inductor": False})
    step = dict(backend.records()[-1].reports)  # the decode step's graph: prefill's 12 tokens stay sorted
    assert step["direct_experts"]["direct"], step["direct_experts"]
    assert torch.equal(got, _hf_greedy(model, ids))


@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_matrix_vector_decode_only_at_one_token(family):
    """decode_matvec decides on the graph: the batch-1 decode step (its linears read one row, but DeepSeek-V3's
    kv_b_proj, which reads the cache) is compiled with matrix-vector reductions; its prefill (a 6-token prompt), a
    batch-2 step and the option turned off are not."""
    from moecompile import backend

    model = tiny_moe(family)
    model.generation_config.eos_token_id = None
    for batch, options, step_matvec in [(1, {}, True), (2, {}, False), (1, {"decode_matvec": False}, False)]:
        backend.clear_records()
        generate(model, token_ids(batch=batch, length=6), 2, options={"inductor": False, **options})
        prefill, step = backend.records()
        assert prefill.matvec_linears == 0
        assert (step.matvec_linears > 0) == step_matvec, (batch, options)


@pytest.mark.parametrize("family", ["tiny-mixtral", "tiny-gpt-oss"])
def test_left_padded_prompts_match_hf(family):
    model = tiny_moe(family)
    ids = token_ids(batch=3, length=7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    expected = _hf_greedy(model, ids, attention_mask=mask)
    assert torch.equal(Generator(model, 3, 7 + NEW, compile=False)(ids, NEW, attention_mask=mask), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_generate_with_moecompile_experts_matches_hf(family):
    model = tiny_moe(family)
    ids = token_ids(batch=1, length=5)
    expected = _hf_greedy(model, ids)
    model.set_experts_implementation("moecompile")
    assert torch.equal(_hf_greedy(model, ids), expected)


def test_full_length_cache_in_hf_generate_keeps_the_sliding_window():
    model = tiny_moe("tiny-gpt-oss")  # sliding window 16 < prompt + new tokens: the window matters
    ids = token_ids(batch=2, length=14)
    cache = static_cache(model, 14 + NEW)
    assert not any(getattr(layer, "is_sliding", False) for layer in cache.layers)
    assert torch.equal(_hf_greedy(model, ids, past_key_values=cache), _hf_greedy(model, ids))


@pytest.mark.parametrize("vocab", [5, 1024, 1025, 32000, 151936])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_token_is_argmax(vocab, batch):
    """The two-stage choice equals argmax, ties (the first maximum wins) and NaN (chosen, as argmax does) included."""
    g = torch.Generator().manual_seed(vocab + batch)
    logits = torch.randn(batch, vocab, generator=g).to(torch.bfloat16).round().float()  # many exact ties
    assert torch.equal(greedy_token(logits), logits.argmax(-1, keepdim=True))
    logits[:, vocab - 1] = logits.max() + 1
    logits[0, vocab // 2] = float("nan")
    assert torch.equal(greedy_token(logits), logits.argmax(-1, keepdim=True))
    assert torch.equal(greedy_token(torch.full((batch, vocab), float("-inf"))), torch.zeros(batch, 1, dtype=torch.long))


def test_stop_at_eos_pads_like_hf():
    tokens = torch.tensor([[9, 9, 3, 2, 4, 2], [9, 9, 2, 5, 6, 7], [9, 9, 5, 6, 2, 8]])
    got = _stop_at_eos(tokens, 2, eos_token_id=[2, 7], pad_token_id=0)
    # ends at the step where the last row ends; after its first end-of-sequence token a row holds the pad token
    assert torch.equal(got, torch.tensor([[9, 9, 3, 2, 0], [9, 9, 2, 0, 0], [9, 9, 5, 6, 2]]))
    assert torch.equal(_stop_at_eos(tokens, 2, None, None), tokens)


def test_bad_arguments_are_one_line_errors():
    model = tiny_moe("tiny-mixtral")
    with pytest.raises(MoECompileError, match="max_length"):
        Generator(model, 1, 1, compile=False)
    gen = Generator(model, 1, 8, compile=False)
    with pytest.raises(MoECompileError, match="max_new_tokens"):
        gen(token_ids(batch=1, length=6), 3)
    with pytest.raises(MoECompileError, match="prompts"):
        gen(token_ids(batch=2, length=4), 2)
    with pytest.raises(MoECompileError, match="CUDA"):
        Generator(model, 1, 8, compile=False, cuda_graph=True)
    with pytest.raises(MoECompileError, match="unknown moecompile option"):
        Generator(model, 1, 8, options={"nonsense": 1})
