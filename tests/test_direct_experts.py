"""Experts over unsorted assignments at a few tokens: the Triton kernels (kernels/triton_direct.py, interpreted on
CPU) and the routed_experts op against dispatch + experts + combine, and the direct_experts pass on Dynamo graphs
of every tiny HF family."""
import pytest
import torch
from hf_moe import FAMILIES, MOE_LAYERS, dynamo_graphs, moe_nodes, tiny_moe, token_ids

from moecompile.ir import ops
from moecompile.kernels import reference as R
from moecompile.kernels import triton_direct
from moecompile.passes import direct_experts as pass_module
from moecompile.passes.pipeline import run_pipeline

TILES = {"in": {"BLOCK_N": 8, "BLOCK_K": 16}, "out": {"BLOCK_N": 8, "BLOCK_K": 8}}  # several tiles at tiny sizes


def _experts(num_experts, hidden, width, gated, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    w_in = torch.randn(num_experts, (2 if gated else 1) * width, hidden, generator=gen) / hidden ** 0.5
    w_out = torch.randn(num_experts, hidden, width, generator=gen) / width ** 0.5
    b_in = torch.randn(num_experts, w_in.shape[1], generator=gen) if bias else None
    b_out = torch.randn(num_experts, hidden, generator=gen) if bias else None
    return w_in, b_in, w_out, b_out


def _sorted(x, weights, ids, w_in, b_in, w_out, b_out, activation, gated):
    """dispatch -> experts -> combine's terms before their sum: [T, k, H]"""
    rows, order, offsets = R.dispatch(x, ids, w_in.shape[0])
    y = R.experts(rows, offsets, w_in, b_in, w_out, b_out, activation, gated)
    terms = torch.zeros(*ids.shape, x.shape[1])
    flat = terms.view(-1, x.shape[1])
    flat[order] = y
    return torch.where((weights != 0).unsqueeze(-1), terms * weights.unsqueeze(-1), 0.0)


CASES = {  # name: (tokens, experts, top_k, hidden, width, capacity factor, ids override)
    "batch 1": (1, 8, 2, 24, 20, -1.0, None),
    "odd sizes, k = E": (3, 5, 5, 17, 13, -1.0, None),
    "capacity overflow (dropped slots)": (6, 4, 2, 16, 12, 0.5, None),
    "all tokens to one expert": (4, 6, 1, 16, 12, -1.0, "one"),
    "empty experts": (2, 16, 2, 16, 24, -1.0, None),
}


def case_inputs(case: str, cases: dict = CASES) -> tuple:
    """(x, weights, ids) of a case: random tokens and routing (seeded by the case's name)."""
    tokens, num_experts, top_k, hidden, _, capacity, override = cases[case]
    gen = torch.Generator().manual_seed(len(case))
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = R.route(torch.randn(tokens, num_experts, generator=gen), top_k, capacity, True)
    if override == "one":
        ids = torch.full_like(ids, 3)
    if capacity > 0:
        assert (ids == num_experts).any()  # some assignments dropped
    return x, weights, ids


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gated, activation, bias", [(True, "silu", False), (False, "gelu", True),
                                                     (True, "relu", True)])
def test_triton_routed_experts_match_dispatch_experts_combine(case, gated, activation, bias):
    _, num_experts, _, hidden, width, _, _ = CASES[case]
    x, weights, ids = case_inputs(case)
    params = _experts(num_experts, hidden, width, gated, bias, seed=3)
    want = _sorted(x, weights, ids, *params, activation, gated)
    got = triton_direct.routed_experts(x, weights, ids, *params, activation, gated, config=TILES)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rows, order, offsets = R.dispatch(x, ids, num_experts)  # their sum is the MoE output
    y = R.experts(rows, offsets, *params, activation, gated)
    torch.testing.assert_close(got.sum(1), R.combine(y, order, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hidden, width, second_k_step", [(2048, 768, 256), (4096, 14336, 512), (17, 13, 256)])
def test_runtime_tiles_come_from_the_table_and_match_the_reference(hidden, width, second_k_step):
    """runtime/choices' direct_expert_tiles: the first entry of kernels/configs/direct_experts.json that takes each
    projection's K (the second projection's tiles widen past the table's boundary); every entry is a valid FP8 K step
    (dividing 128 or whole scale blocks); the kernels at those tiles match the sorted reference at odd sizes."""
    from moecompile.runtime import choices

    tiles = choices.direct_expert_tiles(hidden, width)
    assert tiles["out"]["BLOCK_K"] == second_k_step and set(tiles["in"]) == {"BLOCK_N", "BLOCK_K", "num_warps",
                                                                              "num_stages"}
    table = choices.direct_experts_table()
    for entry in table["first"] + table["second"]:
        assert 128 % entry["BLOCK_K"] == 0 or entry["BLOCK_K"] % 128 == 0
    assert table["first"][-1]["max_k"] is None and table["second"][-1]["max_k"] is None  # every K has tiles
    if hidden < 64:
        x, weights, ids = case_inputs("odd sizes, k = E")
        params = _experts(5, hidden, width, True, False, seed=6)
        got = triton_direct.routed_experts(x, weights, ids, *params, "silu", True, config=tiles)
        torch.testing.assert_close(got, _sorted(x, weights, ids, *params, "silu", True), rtol=1e-5, atol=1e-5)


def test_triton_routed_experts_read_nothing_for_dropped_assignments():
    """An assignment of weight 0 reads no weights: NaN weights of an expert only such assignments name change
    nothing, as in the reference, where combine skips them."""
    x = torch.randn(2, 16)
    weights = torch.tensor([[0.7, 0.0], [1.0, 0.0]])
    ids = torch.tensor([[0, 2], [1, 2]])
    w_in, b_in, w_out, b_out = _experts(3, 16, 8, True, True, seed=4)
    for w in (w_in, b_in, w_out, b_out):
        w[2] = float("nan")
    got = triton_direct.routed_experts(x, weights, ids, w_in, b_in, w_out, b_out, "silu", True, config=TILES)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _sorted(x, weights, ids, w_in, b_in, w_out, b_out, "silu", True))


def test_triton_routed_experts_empty_batch():
    w_in, b_in, w_out, b_out = _experts(4, 8, 6, True, False, seed=5)
    out = triton_direct.routed_experts(torch.zeros(0, 8), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long),
                                       w_in, b_in, w_out, b_out, "silu", True, config=TILES)
    assert out.shape == (0, 2, 8) and out.dtype == torch.float32


def test_routed_experts_op_sums_to_dispatch_experts_combine():
    """The op's terms (the reference kernel on CPU), GPT-OSS's clamped interleaved SwiGLU included."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 16, generator=gen)
    weights, ids = R.route(torch.randn(3, 4, generator=gen), 2, -1.0, True)
    w_in, b_in, w_out, b_out = _experts(4, 16, 8, True, True, seed=7)
    for glu in ({}, {"interleaved": True, "alpha": 1.702, "limit": 7.0}):
        activation = "swiglu_oai" if glu else "silu"
        got = ops.routed_experts(x, weights, ids, w_in, b_in, w_out, b_out, activation, True, **glu)
        rows, order, offsets = R.dispatch(x, ids, 4)
        y = R.experts(rows, offsets, w_in, b_in, w_out, b_out, activation, True, *glu.values())
        torch.testing.assert_close(got.sum(1), R.combine(y, order, weights))


def test_policy_takes_few_assignments_per_expert():
    decode_sized = pass_module.decode_sized
    assert decode_sized(1, 8, 128) and decode_sized(1, 8, 256) and decode_sized(2, 8, 128)
    assert not decode_sized(16, 8, 128) and not decode_sized(2, 2, 8)
    assert decode_sized(1, 2, 8)  # any one token: Mixtral's too


# ------------------------------------------------------------------------------------------------------ the pass

def _outputs(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("family", FAMILIES)
def test_pass_rewrites_one_token_graphs_and_keeps_their_output(family, monkeypatch):
    monkeypatch.setattr(pass_module, "MAX_ASSIGNMENTS_PER_EXPERT", 1.0)  # tiny models: few experts
    ((gm, inputs),) = dynamo_graphs(tiny_moe(family), token_ids(batch=1, length=1), use_cache=False)
    with torch.no_grad():
        before = gm(*inputs)
    gm, ctx = run_pipeline(gm, pipeline="compile")
    report = dict(ctx.reports)["direct_experts"]
    interleaved = family == "tiny-gpt-oss"  # GPT-OSS's clamped interleaved SwiGLU: no direct kernel, kept sorted
    assert len(report["direct"]) == (0 if interleaved else MOE_LAYERS[family])
    assert len(moe_nodes(gm, "routed_experts")) == len(report["direct"])
    assert len(moe_nodes(gm, "route_dispatch")) == MOE_LAYERS[family] - len(report["direct"])
    if not interleaved:
        assert not moe_nodes(gm, "dispatch") and not moe_nodes(gm, "experts") and not moe_nodes(gm, "combine")
    with torch.no_grad():
        for got, want in zip(_outputs(gm(*inputs)), _outputs(before), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens, options, training, kept", [
    (8, {}, False, None),  # 8 tokens x top-2 over 4 experts: sorted
    (1, {"expert_parallel": {"group": None}}, False, "option expert_parallel"),
    (1, {}, True, "training graph"),
])
def test_pass_leaves_batches_training_and_expert_parallel_graphs_sorted(tokens, options, training, kept, monkeypatch):
    if tokens == 1:
        monkeypatch.setattr(pass_module, "MAX_ASSIGNMENTS_PER_EXPERT", 1.0)
    ((gm, _),) = dynamo_graphs(tiny_moe("tiny-mixtral"), token_ids(batch=1, length=tokens), use_cache=False)
    from moecompile.passes.pipeline import PassContext
    from moecompile.passes.recognise_moe import recognise_moe

    ctx = PassContext(options=options, training=training)
    recognise_moe(gm, ctx)
    report = pass_module.direct_experts(gm, ctx)
    assert report["direct"] == [] and report.get("kept") == kept
    assert len(moe_nodes(gm, "dispatch")) == MOE_LAYERS["tiny-mixtral"]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens", [1, 2])
def test_experts_go_direct_at_any_one_token(fp8, tokens):
    """Mixtral's one token (top-2 of 4 here) goes direct, in bf16 and where its experts will be FP8 (option fp8);
    two of its tokens (one assignment per expert) stay sorted under MAX_ASSIGNMENTS_PER_EXPERT."""
    ((gm, inputs),) = dynamo_graphs(tiny_moe("tiny-mixtral"), token_ids(batch=1, length=tokens), use_cache=False)
    gm, ctx = run_pipeline(gm, {"fp8": fp8, "inductor": False}, pipeline="compile", example_inputs=inputs)
    direct = MOE_LAYERS["tiny-mixtral"] if tokens == 1 else 0
    assert len(dict(ctx.reports)["direct_experts"]["direct"]) == direct
    assert len(moe_nodes(gm, "routed_experts_fp8" if fp8 else "routed_experts")) == direct
    sorted_experts = moe_nodes(gm, "experts_fp8" if fp8 else "experts") + moe_nodes(gm, "experts_gathered")
    assert len(sorted_experts) == MOE_LAYERS["tiny-mixtral"] - direct
