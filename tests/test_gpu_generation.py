"""Decoding on CUDA (marker gpu: run on the device with `pytest -m gpu`): CUDA-graph capture of the MoE layer at one
token (the Mixtral batch-1 capture bug), moecompile.generate's captured decode step against HF eager, sampling and
the end of sequence under CUDA-graph replay, and HF's own generate with the moecompile backend under
reduce-overhead, for every HF MoE family at batch 1 and 16."""
import dataclasses

import pytest
import torch
from hf_moe import FAMILIES, tiny_moe, token_ids

from moecompile import MoEBlock, MoEConfig
from moecompile.generation import Generator, Sampling
from moecompile.runtime import graphs

pytestmark = pytest.mark.gpu
NEW = 6


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (1, 4), (3, 2)])
def test_moe_layer_captures_with_few_rows(dtype, tokens, top_k):
    """One decoded token at top-2 is 2 expert rows: it used to leave torch._grouped_mm for the reference kernel,
    whose host read of the group bounds failed under CUDA-graph capture (float32 still takes the reference)."""
    torch.manual_seed(0)
    block = MoEBlock(MoEConfig(hidden_size=64, expert_size=96, num_experts=8, top_k=top_k, capacity_factor=0.0,
                               activation="silu", gated=True)).to("cuda", dtype).eval()
    x = torch.randn(tokens, 64, device="cuda", dtype=dtype)
    with torch.no_grad():
        expected = block(x)
        static_x = torch.zeros_like(x)
        graph, out = graphs.capture(lambda: block(static_x))
        static_x.copy_(x)
        graph.replay()
    torch.testing.assert_close(out, expected, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def _model(family, dtype):
    model = tiny_moe(family).to("cuda", dtype)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 16])
def test_generate_cuda_graph(family, batch):
    """The captured decode step gives the tokens of the same compiled step run uncaptured; the compiled prompt's
    logits (bf16) are those of HF eager in float32, and so is the first new token wherever float32's choice is not
    a near-tie. Float32 is the reference because HF eager's own bf16 logits are further from it than ours on these
    random tiny models (cosine 0.996 at batch 16), enough to flip a near-tie. aot_eager: the moecompile passes and
    CUDA kernels without inductor's compile time."""
    reference = tiny_moe(family).to("cuda").eval()
    ids = token_ids(batch=batch, length=7).cuda()
    with torch.no_grad():
        want = reference(ids).logits[:, -1]
    model = _model(family, torch.bfloat16)
    gen = Generator(model, batch, 7 + NEW, options={"inductor": False})
    graphed = gen(ids, NEW)
    assert _cos(gen.prefill_logits, want) > 0.9999
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1e-2
    assert torch.equal(graphed[:, :7], ids)
    assert torch.equal(graphed[clear, 7], want.argmax(-1)[clear])
    gen.cuda_graph = False
    assert torch.equal(gen(ids, NEW), graphed)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_sampling_with_a_seed_reproduces_under_cuda_graph_replay(family, batch):
    """The sampled decode step captured with its generator: the call that captures (warm-up steps, then replays),
    a call of replays only and the same step uncaptured give the same tokens for one seed, so every replay draws
    the noise the uncaptured step draws (a generator the graph did not advance would repeat one draw); another seed
    gives other tokens. Then the end of sequence: rows give the pad token after it, and the output is the
    uncaptured one (rows that end change the others' batch, so which row ends where is not asserted)."""
    model = _model(family, torch.bfloat16)
    ids = token_ids(batch=batch, length=7).cuda()
    gen = Generator(model, batch, 7 + NEW, options={"inductor": False})
    sampling = Sampling(temperature=1.3, top_k=20, top_p=0.95, min_p=0.02, seed=11)
    captured = gen(ids, NEW, sampling=sampling)
    assert len(gen._graphs) == 1
    assert torch.equal(gen(ids, NEW, sampling=sampling), captured)
    gen.cuda_graph = False
    assert torch.equal(gen(ids, NEW, sampling=sampling), captured)
    gen.cuda_graph = True
    assert not torch.equal(gen(ids, NEW, sampling=dataclasses.replace(sampling, seed=12)), captured)
    eos = sorted(set(captured[:, 7 + NEW // 2].tolist()))  # most rows end by the middle
    pad = min(set(range(len(eos) + 1)) - set(eos))
    ended = gen(ids, NEW, sampling=sampling, eos_token_id=eos, pad_token_id=pad, read_every=2)
    assert len(gen._graphs) == 2
    new = ended[:, 7:]
    is_eos = torch.isin(new, torch.tensor(eos, device=new.device))
    after = (is_eos.cumsum(-1) - is_eos.long()) > 0
    assert is_eos.any() and (new[after] == pad).all()
    gen.cuda_graph = False
    assert torch.equal(gen(ids, NEW, sampling=sampling, eos_token_id=eos, pad_token_id=pad), ended)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 16])
def test_hf_generate_with_backend_reduce_overhead(family, batch):
    from transformers import CompileConfig, GenerationConfig

    model = _model(family, torch.bfloat16)
    ids = token_ids(batch=batch, length=7).cuda()
    eager = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_logits=True,
                           return_dict_in_generate=True)
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=0, cache_implementation="static",
                              compile_config=CompileConfig(backend="moecompile", mode="reduce-overhead",
                                                           fullgraph=True))
    torch._dynamo.reset()
    out = model.generate(ids, generation_config=config, output_logits=True, return_dict_in_generate=True)
    assert out.sequences.shape == eager.sequences.shape
    # HF runs the prompt eagerly: the first compiled step is the second, and it reads the same first token
    assert torch.equal(out.sequences[:, 7], eager.sequences[:, 7])
    assert _cos(out.logits[1], eager.logits[1]) > 0.999


@pytest.mark.parametrize("tokens,takes_hf", [(1, True), (64, False)])
def test_eager_experts_integration_takes_hf_for_small_batches(monkeypatch, tokens, takes_hf):
    from moecompile.runtime import choices

    decisions = []
    prefers = choices.eager_prefers_hf
    monkeypatch.setattr(choices, "eager_prefers_hf", lambda *a: decisions.append(prefers(*a)) or decisions[-1])
    model = _model("tiny-mixtral", torch.bfloat16)
    ids = token_ids(batch=1, length=tokens).cuda()
    with torch.no_grad():
        expected = model(ids).logits
        model.set_experts_implementation("moecompile")
        got = model(ids).logits
    assert decisions and all(d == takes_hf for d in decisions)
    assert _cos(got, expected) > 0.999


@pytest.mark.parametrize("matvec", [True, False])
def test_one_token_linears_compile_to_matrix_vector_reductions(matvec):
    """decode_matvec: at one token the backend's inductor code computes every linear as a reduction of its own (no
    GEMM library call), with eager's logits; turned off, the same graph calls the GEMM library."""
    from torch._inductor.utils import run_and_get_code

    import moecompile
    from moecompile import backend

    model = tiny_moe("tiny-qwen3-moe").to("cuda", torch.bfloat16)
    ids = token_ids(batch=1, length=1).to("cuda")
    torch._dynamo.reset()
    backend.clear_records()
    compiled = moecompile.compile(model, fullgraph=True, decode_matvec=matvec)
    with torch.no_grad():
        got, code = run_and_get_code(lambda: compiled(ids, use_cache=False).logits)
        want = model(ids, use_cache=False).logits
    assert (backend.records()[-1].matvec_linears > 0) == matvec
    assert ("extern_kernels.mm(" in "".join(code)) != matvec
    assert _cos(got, want) > 0.999
    torch._dynamo.reset()
