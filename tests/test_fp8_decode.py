"""FP8 decode, weight-only: the direct experts over FP8 weights (kernels/triton_fp8_decode.py, interpreted on CPU)
and the FP8 linear against dequantise-then-float32; the ops' reference kernels; the compile pipeline turning a
decode-sized block into routed_experts_fp8 (option fp8) and the linears into linear_fp8 (option fp8_linears), and
the compiled one-token model against the float32 one."""
import pytest
import torch
from hf_moe import MOE_LAYERS, dynamo_graphs, moe_nodes, tiny_moe, token_ids
from test_direct_experts import CASES as DIRECT_CASES
from test_direct_experts import case_inputs

from moecompile import backend
from moecompile.core import fp8_format as fp8
from moecompile.ir import ops
from moecompile.kernels import reference as R
from moecompile.kernels import triton_fp8_decode
from moecompile.passes import direct_experts
from moecompile.passes.pipeline import run_pipeline
from moecompile.runtime import choices

TILES = {"in": {"BLOCK_N": 16, "BLOCK_K": 64}, "out": {"BLOCK_N": 16, "BLOCK_K": 32}}  # several tiles and K steps


def _block_varied(shape, gen):
    """Random weights whose 128 x 128 blocks differ in magnitude, so that a block read with another's scale shows."""
    w = torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
    rows, cols = fp8.cdiv(shape[-2], 128), fp8.cdiv(shape[-1], 128)
    scale = torch.rand(*shape[:-2], rows, cols, generator=gen) * 4 + 0.25
    return w * scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :shape[-2], :shape[-1]]


def _fp8_experts(num_experts, hidden, width, gated, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    w_in = _block_varied((num_experts, (2 if gated else 1) * width, hidden), gen)
    w_out = _block_varied((num_experts, hidden, width), gen)
    b_in = torch.randn(num_experts, w_in.shape[1], generator=gen) if bias else None
    b_out = torch.randn(num_experts, hidden, generator=gen) if bias else None
    (q_in, s_in), (q_out, s_out) = fp8.quantize_blocks(w_in), fp8.quantize_blocks(w_out)
    return (q_in, s_in, b_in, q_out, s_out, b_out), (w_in, b_in, w_out, b_out)


def _dequantised(q_in, s_in, b_in, q_out, s_out, b_out):
    return fp8.dequantize_blocks(q_in, s_in), b_in, fp8.dequantize_blocks(q_out, s_out), b_out


CASES = {**DIRECT_CASES,  # name: (tokens, experts, top_k, hidden, width, capacity factor, ids override)
         "several scale blocks (up rows across a block edge)": (1, 4, 2, 200, 136, -1.0, None)}


WIDE_TILES = {"in": {"BLOCK_N": 16, "BLOCK_K": 256}, "out": {"BLOCK_N": 8, "BLOCK_K": 512}}  # several blocks a step


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gated, activation, bias", [(True, "silu", False), (False, "gelu", True)])
def test_fp8_direct_experts_match_dequantised_float32(case, gated, activation, bias):
    _, num_experts, _, hidden, width, _, _ = CASES[case]
    x, weights, ids = case_inputs(case, CASES)
    quantised, exact = _fp8_experts(num_experts, hidden, width, gated, bias, seed=3)
    want = R.routed_experts(x, weights, ids, *_dequantised(*quantised), activation, gated)
    got = triton_fp8_decode.routed_experts_fp8(x, weights, ids, *quantised, activation, gated, config=TILES)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wide = triton_fp8_decode.routed_experts_fp8(x, weights, ids, *quantised, activation, gated, config=WIDE_TILES)
    torch.testing.assert_close(wide, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(R.routed_experts_fp8(x, weights, ids, *quantised, activation, gated), want,
                               rtol=1e-5, atol=1e-5)
    # FP8 weights alone (activations unquantised) stay near the unquantised FFN: e4m3 rounds each weight by <= 6%,
    # and two projections over a few channels average little of it
    full = R.routed_experts(x, weights, ids, *exact, activation, gated).sum(1)
    assert (got.sum(1) - full).norm() <= 0.12 * full.norm()


def test_fp8_direct_experts_read_nothing_for_dropped_assignments():
    x = torch.randn(2, 16)
    weights = torch.tensor([[0.7, 0.0], [1.0, 0.0]])
    ids = torch.tensor([[0, 2], [1, 2]])
    (q_in, s_in, b_in, q_out, s_out, b_out), _ = _fp8_experts(3, 16, 8, True, True, seed=4)
    for t in (s_in, b_in, s_out, b_out):
        t[2] = float("nan")
    got = triton_fp8_decode.routed_experts_fp8(x, weights, ids, q_in, s_in, b_in, q_out, s_out, b_out, "silu", True,
                                               config=TILES)
    assert torch.isfinite(got).all() and (got[:, 1] == 0).all()


def test_fp8_direct_experts_empty_batch_and_tile_check():
    quantised, _ = _fp8_experts(4, 8, 6, True, False, seed=5)
    out = triton_fp8_decode.routed_experts_fp8(torch.zeros(0, 8), torch.zeros(0, 2),
                                               torch.zeros(0, 2, dtype=torch.long), *quantised, "silu", True,
                                               config=TILES)
    assert out.shape == (0, 2, 8) and out.dtype == torch.float32
    with pytest.raises(ValueError, match="BLOCK_K must divide 128 or be a multiple of it"):
        triton_fp8_decode.routed_experts_fp8(torch.zeros(1, 8), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long),
                                             *quantised, "silu", True,
                                             config={"in": {"BLOCK_N": 8, "BLOCK_K": 192}, "out": TILES["out"]})
    with pytest.raises(ValueError, match="BLOCK_K must divide 128, got 256"):  # the dot form: within a block
        triton_fp8_decode.linear_fp8(torch.zeros(3, 8), quantised[0][0], quantised[1][0], None,
                                     config={"BLOCK_N": 16, "BLOCK_K": 256})


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_fp8_linear_matches_dequantised_float32(rows, bias, splits):
    """One row: the matrix-vector form; more: the dot form over a row tile padded to 16 / 32 / 64. K = 300 is three
    scale blocks, the last one partial: split in two (blocks 1-2, 3) and in three, the partial sums and the bias
    added once."""
    gen = torch.Generator().manual_seed(rows)
    w = _block_varied((150, 300), gen)
    q, s = fp8.quantize_blocks(w)
    b = torch.randn(150, generator=gen) if bias else None
    x = torch.randn(rows, 300, generator=gen)
    want = torch.nn.functional.linear(x, fp8.dequantize_blocks(q, s), b)
    got = triton_fp8_decode.linear_fp8(x, q, s, b, config={"BLOCK_N": 32, "BLOCK_K": 64}, splits=splits)
    if rows == 1:  # the matrix-vector form also steps over whole blocks, wider than a split of one block
        wide = triton_fp8_decode.linear_fp8(x, q, s, b, config={"BLOCK_N": 16, "BLOCK_K": 256}, splits=splits)
        torch.testing.assert_close(wide, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(R.linear_fp8(x, q, s, b), want, rtol=1e-5, atol=1e-5)
    exact = torch.nn.functional.linear(x, w, b)
    assert (got - exact).norm() <= 0.05 * exact.norm()


def test_fp8_linear_row_tiles():
    assert [triton_fp8_decode.row_tile(m) for m in (1, 2, 16, 17, 64, 65)] == [1, 16, 16, 32, 64, 64]


def test_fp8_linear_splits():
    """Splits fill the GPU (one row of a 4096-wide linear: 64 column tiles, 8 splits on 132 SMs), as a power of two,
    never more than K has scale blocks, and fewer as rows grow (their float32 partial sums cost bytes); none for a
    grid that already fills the GPU."""
    splits = choices.fp8_linear_splits
    assert splits(1, 4096, 4096, 132) == 8
    assert splits(1, 64, 300, 132) == 2  # 3 scale blocks
    assert splits(1, 4096, 4096, 132) >= splits(16, 4096, 4096, 132) >= splits(64, 4096, 4096, 132) >= 1
    share = choices.fp8_linear_table()["max_partial_share"]
    for rows in (1, 2, 16, 64):
        for n, k in ((4096, 4096), (5120, 2048), (2048, 4096), (1000, 200)):
            s = splits(rows, n, k, 132)
            assert s & (s - 1) == 0 and s <= fp8.cdiv(k, 128)
            assert s == 1 or 8 * s * rows <= share * k
    assert splits(1, 65536, 4096, 132) == splits(2, 4096, 4096, 1) == 1


def test_fp8_ops_check_their_weights():
    """The ops (reference kernels on CPU): leading dims of a linear's input kept; a weight not in FP8 or with
    scales of another shape is a one-line error."""
    q, s = fp8.quantize_blocks(torch.randn(40, 130))
    x = torch.randn(2, 1, 130)
    y = ops.linear_fp8(x, q, s, None)
    assert y.shape == (2, 1, 40)
    torch.testing.assert_close(y, x @ fp8.dequantize_blocks(q, s).t())
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        ops.linear_fp8(x, q.float(), s, None)
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(1, 1\), expected \(1, 2\)"):
        ops.linear_fp8(x, q, s[:, :1], None)
    quantised, _ = _fp8_experts(3, 16, 8, True, False, seed=6)
    q_in, s_in, b_in, q_out, s_out, b_out = quantised
    with pytest.raises(ValueError, match="w_out_scale_inv has shape"):
        ops.routed_experts_fp8(torch.randn(1, 16), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long), q_in, s_in,
                               b_in, q_out, s_out[:2], b_out, "silu", True)


def test_fp8_decode_ops_opcheck():
    """Fake kernels, autograd registration and AOT dispatch (opcheck's schema test compares inputs with allclose,
    which float8 lacks on CPU)."""
    quantised, _ = _fp8_experts(4, 16, 8, True, True, seed=7)
    weights, ids = R.route(torch.randn(2, 4), 2, -1.0, True)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.routed_experts_fp8, (torch.randn(2, 16), weights, ids, *quantised, "silu", True),
                          test_utils=utils)
    q, s = fp8.quantize_blocks(torch.randn(24, 16))
    torch.library.opcheck(ops.linear_fp8, (torch.randn(2, 3, 16), q, s, torch.randn(24)), test_utils=utils)


# ------------------------------------------------------------------------------------------------------ the passes

def _cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


def test_fp8_one_token_graph_takes_the_direct_fp8_path(monkeypatch):
    """options fp8 + fp8_linears at one token: direct_experts decides, insert_fp8 makes routed_experts_fp8 (weights
    as constants, activations unquantised), insert_fp8_linears makes every linear but the routers linear_fp8 (the
    fused q/k/v weight whole); the graph's logits stay within FP8's error of the float32 graph's."""
    monkeypatch.setattr(direct_experts, "MAX_ASSIGNMENTS_PER_EXPERT", 1.0)  # tiny models: few experts
    family = "tiny-qwen3-moe"
    ((gm, inputs),) = dynamo_graphs(tiny_moe(family), token_ids(batch=1, length=1), use_cache=False)
    with torch.no_grad():
        (want,) = gm(*inputs)
    options = {"fp8": True, "fp8_linears": True, "inductor": False}  # linear_fp8 kept (matvec_fp8_linears: below)
    gm, ctx = run_pipeline(gm, options, pipeline="compile", example_inputs=inputs)
    reports = dict(ctx.reports)
    layers = MOE_LAYERS[family]
    assert len(moe_nodes(gm, "routed_experts_fp8")) == layers and not moe_nodes(gm, "routed_experts")
    assert not moe_nodes(gm, "experts_fp8") and not moe_nodes(gm, "quantize_fp8")
    assert all("(constants)" in r and "not quantised" in r for r in reports["insert_fp8"]["rewritten"])
    linears = reports["insert_fp8_linears"]
    assert len(moe_nodes(gm, "linear_fp8")) == len(linears["rewritten"]) == 2 * layers + 1  # qkv, o; lm_head
    assert any("fused_projection" in r for r in linears["rewritten"])
    assert linears["skipped"] == [f"{n}: a router" for n in ("router_logits", "router_logits_1")]
    with torch.no_grad():
        (got,) = gm(*inputs)
    assert _cosine(got, want) >= 0.995 and (got - want).norm() <= 0.08 * want.norm()
    assert not torch.equal(got, want)


def test_fp8_decode_step_compiles_with_the_rewritten_linears(monkeypatch):
    """matvec_fp8_linears under moecompile.generate with inductor on (its code generation swapped for AOT autograd's
    eager run, which traces the same way): every FP8 linear of the batch-1 decode step becomes graph ops over its
    FP8 weight (float32 block sums, then the scales), the prefill's are left alone, the
    constants a pass made reach AOT autograd with static sizes (symbolic ones without a source broke Dynamo's guards
    once the dequantisation compared them), and the tokens are those of the run that keeps linear_fp8 (inductor
    off)."""
    from torch._dynamo.backends.debugging import aot_eager

    from moecompile.generation import Generator

    monkeypatch.setattr(direct_experts, "MAX_ASSIGNMENTS_PER_EXPERT", 1.0)
    monkeypatch.setattr(backend, "_inductor", lambda gm, inputs, *settings: aot_eager(gm, inputs))
    model = tiny_moe("tiny-qwen3-moe", one_layer=True)
    model.generation_config.eos_token_id = None
    ids = token_ids(batch=1, length=6)
    tokens, records = {}, {}
    for inductor in (False, True):
        backend.clear_records()
        tokens[inductor] = Generator(model, 1, 10, options={"inductor": inductor, "fp8_linears": True})(ids, 4)
        records[inductor] = backend.records()  # the prefill's graph, then the decode step's
    prefill, step = (dict(r.reports)["matvec_fp8_linears"] for r in records[True])
    assert prefill == {"skipped": "not a batch-1 decode step"}
    assert len(step["rewritten"]) == len(moe_nodes(records[False][-1].graph_module, "linear_fp8")) > 0
    assert not moe_nodes(records[True][-1].graph_module, "linear_fp8")
    assert "rewritten" not in dict(records[False][-1].reports)["matvec_fp8_linears"]
    assert torch.equal(tokens[True], tokens[False])


def test_fp8_batches_keep_the_sorted_path(monkeypatch):
    """fp8 no longer keeps direct_experts off, which alone decides what is decode-sized: 8 tokens of a block that
    one token sends direct keep the sorted path (activations quantised, experts_fp8)."""
    monkeypatch.setattr(direct_experts, "MAX_ASSIGNMENTS_PER_EXPERT", 1.0)
    ((gm, inputs),) = dynamo_graphs(tiny_moe("tiny-mixtral"), token_ids(batch=1, length=8), use_cache=False)
    gm, ctx = run_pipeline(gm, {"fp8": True}, pipeline="compile", example_inputs=inputs)
    layers = MOE_LAYERS["tiny-mixtral"]
    assert not moe_nodes(gm, "routed_experts_fp8") and len(moe_nodes(gm, "experts_fp8")) == layers
    assert dict(ctx.reports)["insert_fp8_linears"] == {"skipped": "off (option fp8_linears=None)"}


def test_generate_with_fp8_options(monkeypatch):
    """moecompile.generate with fp8 + fp8_linears: the decode step runs the direct FP8 experts and FP8 linears, the
    prefill (12 assignments) the sorted FP8 experts; the prompt's logits stay within cosine 0.995 of float32 (the
    tokens may differ: this tiny model's top two logits are near-ties)."""
    from moecompile.generation import Generator

    monkeypatch.setattr(direct_experts, "MAX_ASSIGNMENTS_PER_EXPERT", 1.0)
    model = tiny_moe("tiny-qwen3-moe")
    ids = token_ids(batch=1, length=6)
    with torch.no_grad():
        want = model(ids).logits[:, -1]
    backend.clear_records()
    gen = Generator(model, 1, 10, options={"inductor": False, "fp8": True, "fp8_linears": True})
    out = gen(ids, 4)
    assert out.shape == (1, 10) and torch.equal(out[:, :6], ids)
    assert _cosine(gen.prefill_logits, want) >= 0.995
    prefill, step = (r.graph_module for r in backend.records())
    layers = MOE_LAYERS["tiny-qwen3-moe"]
    assert len(moe_nodes(step, "routed_experts_fp8")) == layers and len(moe_nodes(prefill, "experts_fp8")) == layers
    assert len(moe_nodes(step, "linear_fp8")) == len(moe_nodes(prefill, "linear_fp8")) == 2 * layers + 1


def test_fp8_linears_refuse_training_graphs():
    model, ids = tiny_moe("tiny-mixtral"), token_ids(batch=1, length=1)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="'fp8_linears' is inference-only"):  # Dynamo wraps the pass's error
        torch.compile(model, backend="moecompile", options={"inductor": False, "fp8_linears": True})(
            ids, use_cache=False)
    torch._dynamo.reset()


def test_fp8_linears_know_routers_without_routing_ops():
    """Where no routing op follows (the MoE block not recognised, a graph break), routers are known by their HF
    module names; Qwen2-MoE's shared_expert_gate (a plain linear) is not one."""
    from moecompile.passes.insert_fp8 import insert_fp8_linears

    ((gm, inputs),) = dynamo_graphs(tiny_moe("tiny-qwen2-moe"), token_ids(batch=1, length=1), use_cache=False)
    gm, ctx = run_pipeline(gm, {"fp8_linears": True}, passes=[insert_fp8_linears], example_inputs=inputs,
                           pipeline="compile")
    report = dict(ctx.reports)["insert_fp8_linears"]
    assert report["skipped"] == ["router_logits: a router", "router_logits_1: a router"]
    assert sum("shared_expert_gate" in r for r in report["rewritten"]) == 2
