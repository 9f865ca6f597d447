"""FP8 decode on CUDA (marker gpu: run on the device with `pytest -m gpu`): the weight-only kernels
(kernels/triton_fp8_decode.py, autotuned, bf16 activations) against their reference kernels at Qwen3-30B-A3B /
Mixtral shapes, and moecompile.generate with options fp8 (+ fp8_linears) on a tiny Qwen3-MoE at batch 1 (the direct
FP8 experts) and 16 (the sorted FP8 experts): the decode step captured as a CUDA graph, its tokens those of the same
step uncaptured, the first logits within cosine 0.995 of the bf16 run."""
import pytest
import torch
import transformers
from hf_moe import token_ids

from moecompile import backend
from moecompile.core import fp8_format as fp8
from moecompile.generation import Generator
from moecompile.kernels import reference as R
from moecompile.kernels import triton_fp8_decode
from moecompile.runtime import choices
from moecompile.runtime import fp8 as RF

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
PROMPT, NEW = 7, 6  # NEW > the Generator's warm-up steps, so that the decode step is captured


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def _fp8_sm89():
    return torch.cuda.get_device_capability() >= (8, 9)  # e4m3 conversion in registers (Ada, Hopper)


@pytest.mark.parametrize("tokens,experts,top_k,hidden,width", [(1, 128, 8, 2048, 768), (1, 8, 2, 4096, 14336),
                                                                (2, 64, 6, 200, 136)])
@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_cuda_fp8_direct_experts_match_reference(tokens, experts, top_k, hidden, width, gated, bias):
    """Autotuned kernels and the runtime's (table tiles), bf16 activations, against the reference's
    dequantise-then-float32."""
    if not _fp8_sm89():
        pytest.skip("float8_e4m3fn in registers needs sm_89+")
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=DEVICE, generator=gen).bfloat16()
    weights, ids = R.route(torch.randn(tokens, experts, device=DEVICE, generator=gen), top_k, 0.0, True)  # dropless
    used = ids.unique()  # quantise only the experts the tokens reach: Mixtral's are large
    w_in = torch.zeros(experts, (2 if gated else 1) * width, hidden, device=DEVICE, dtype=torch.bfloat16)
    w_out = torch.zeros(experts, hidden, width, device=DEVICE, dtype=torch.bfloat16)
    w_in[used] = torch.randn(len(used), w_in.shape[1], hidden, device=DEVICE, generator=gen).bfloat16() / hidden ** 0.5
    w_out[used] = torch.randn(len(used), hidden, width, device=DEVICE, generator=gen).bfloat16() / width ** 0.5
    b_in = torch.randn(experts, w_in.shape[1], device=DEVICE, generator=gen).bfloat16() if bias else None
    b_out = torch.randn(experts, hidden, device=DEVICE, generator=gen).bfloat16() if bias else None
    (q_in, s_in), (q_out, s_out) = fp8.quantize_blocks(w_in), fp8.quantize_blocks(w_out)
    args = (x, weights, ids, q_in, s_in, b_in, q_out, s_out, b_out, "silu", gated)
    got = triton_fp8_decode.routed_experts_fp8(*args)
    want = R.routed_experts_fp8(*args)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert _rel(got, want) <= 2e-2  # the activation is stored in bf16 between the projections
    assert _rel(RF.routed_experts_fp8(*args), want) <= 2e-2


@pytest.mark.parametrize("rows", [1, 2, 16, 64])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (1000, 200)])
@pytest.mark.parametrize("split", ["one", "runtime"])
def test_cuda_fp8_linear_matches_reference(rows, n, k, split):
    """The kernel with its tiles autotuned, K unsplit and split as the runtime splits it."""
    if not _fp8_sm89():
        pytest.skip("float8_e4m3fn in registers needs sm_89+")
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    q, s = fp8.quantize_blocks(torch.randn(n, k, device=DEVICE, generator=gen) / k ** 0.5)
    b = torch.randn(n, device=DEVICE, generator=gen).bfloat16()
    x = torch.randn(rows, k, device=DEVICE, generator=gen).bfloat16()
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    splits = 1 if split == "one" else choices.fp8_linear_splits(rows, n, k, sms)
    got = triton_fp8_decode.linear_fp8(x, q, s, b, splits=splits)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert _rel(got, R.linear_fp8(x, q, s, b)) <= 1e-2


def _qwen3_moe(family: str = "qwen3"):
    """A tiny Qwen3-MoE whose sizes are whole 128-blocks and whose 16 experts at top-2 make one token decode-sized
    for direct_experts (bf16, CUDA); family "mixtral": a Mixtral of the same sizes with 4 experts at top-2, whose one
    token goes direct too (any one token does)."""
    torch.manual_seed(0)
    sizes = dict(hidden_size=256, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=64, eos_token_id=None)
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=128, num_local_experts=4, **sizes)).eval()
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=512, moe_intermediate_size=128, num_experts=16, **sizes)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)  # routing that depends on the token
    model.generation_config.eos_token_id = None
    return model.to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("linears,family", [(False, "qwen3"), (True, "qwen3"), (False, "mixtral")])
def test_generate_fp8_captures_and_stays_near_bf16(batch, linears, family):
    """options fp8 (+ fp8_linears): the decode step's graph holds the FP8 ops (direct FP8 experts at batch 1, the
    sorted FP8 GEMMs at 16; linear_fp8 for the linears), is captured as a CUDA graph whose tokens are those of the
    same step uncaptured; the first logits (the prompt's, and those of a one-token prompt, which runs the decode
    step's form) stay within cosine 0.995 of the bf16 run."""
    if not _fp8_sm89():
        pytest.skip("FP8 needs sm_89+")
    model = _qwen3_moe(family)
    options = {"inductor": False, "fp8": True, **({"fp8_linears": True} if linears else {})}
    ids = token_ids(batch=batch, length=PROMPT).to(DEVICE)
    bf16 = Generator(model, batch, PROMPT + NEW, options={"inductor": False})
    bf16(ids, NEW)
    backend.clear_records()
    gen = Generator(model, batch, PROMPT + NEW, options=options)
    graphed = gen(ids, NEW)
    assert gen._graphs, "the decode step was not captured"
    assert _cos(gen.prefill_logits, bf16.prefill_logits) >= 0.995
    step = backend.records()[-1].graph_module  # prefill, then the decode step
    names = [n.target._opname for n in step.graph.nodes if n.op == "call_function"
             and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "moecompile"]
    assert names.count("routed_experts_fp8" if batch == 1 else "experts_fp8") == 2, names
    assert ("linear_fp8" in names) == linears
    gen.cuda_graph = False
    assert torch.equal(gen(ids, NEW), graphed)
    one = token_ids(batch=batch, length=1).to(DEVICE)  # a one-token prompt: the decode step's shapes
    bf16(one, 1)
    gen(one, 1)
    assert _cos(gen.prefill_logits, bf16.prefill_logits) >= 0.995


def test_one_row_fp8_linears_compile_to_inductor_reductions():
    """With inductor (decode_matvec on), the batch-1 decode step's FP8 linears become matvec_fp8_linears' linears over
    weights dequantised in the graph, which inductor fuses into its matrix-vector reductions: the step is captured,
    and the logits of a one-token prompt (the step's form) stay within cosine 0.999 of the Triton kernel's (inductor
    off, linear_fp8 kept)."""
    if not _fp8_sm89():
        pytest.skip("FP8 needs sm_89+")
    model = _qwen3_moe()
    ids, one = token_ids(batch=1, length=PROMPT).to(DEVICE), token_ids(batch=1, length=1).to(DEVICE)
    logits, reports = {}, {}
    for inductor in (False, True):
        backend.clear_records()
        gen = Generator(model, 1, PROMPT + NEW, options={"inductor": inductor, "fp8": True, "fp8_linears": True})
        gen(ids, NEW)
        assert gen._graphs, "the decode step was not captured"
        reports[inductor] = dict(backend.records()[-1].reports)["matvec_fp8_linears"]  # the decode step's
        gen(one, 1)
        logits[inductor] = gen.prefill_logits.clone()
    assert reports[True]["rewritten"] and "rewritten" not in reports[False], reports
    assert _cos(logits[True], logits[False]) >= 0.999
