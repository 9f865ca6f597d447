"""gather_expert_rows and the op it emits: experts_gathered over route_dispatch's order (its row copy off) against
route_dispatch + experts + combine and a per-token float32 loop, on the edge cases of routing; the pass on the HF
families' compile graphs (inference only, GPT-OSS's activation left alone, option gather_rows)."""
import pytest
import torch
from hf_moe import FAMILIES, MOE_LAYERS, dynamo_graphs, moe_nodes, tiny_moe, token_ids
from naive import naive_act
from torch.utils._python_dispatch import TorchDispatchMode

from moecompile.core.errors import MoECompileError
from moecompile.ir import ops
from moecompile.passes.nodes import arg
from moecompile.passes.pipeline import run_pipeline

OPS = torch.ops.moecompile

def _to_expert(e, logit):
    """A router change giving expert e `logit` more on every token (through the inputs' first channel, set to 1)."""
    def tweak(hid, router):
        hid[:, 0] = 1.0
        router[e, 0] = logit
    return tweak


# name: (tokens, hidden, experts, width, top_k, capacity_factor, router tweak)
CASES = {
    "random": (37, 24, 6, 20, 2, 0.0, None),
    "batch_1": (1, 24, 6, 20, 2, 0.0, None),
    "k_equals_e": (9, 16, 4, 12, 4, 0.0, None),
    "one_expert_takes_all": (15, 16, 5, 8, 1, 0.0, _to_expert(2, 100.0)),
    "empty_experts": (20, 16, 6, 8, 2, 0.0, _to_expert(slice(3, None), -100.0)),
    "capacity_overflow": (40, 16, 4, 8, 2, 0.5, None),  # a capacity of 5 rows each: most assignments dropped
    "odd_sizes": (13, 7, 3, 5, 2, 0.0, None),
    "batch": (256, 16, 4, 8, 2, 0.0, None),  # 128 rows per expert: a batch, where the experts gather (gathers_rows)
}


def _case(name, gated, bias, seed=0):
    tokens, hidden, experts, width, k, cf, tweak = CASES[name]
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(tokens, hidden, generator=g)
    router = torch.randn(experts, hidden, generator=g)
    if tweak is not None:
        tweak(hid, router)
    w_in = torch.randn(experts, (2 if gated else 1) * width, hidden, generator=g) / hidden ** 0.5
    w_out = torch.randn(experts, hidden, width, generator=g) / width ** 0.5
    b_in = torch.randn(experts, w_in.shape[1], generator=g) if bias else None
    b_out = torch.randn(experts, hidden, generator=g) if bias else None
    return hid, router, k, cf, (w_in, b_in, w_out, b_out)


def _per_token(hid, weights, ids, w_in, b_in, w_out, b_out, gated):
    """The layer one token and one assignment at a time in float32; a dropped assignment (id E) adds nothing."""
    out = torch.zeros_like(hid)
    for t in range(hid.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= w_in.shape[0]:
                continue
            h = w_in[e] @ hid[t] + (b_in[e] if b_in is not None else 0)
            a = naive_act("silu", h.chunk(2)[0]) * h.chunk(2)[1] if gated else naive_act("silu", h)
            out[t] += weights[t, j] * (w_out[e] @ a + (b_out[e] if b_out is not None else 0))
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_gathered_experts_match_the_copied_rows_and_a_per_token_loop(case, gated, bias):
    hid, router, k, cf, (w_in, b_in, w_out, b_out) = _case(case, gated, bias)
    routing = ("softmax", None, 1, 1, 1.0, True)
    weights, ids, rows, order, offsets = OPS.route_dispatch(hid, router, None, k, cf, True, *routing)
    copied = OPS.combine(OPS.experts(rows, offsets, w_in, b_in, w_out, b_out, "silu", gated), order, weights)
    g_weights, g_ids, g_rows, g_order, g_offsets = OPS.route_dispatch(hid, router, None, k, cf, True, *routing,
                                                                      copy_rows=False)
    assert g_rows.shape == (0, hid.shape[1])  # no row copy
    assert torch.equal(g_ids, ids) and torch.equal(g_order, order) and torch.equal(g_offsets, offsets)
    y = OPS.experts_gathered(hid, g_order, g_offsets, k, w_in, b_in, w_out, b_out, "silu", gated)
    assert y.shape == (hid.shape[0] * k, hid.shape[1])
    gathered = OPS.combine(y, g_order, g_weights)
    torch.testing.assert_close(gathered, copied, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gathered, _per_token(hid, weights, ids, w_in, b_in, w_out, b_out, gated), rtol=1e-4,
                               atol=1e-5)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    if case == "capacity_overflow":
        assert int(offsets[-1]) < hid.shape[0] * k  # assignments were dropped
    if case == "empty_experts":
        assert (counts[3:] == 0).all()
    if case == "one_expert_takes_all":
        assert int(counts[2]) == hid.shape[0]


def test_ops_opcheck():
    hid, router, k, cf, (w_in, b_in, w_out, b_out) = _case("random", True, True)
    routing = ("softmax", None, 1, 1, 1.0, True)
    torch.library.opcheck(OPS.route_dispatch.default, (hid, router, None, k, cf, True, *routing, False))
    _, _, _, order, offsets = OPS.route_dispatch(hid, router, None, k, cf, True, *routing, False)
    torch.library.opcheck(OPS.experts_gathered.default, (hid, order, offsets, k, w_in, b_in, w_out, b_out, "silu",
                                                         True), test_utils=("test_schema", "test_faketensor"))


def test_uncopied_dispatch_refuses_a_backward():
    hid, router, k, cf, _ = _case("random", True, False)
    hid.requires_grad_(True)
    _, ids = OPS.route(hid.detach() @ router.t(), k, cf, True)
    rows, _, _ = OPS.dispatch(hid, ids, router.shape[0], False)
    assert rows.shape == (0, hid.shape[1])
    with pytest.raises(MoECompileError, match="dispatch without copy_rows is inference-only"):
        rows.sum().backward()


def test_gathered_experts_have_no_backward():
    hid, router, k, cf, (w_in, b_in, w_out, b_out) = _case("random", True, False)
    w_in.requires_grad_(True)
    _, _, _, order, offsets = OPS.route_dispatch(hid, router, None, k, cf, True, "softmax", None, 1, 1, 1.0, True,
                                                 False)
    y = OPS.experts_gathered(hid, order, offsets, k, w_in, None, w_out, None, "silu", True)
    with pytest.raises(MoECompileError, match="inference-only"):
        y.sum().backward()


BATCH_IDS = dict(batch=8, length=32)  # 256 tokens: at least 64 rows per expert for every tiny family (<= 8 at top-2)


@pytest.mark.parametrize("family", FAMILIES)
def test_pass_gathers_every_block_of_an_inference_graph(family):
    """At a batch every MoE block's experts read their rows themselves (GPT-OSS's activation excepted), the graph's
    output unchanged; with option gather_rows off the row copy stays."""
    model, ids = tiny_moe(family), token_ids(**BATCH_IDS)
    ((gm, inputs),) = dynamo_graphs(model, ids, use_cache=False)
    with torch.no_grad():
        want = gm(*inputs)[0]
        off, ctx_off = run_pipeline(gm, {"gather_rows": False}, pipeline="compile")
        assert dict(ctx_off.reports)["gather_expert_rows"] == {"skipped": "off (option gather_rows=False)"}
        ((gm, inputs),) = dynamo_graphs(model, ids, use_cache=False)
        gm, ctx = run_pipeline(gm, pipeline="compile")
        got = gm(*inputs)[0]
    report = dict(ctx.reports)["gather_expert_rows"]
    gathers = family != "tiny-gpt-oss"
    assert len(report["gathered"]) == (MOE_LAYERS[family] if gathers else 0)
    assert len(moe_nodes(gm, "experts_gathered")) == len(report["gathered"])
    assert len(moe_nodes(gm, "experts")) == (0 if gathers else MOE_LAYERS[family])
    assert all(arg(n, "copy_rows") is False for n in moe_nodes(gm, "route_dispatch")) == gathers
    assert len(moe_nodes(off, "experts")) == MOE_LAYERS[family] and not moe_nodes(off, "experts_gathered")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pass_leaves_small_batches_alone():
    """16 tokens of a 4-expert model are fewer rows than a batch: dispatch's one-launch copy stays."""
    ((gm, _),) = dynamo_graphs(tiny_moe("tiny-qwen3-moe"), token_ids(), use_cache=False)
    with torch.no_grad():
        gm, ctx = run_pipeline(gm, pipeline="compile")
    assert dict(ctx.reports)["gather_expert_rows"] == {"gathered": []}
    assert moe_nodes(gm, "experts") and not moe_nodes(gm, "experts_gathered")


def test_pass_leaves_training_graphs_alone():
    model, ids = tiny_moe("tiny-qwen3-moe"), token_ids()
    ((gm, _),) = dynamo_graphs(model, ids, use_cache=False)
    gm, ctx = run_pipeline(gm, pipeline="compile", training=True)
    assert dict(ctx.reports)["gather_expert_rows"] == {"skipped": "training graph"}
    assert not moe_nodes(gm, "experts_gathered")


class _Ops(TorchDispatchMode):
    """The moecompile ops a call runs."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "moecompile":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["batch", "random"])
def test_eager_inference_gathers_batches_and_training_copies(case):
    """An MoE module's eager forward without gradients runs experts_gathered over an uncopied dispatch at a batch,
    and the copied rows below; with gradients, the copied rows and experts_combine_train; all give the per-token
    loop's output."""
    hid, router, k, cf, (w_in, b_in, w_out, b_out) = _case(case, True, True)
    weights, ids = OPS.route(hid @ router.t(), k, cf, True)
    want = _per_token(hid, weights, ids, w_in, b_in, w_out, b_out, True)
    args = (ids, router.shape[0], w_in, b_in, w_out, b_out, "silu", True)
    with torch.no_grad(), _Ops() as seen:
        got = ops.dispatch_ffn_combine(hid, weights, *args)
    gathered = case == "batch"
    assert seen.names == ["dispatch", "experts_gathered" if gathered else "experts", "combine"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    w_in.requires_grad_(True)
    with _Ops() as seen:
        trained = ops.dispatch_ffn_combine(hid, weights, *args)
    assert seen.names == ["dispatch", "experts_combine_train"]
    torch.testing.assert_close(trained.detach(), want, rtol=1e-4, atol=1e-5)


def test_captured_graphs_keep_the_ops_the_passes_rewrite():
    """torch.export (non-strict) and Dynamo capture a batch's MoE block as dispatch -> experts -> combine, not the
    eager path's gathered form: the graph pipelines decide that (gather_expert_rows), and ONNX export translates
    those ops."""
    from moecompile import MoEBlock, MoEConfig

    block = MoEBlock(MoEConfig(hidden_size=16, expert_size=8, num_experts=4, top_k=2, gated=True,
                               capacity_factor=0.0)).eval()
    x = torch.randn(512, 16)  # 256 rows per expert: a batch
    with torch.no_grad():
        exported = torch.export.export(block, (x,), strict=False).graph_module
        ((captured, _),) = dynamo_graphs(block, x)
    for gm in (exported, captured):
        assert moe_nodes(gm, "experts") and not moe_nodes(gm, "experts_gathered")
