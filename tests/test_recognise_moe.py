"""The compile pipeline's passes on Dynamo graphs of tiny HF MoE models: recognise_moe, fuse_route_dispatch,
set_capacity, keep_first_projection, each run alone on the graph Dynamo hands a backend and checked against the
graph it rewrote."""
import pytest
import torch
import torch.nn.functional as F
from hf_moe import FAMILIES, MOE_LAYERS, dynamo_graphs, moe_nodes, tiny_moe, token_ids

from moecompile import MoEBlock, MoEConfig
from moecompile.ir import ops
from moecompile.passes.capture import capture
from moecompile.passes.fuse_route_dispatch import fuse_route_dispatch
from moecompile.passes.keep_first_projection import keep_first_projection
from moecompile.passes.pipeline import PIPELINES, GraphCheckError, PassContext, run_pipeline
from moecompile.passes.recognise_moe import recognise_moe
from moecompile.passes.set_capacity import set_capacity


def _outputs(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _assert_same(a, b, rtol=1e-5):
    for x, y in zip(_outputs(a), _outputs(b), strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=rtol * max(1.0, y.abs().max().item()))


EXPECTED = {  # what the report must say about each family's routing and experts
    "tiny-mixtral": ["top-2", "softmax", "renormalised", "silu"],
    "tiny-qwen2-moe": ["top-2", "softmax", "silu"],
    "tiny-qwen3-moe": ["6 experts", "renormalised"],
    "tiny-olmoe": ["softmax", "silu"],
    "tiny-deepseek-v3": ["8 experts", "sigmoid", "renormalised", "correction bias", "2 of 4 groups", "scaled x2.5"],
    "tiny-gpt-oss": ["renormalised", "swiglu_oai (alpha 1.702, limit 7)", "interleaved gate/up", "expert biases"],
}
NOT_EXPECTED = {"tiny-qwen2-moe": ["renormalised"], "tiny-olmoe": ["renormalised"], "tiny-mixtral": ["groups"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_recognise_then_fuse_keep_the_graph_output(family):
    ((gm, inputs),) = dynamo_graphs(tiny_moe(family), token_ids(), use_cache=False)
    with torch.no_grad():
        before = gm(*inputs)
    ctx = PassContext()
    report = recognise_moe(gm, ctx)
    gm.recompile()
    assert len(report["recognised"]) == MOE_LAYERS[family] and not report["rejected"]
    for line in report["recognised"]:
        assert all(word in line for word in EXPECTED[family]), line
        assert not any(word in line for word in NOT_EXPECTED.get(family, [])), line
    assert len(moe_nodes(gm, "experts")) == len(moe_nodes(gm, "dispatch")) == MOE_LAYERS[family]
    with torch.no_grad():
        _assert_same(gm(*inputs), before)
    report = fuse_route_dispatch(gm, ctx)
    gm.recompile()
    assert len(report["fused"]) == MOE_LAYERS[family]
    assert not moe_nodes(gm, "dispatch") and not moe_nodes(gm, "route") and not moe_nodes(gm, "route_grouped")
    assert len(moe_nodes(gm, "route_dispatch")) == MOE_LAYERS[family]
    with torch.no_grad():
        _assert_same(gm(*inputs), before)
    # nothing of HF's routing or grouped matmuls is left
    targets = {str(n.target) for n in gm.graph.nodes}
    assert not any("grouped_mm" in t or t.endswith("histc") for t in targets)


def test_shared_expert_and_its_gate_stay_dense():
    model = tiny_moe("tiny-qwen2-moe")
    ((gm, inputs),) = dynamo_graphs(model, token_ids(), use_cache=False)
    run_pipeline(gm, pipeline="compile")
    scopes = [path for n in gm.graph.nodes for path, _ in (n.meta.get("nn_module_stack") or {}).values()]
    assert any(p.endswith("shared_expert_gate") for p in scopes)
    assert any(".shared_expert." in p for p in scopes)
    assert any(n.op == "call_function" and n.target in (torch.sigmoid, F.sigmoid) for n in gm.graph.nodes)


def test_unknown_expert_activation_is_reported_and_left_alone():
    import transformers

    from moecompile.conversion.models import TINY_MOE

    config, arch = TINY_MOE["tiny-mixtral"]()
    config.hidden_act = "relu2"  # ReLU squared: not an activation the experts op runs
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    ((gm, inputs),) = dynamo_graphs(model, token_ids(), use_cache=False)
    with torch.no_grad():
        before = gm(*inputs)
    gm, ctx = run_pipeline(gm, pipeline="compile")
    report = dict(ctx.reports)["recognise_moe"]
    assert not report["recognised"] and len(report["rejected"]) == 2
    assert all("act_fn is none of the known activations" in r for r in report["rejected"])
    assert not moe_nodes(gm, "experts")
    with torch.no_grad():
        _assert_same(gm(*inputs), before, rtol=0)


def test_dense_model_has_nothing_to_recognise():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=64, vocab_size=128)).eval()
    ((gm, inputs),) = dynamo_graphs(model, token_ids(), use_cache=False)
    nodes = len(gm.graph.nodes)
    gm, ctx = run_pipeline(gm, pipeline="compile")
    assert ctx.checked == "fake"  # every pass's graph was fake-tensor propagated, not only linted
    assert dict(ctx.reports) == {"recognise_moe": {"recognised": [], "rejected": []},
                                 "set_capacity": {"skipped": "off (option capacity_factor=None)"},
                                 "direct_experts": {"direct": []},
                                 "fuse_route_dispatch": {"fused": []},
                                 "insert_fp8": {"skipped": "off (option fp8=None)"},
                                 "insert_all_to_all": {"skipped": "off (option expert_parallel=None)"},
                                 "gather_expert_rows": {"gathered": []},
                                 "keep_first_projection": {"skipped": "inference graph"},
                                 "fuse_projections": {"fused": []},  # no real inputs given
                                 "insert_fp8_linears": {"skipped": "off (option fp8_linears=None)"},
                                 "matvec_fp8_linears": {"skipped": "no FP8 linear"},
                                 "gqa_attention": {"rewritten": []},
                                 "decode_attention": {"skipped": "off (option decode_attention=None)"}}
    assert len(gm.graph.nodes) == nodes


# ------------------------------------------------------------------------------- fuse_route_dispatch, set_capacity

def _block(**overrides):
    torch.manual_seed(0)
    cfg = dict(hidden_size=8, expert_size=6, num_experts=4, top_k=2, gated=True, capacity_factor=0.0)
    cfg.update(overrides)
    block = MoEBlock(MoEConfig(**cfg)).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.5)
    return block


def test_fuse_on_an_exported_moe_block():
    block = _block()
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    gm = capture(block, (x,))
    report = fuse_route_dispatch(gm, PassContext())
    gm.graph.lint()
    gm.recompile()
    assert len(report["fused"]) == 1
    assert len(moe_nodes(gm, "route_dispatch")) == 1 and not moe_nodes(gm, "route")
    assert not [n for n in gm.graph.nodes if "linear" in str(n.target)]  # the router linear went into the op
    torch.testing.assert_close(gm(x), block(x), rtol=1e-5, atol=1e-6)


class _LogitsToo(torch.nn.Module):
    """An MoE layer that also returns its router logits (as an aux loss would use them)."""

    def __init__(self, block, shift_rows=False):
        super().__init__()
        self.block, self.shift_rows = block, shift_rows

    def forward(self, x):
        b = self.block
        logits = F.linear(x.float(), b.router.weight.float())
        weights, ids = ops.route(logits, 2, 0.0, True)
        rows, order, offsets = ops.dispatch(x * 2.0 if self.shift_rows else x, ids, 4)
        y = ops.experts(rows, offsets, b.experts.w_in, None, b.experts.w_out, None, "gelu", True)
        return ops.combine(y, order, weights), logits.logsumexp(-1)


def test_fuse_keeps_logits_used_elsewhere():
    module = _LogitsToo(_block())
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    ((gm, inputs),) = dynamo_graphs(module, x)
    with torch.no_grad():
        before = gm(*inputs)
    gm, ctx = run_pipeline(gm, pipeline="compile")
    assert len(dict(ctx.reports)["fuse_route_dispatch"]["fused"]) == 1
    assert len([n for n in gm.graph.nodes if "linear" in str(n.target)]) == 1  # kept for logsumexp
    with torch.no_grad():
        _assert_same(gm(*inputs), before)


def test_no_fusion_when_dispatch_takes_other_rows():
    module = _LogitsToo(_block(), shift_rows=True)
    ((gm, inputs),) = dynamo_graphs(module, torch.randn(6, 8))
    gm, ctx = run_pipeline(gm, pipeline="compile")
    assert dict(ctx.reports)["fuse_route_dispatch"]["fused"] == []
    assert len(moe_nodes(gm, "route")) == 1


@pytest.mark.parametrize("factor", [1.0, 0.5, -0.5])
def test_set_capacity_equals_the_block_built_with_it(factor):
    dropless = _block()
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(3))
    gm = capture(dropless, (x,))
    report = set_capacity(gm, PassContext(options={"capacity_factor": factor}))
    gm.recompile()
    assert report == {"capacity_factor": factor, "routers": [n.name for n in moe_nodes(gm, "route")]}
    capped = _block(capacity_factor=factor)
    torch.testing.assert_close(gm(x), capped(x), rtol=1e-5, atol=1e-6)
    if factor > 0:
        assert not torch.allclose(capped(x), dropless(x))  # the capacity drops something here


def test_graph_check_catches_a_pass_that_breaks_the_graph():
    ((gm, _),) = dynamo_graphs(tiny_moe("tiny-mixtral"), token_ids(), use_cache=False)

    def truncate_output(gm, ctx):  # a broken pass: returns the first logit row only
        out = next(n for n in gm.graph.nodes if n.op == "output")
        logits = out.args[0][0]
        with gm.graph.inserting_before(out):
            first = gm.graph.call_function(torch.select, (logits, 1, 0))
        out.args = ((first,) + tuple(out.args[0][1:]),)
        return {}

    with pytest.raises(GraphCheckError, match="after truncate_output: outputs changed"):
        run_pipeline(gm, pipeline="compile", passes=[recognise_moe, truncate_output])


def test_compile_pipeline_is_one_ordered_list():
    assert [p.__name__ for p in PIPELINES["compile"]] == ["recognise_moe", "set_capacity", "direct_experts",
                                                          "fuse_route_dispatch", "insert_fp8", "insert_all_to_all",
                                                          "gather_expert_rows", "keep_first_projection",
                                                          "fuse_projections",
                                                          "insert_fp8_linears", "matvec_fp8_linears",
                                                          "gqa_attention", "decode_attention"]
    assert [p.__name__ for p in PIPELINES["convert"]] == ["find_ffn", "moeize", "insert_fp8", "insert_all_to_all"]


@pytest.mark.parametrize("family,kept", [("tiny-mixtral", "experts_combine_train"), ("tiny-gpt-oss", "experts_train")])
def test_keep_first_projection_in_training_graphs_only(family, kept):
    """Each experts node becomes experts_train(...)[0] in a training graph, or with its combine
    experts_combine_train(...)[0] (not for GPT-OSS's activation, which that op does not take): same output, same
    gradients (float32); an inference graph is left alone."""
    ((gm, inputs),) = dynamo_graphs(tiny_moe(family), token_ids(), use_cache=False)
    recognise_moe(gm, PassContext())
    gm.recompile()
    assert dict(keep_first_projection(gm, PassContext())) == {"skipped": "inference graph"}
    assert len(moe_nodes(gm, "experts")) == MOE_LAYERS[family] and not moe_nodes(gm, "experts_train")
    params = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    before = _outputs(gm(*inputs))[0]
    grads_before = torch.autograd.grad(before.square().mean(), params, allow_unused=True)
    report = keep_first_projection(gm, PassContext(training=True))
    gm.graph.lint()
    gm.recompile()
    assert report == {kept: report[kept]} and len(report[kept]) == MOE_LAYERS[family]
    assert len(moe_nodes(gm, kept)) == MOE_LAYERS[family] and not moe_nodes(gm, "experts")
    assert bool(moe_nodes(gm, "combine")) == (kept == "experts_train")
    after = _outputs(gm(*inputs))[0]
    _assert_same(after, before)
    grads_after = torch.autograd.grad(after.square().mean(), params, allow_unused=True)
    assert sum(g is not None for g in grads_after) > 0
    for g, e in zip(grads_after, grads_before):
        assert (g is None) == (e is None)
        if e is not None:
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6 * max(1.0, e.abs().max().item()))
