"""Decoding paths against HF's own eager generate, for every HF MoE family the backend recognises (float32, CPU):
moecompile.generate (the compiled decode step; its CUDA graph is tested in test_gpu_generation.py), left-padded
prompts, HF's generate with the "moecompile" experts implementation; sampling with a seed, the end of sequence, the
streamer and HF's GenerationConfig (the sampling function itself: test_sampling.py)."""
import pytest
import torch
from hf_moe import FAMILIES, tiny_moe, token_ids
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from moecompile.core.errors import MoECompileError
from moecompile.generation import Generator, custom_generate, generate, greedy_token, static_cache

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
    model = tiny_moe(family, one_layer=True)
    model.generation_config.eos_token_id = None
    ids = token_ids(batch=2, length=6)
    backend.clear_records()
    got = generate(model, ids, NEW, options={"inductor": False})
    step = dict(backend.records()[-1].reports)  # the decode step's graph: prefill's 12 tokens stay sorted
    assert step["direct_experts"]["direct"], step["direct_experts"]
    assert torch.equal(got, _hf_greedy(model, ids))


@pytest.mark.parametrize("family,cases", [
    ("tiny-qwen3-moe", [(1, {}, True), (2, {}, False), (1, {"decode_matvec": False}, False)]),
    ("tiny-deepseek-v3", [(1, {}, True)])])  # (the batch and option cases are the same decision for every family)
def test_matrix_vector_decode_only_at_one_token(family, cases):
    """decode_matvec decides on the graph: the batch-1 decode step (its linears read one row, but DeepSeek-V3's
    kv_b_proj, which reads the cache) is compiled with matrix-vector reductions; its prefill (a 6-token prompt), a
    batch-2 step and the option turned off are not."""
    from moecompile import backend

    model = tiny_moe(family, one_layer=True)
    model.generation_config.eos_token_id = None
    for batch, options, step_matvec in cases:
        backend.clear_records()
        generate(model, token_ids(batch=batch, length=6), 2, options={"inductor": False, **options})
        prefill, step = backend.records()
        assert prefill.matvec_linears == 0
        assert (step.matvec_linears > 0) == step_matvec, (batch, options)


@pytest.mark.parametrize("setting, prefill_pdl, step_pdl", [("auto", False, True), ("on", True, True),
                                                             ("off", False, False)])
def test_programmatic_launch_setting_picks_the_graphs_inductor_compiles_with_it(setting, prefill_pdl, step_pdl,
                                                                                monkeypatch):
    """MOECOMPILE_PDL decides which graphs inductor compiles with programmatic dependent launches (inductor's
    triton.enable_pdl, which takes effect on a GPU that has them): auto the batch-1 decode step only, on every graph,
    off none. compile_fx is replaced by AOT autograd here, so nothing is generated for the CPU."""
    import torch._inductor.compile_fx as inductor
    from torch._dynamo.backends.debugging import aot_eager

    from moecompile.runtime import choices

    if not hasattr(torch._inductor.config.triton, "enable_pdl"):
        pytest.skip("this torch's inductor has no programmatic dependent launches")
    patches = []

    def compile_fx(gm, inputs, config_patches=None):
        patches.append(config_patches or {})
        return aot_eager(gm, inputs)

    monkeypatch.setattr(inductor, "compile_fx", compile_fx)
    monkeypatch.setattr(choices, "PROGRAMMATIC_LAUNCH", setting)
    model = tiny_moe("tiny-qwen3-moe", one_layer=True)
    model.generation_config.eos_token_id = None
    generate(model, token_ids(batch=1, length=6), 2)
    assert [p.get("triton.enable_pdl", False) for p in patches] == [prefill_pdl, step_pdl]


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


def test_greedy_settings_and_one_candidate_sampling_give_hf_greedy():
    """Temperature 0, do_sample off (whatever the temperature) and sampling from one candidate (top_k=1) all give
    HF's greedy tokens."""
    model = tiny_moe("tiny-qwen3-moe")
    model.generation_config.eos_token_id = None
    ids = token_ids(batch=2, length=6)
    expected = _hf_greedy(model, ids)
    for settings in [dict(do_sample=True, temperature=0.0), dict(do_sample=False, temperature=0.7),
                     dict(do_sample=True, top_k=1, seed=5)]:
        assert torch.equal(generate(model, ids, NEW, compile=False, **settings), expected), settings


def test_a_seed_reproduces_sampled_tokens():
    """The compiled step (its end-of-sequence padding included) samples the tokens the eager step samples with the
    same seed; another seed gives other tokens; without a seed, torch.manual_seed makes the call reproducible."""
    model = tiny_moe("tiny-mixtral", one_layer=True)
    ids = token_ids(batch=2, length=6)
    sample = dict(do_sample=True, temperature=1.5, top_p=0.95, min_p=0.01, eos_token_id=[1, 2], pad_token_id=0)
    compiled = generate(model, ids, 8, seed=7, options={"inductor": False}, **sample)
    assert torch.equal(generate(model, ids, 8, seed=7, options={"inductor": False}, **sample), compiled)
    assert torch.equal(generate(model, ids, 8, seed=7, compile=False, **sample), compiled)
    assert not torch.equal(generate(model, ids, 8, seed=8, compile=False, **sample), compiled)
    assert not torch.equal(compiled, model.generate(ids, max_new_tokens=8, **NO_EOS)[:, :compiled.shape[1]])
    torch.manual_seed(0)
    unseeded = generate(model, ids, 8, compile=False, **sample)
    torch.manual_seed(0)
    assert torch.equal(generate(model, ids, 8, compile=False, **sample), unseeded)


def _eos_for_early_end(model, ids, new):
    """End-of-sequence ids that end every row before `new` tokens: a token each row gives in its greedy output."""
    greedy = model.generate(ids, max_new_tokens=new, **NO_EOS)[:, ids.shape[1]:]
    return sorted({int(greedy[row, min(row + 1, new - 2)]) for row in range(ids.shape[0])})


@pytest.mark.parametrize("read_every", [2, 16])
def test_end_of_sequence_pads_rows_and_ends_like_hf(read_every):
    model = tiny_moe("tiny-mixtral")
    ids = token_ids(batch=3, length=6)
    eos = _eos_for_early_end(model, ids, 10)
    expected = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert expected.shape[1] < 6 + 10 and (expected == 0).any()  # every row ended early; some give the pad
    got = generate(model, ids, 10, compile=False, eos_token_id=eos, pad_token_id=0, read_every=read_every)
    assert torch.equal(got, expected)


class Recorder(BaseStreamer):
    def __init__(self):
        self.blocks, self.ended = [], 0

    def put(self, value):
        self.blocks.append(value.clone())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("eos", [True, False])
def test_streamer_gets_the_prompt_then_exactly_the_new_tokens(eos):
    """Sampled, stopping at the end of sequence or not: the streamer receives the prompt, then the new tokens in
    blocks of at most read_every, then end() once; no block holds a token past the returned output."""
    model = tiny_moe("tiny-mixtral")
    ids = token_ids(batch=3, length=6)
    settings = dict(eos_token_id=_eos_for_early_end(model, ids, 10), pad_token_id=0) if eos else \
        dict(eos_token_id=None)
    streamer = Recorder()
    got = generate(model, ids, 10, streamer=streamer, read_every=3, do_sample=True, top_k=4, seed=1, compile=False,
                   **settings)
    assert streamer.ended == 1 and torch.equal(streamer.blocks[0], ids)
    assert all(block.shape[0] == 3 and 1 <= block.shape[1] <= 3 for block in streamer.blocks[1:])
    assert torch.equal(torch.cat(streamer.blocks[1:], 1), got[:, 6:])
    assert got.shape[1] == 6 + 10 or eos


def test_generation_config_and_overrides_like_hf():
    """HF's GenerationConfig (length, greedy, end of sequence, pad) gives HF's tokens; keyword overrides win over
    it; the model's generation_config fills what it leaves unset, as in HF (max_length 20 by default)."""
    model = tiny_moe("tiny-qwen3-moe")
    ids = token_ids(batch=2, length=6)
    config = GenerationConfig(max_new_tokens=7, do_sample=False, eos_token_id=_eos_for_early_end(model, ids, 7),
                              pad_token_id=3)
    assert torch.equal(generate(model, ids, generation_config=config, compile=False),
                       model.generate(ids, generation_config=config))
    assert generate(model, ids, generation_config=config, compile=False, max_new_tokens=1,
                    eos_token_id=None).shape == (2, 7)
    model.generation_config.eos_token_id = None
    assert generate(model, ids, compile=False).shape == (2, 20)


@pytest.mark.parametrize("settings", [dict(num_beams=2), dict(repetition_penalty=1.2), dict(num_return_sequences=2),
                                      dict(generation_config=GenerationConfig(no_repeat_ngram_size=2)),
                                      dict(stop_strings=["x"]), dict(return_dict_in_generate=True),
                                      dict(nonsense=1), dict(do_sample=True, top_p=0.0), dict(max_new_tokens=0)])
def test_unsupported_generation_settings_are_one_line_errors(settings):
    model = tiny_moe("tiny-mixtral")
    with pytest.raises(MoECompileError) as error:
        generate(model, token_ids(batch=1, length=4), compile=False, **settings)
    assert "\n" not in str(error.value)


def test_the_models_own_unsupported_settings_are_refused():
    model = tiny_moe("tiny-mixtral")
    model.generation_config.repetition_penalty = 1.1
    with pytest.raises(MoECompileError, match="repetition_penalty=1.1"):
        generate(model, token_ids(batch=1, length=4), 2, compile=False)
    assert generate(model, token_ids(batch=1, length=4), 2, compile=False, repetition_penalty=1.0).shape == (1, 6)


def test_hf_generate_reaches_the_loop_through_custom_generate():
    """model.generate(..., custom_generate=custom_generate): HF's greedy tokens for left-padded prompts, the tokens
    of moecompile.generate with the same seed when sampling (seed and compile pass through HF's keywords); a
    logits processor of the caller's, which the step does not implement, is refused."""
    from transformers import InfNanRemoveLogitsProcessor, LogitsProcessorList

    model = tiny_moe("tiny-mixtral")
    ids = token_ids(batch=2, length=6)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    assert torch.equal(model.generate(ids, attention_mask=mask, custom_generate=custom_generate, compile=False,
                                      max_new_tokens=NEW, **NO_EOS),
                       model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **NO_EOS))
    sample = dict(max_new_tokens=NEW, do_sample=True, top_k=4, seed=3, compile=False)
    assert torch.equal(model.generate(ids, custom_generate=custom_generate, **sample),
                       generate(model, ids, **sample))
    with pytest.raises(MoECompileError, match="InfNanRemoveLogitsProcessor"):
        model.generate(ids, custom_generate=custom_generate, compile=False, max_new_tokens=NEW,
                       logits_processor=LogitsProcessorList([InfNanRemoveLogitsProcessor()]))


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
