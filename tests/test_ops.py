"""The moecompile:: custom ops: opcheck, float64 gradcheck, export / compile as single nodes, kernel registry."""
import pytest
import torch

import moecompile
from moecompile import MoEBlock, MoEConfig
from moecompile.kernels import reference as R
from moecompile.runtime import registry
from moecompile.runtime.registry import kernel_for, register_kernel, registered_kernels

OPS = torch.ops.moecompile
OP_NAMES = ("route", "route_backward", "dispatch", "dispatch_backward", "experts", "experts_train", "experts_backward",
            "combine", "combine_backward", "route_grouped", "route_grouped_backward", "route_dispatch",
            "route_dispatch_backward", "experts_combine_train", "experts_combine_backward", "experts_gathered",
            "decode_attention")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32, scale=1.0, requires_grad=False):
    t = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def setup_moe(seed=0, tokens=7, hidden=5, experts=3, inter=4, k=2, cf=1.0, renormalize=True, gated=False,
              bias_in=True, bias_out=True, dtype=torch.float32, requires_grad=False):
    """Realistic op arguments, produced by running the reference pipeline."""
    g = gen(seed)
    f = 2 * inter if gated else inter
    logits = randn(g, tokens, experts, dtype=dtype, scale=2.0)
    x = randn(g, tokens, hidden, dtype=dtype)
    w_in = randn(g, experts, f, hidden, dtype=dtype, scale=0.5)
    w_out = randn(g, experts, hidden, inter, dtype=dtype, scale=0.5)
    b_in = randn(g, experts, f, dtype=dtype, scale=0.5) if bias_in else None
    b_out = randn(g, experts, hidden, dtype=dtype, scale=0.5) if bias_out else None
    weights, ids = R.route(logits, k, cf, renormalize)
    rows, order, offsets = R.dispatch(x, ids, experts)
    y = R.experts(rows, offsets, w_in, b_in, w_out, b_out, "gelu", gated)
    d = dict(logits=logits, x=x, w_in=w_in, w_out=w_out, b_in=b_in, b_out=b_out, weights=weights.to(dtype), ids=ids,
             rows=rows, order=order, offsets=offsets, y=y, k=k, cf=cf, renormalize=renormalize, gated=gated,
             tokens=tokens, experts=experts, hidden=hidden, g=g)
    if requires_grad:
        for name in ("logits", "x", "w_in", "w_out", "b_in", "b_out", "weights", "rows", "y"):
            if d[name] is not None:
                d[name] = d[name].detach().clone().requires_grad_()
    return d


def count_moe_nodes(graph):
    counts = {}
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target.namespace == "moecompile":
            name = node.target._opname
            counts[name] = counts.get(name, 0) + 1
    return counts


# --------------------------------------------------------------------------------------------------- opcheck
# The *_backward ops have no autograd formula of their own (no double backward), so their opcheck runs on
# inputs that do not require grad.

@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("cf", [0.0, 0.5])
def test_opcheck_route(renormalize, cf):
    d = setup_moe(1, cf=cf, renormalize=renormalize, requires_grad=True)
    torch.library.opcheck(OPS.route.default, (d["logits"], d["k"], cf, renormalize))


@pytest.mark.parametrize("renormalize", [True, False])
def test_opcheck_route_backward(renormalize):
    d = setup_moe(2, cf=0.5, renormalize=renormalize)
    grad_w = randn(d["g"], d["tokens"], d["k"])
    torch.library.opcheck(OPS.route_backward.default, (grad_w, d["logits"], d["ids"], d["k"], renormalize))


def test_opcheck_dispatch():
    d = setup_moe(3, cf=0.5, requires_grad=True)
    torch.library.opcheck(OPS.dispatch.default, (d["x"], d["ids"], d["experts"]))


def test_opcheck_dispatch_backward():
    d = setup_moe(4, cf=0.5)
    grad_rows = randn(d["g"], d["tokens"] * d["k"], d["hidden"])
    torch.library.opcheck(OPS.dispatch_backward.default, (grad_rows, d["order"], d["tokens"], d["k"]))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias_in,bias_out", [(True, True), (False, False), (True, False), (False, True)])
def test_opcheck_experts(gated, bias_in, bias_out):
    d = setup_moe(5, gated=gated, bias_in=bias_in, bias_out=bias_out, requires_grad=True)
    torch.library.opcheck(OPS.experts.default, (d["rows"], d["offsets"], d["w_in"], d["b_in"], d["w_out"],
                                                d["b_out"], "silu", gated))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias_in,bias_out", [(True, True), (False, False)])
def test_opcheck_experts_backward(gated, bias_in, bias_out):
    d = setup_moe(6, gated=gated, bias_in=bias_in, bias_out=bias_out)
    grad_y = randn(d["g"], *d["y"].shape)
    torch.library.opcheck(OPS.experts_backward.default, (grad_y, d["rows"], d["offsets"], d["w_in"], d["b_in"],
                                                         d["w_out"], "gelu", gated, bias_out))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias_in,bias_out", [(True, True), (False, False)])
def test_opcheck_experts_train(gated, bias_in, bias_out):
    d = setup_moe(56, gated=gated, bias_in=bias_in, bias_out=bias_out, requires_grad=True)
    torch.library.opcheck(OPS.experts_train.default, (d["rows"], d["offsets"], d["w_in"], d["b_in"], d["w_out"],
                                                      d["b_out"], "silu", gated))


def test_opcheck_experts_backward_with_kept_h():
    d = setup_moe(57, gated=True)
    _, h = OPS.experts_train(d["rows"], d["offsets"], d["w_in"], d["b_in"], d["w_out"], d["b_out"], "gelu", True)
    grad_y = randn(d["g"], *d["y"].shape)
    torch.library.opcheck(OPS.experts_backward.default, (grad_y, d["rows"], d["offsets"], d["w_in"], d["b_in"],
                                                         d["w_out"], "gelu", True, True), {"h": h})


@pytest.mark.parametrize("interleaved", [False, True])
def test_expert_ffn_keeps_h_only_when_autograd_needs_it(moe_op_log, interleaved):
    """expert_ffn: experts under no_grad, experts_train when autograd will run the backward, with the same
    output and the same gradients (float64) as experts, whose backward recomputes h."""
    d = setup_moe(58, gated=True, dtype=torch.float64, requires_grad=True)
    args = (d["rows"], d["offsets"], d["w_in"], d["b_in"], d["w_out"], d["b_out"], "swiglu_oai", True, interleaved)
    with torch.no_grad(), moe_op_log() as log:
        moecompile.ir.ops.expert_ffn(*args)
    assert log.names == ["moecompile::experts"]
    with moe_op_log() as log:
        y = moecompile.ir.ops.expert_ffn(*args)
    assert log.names == ["moecompile::experts_train"]
    params = [d[n] for n in ("rows", "w_in", "b_in", "w_out", "b_out")]
    grad_y = randn(d["g"], *y.shape, dtype=torch.float64)
    with moe_op_log() as log:
        got = torch.autograd.grad(y, params, grad_y)
    assert log.names == ["moecompile::experts_backward"]
    want = torch.autograd.grad(OPS.experts(*args), params, grad_y)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias_in,bias_out", [(True, True), (False, False)])
def test_opcheck_experts_combine(gated, bias_in, bias_out):
    d = setup_moe(59, cf=0.5, gated=gated, bias_in=bias_in, bias_out=bias_out, requires_grad=True)
    args = (d["rows"], d["offsets"], d["order"], d["weights"], d["w_in"], d["b_in"], d["w_out"], d["b_out"], "silu",
            gated)
    torch.library.opcheck(OPS.experts_combine_train.default, args)
    out, h, y = OPS.experts_combine_train(*args)
    grad_out = randn(d["g"], *out.shape)
    torch.library.opcheck(OPS.experts_combine_backward.default, (
        grad_out, d["rows"].detach(), d["offsets"], d["order"], d["weights"].detach(), d["w_in"].detach(),
        None if d["b_in"] is None else d["b_in"].detach(), d["w_out"].detach(), "silu", gated, bias_out, h, y))


@pytest.mark.parametrize("reads_y", [True, False])
def test_experts_combine_keeps_y_only_for_a_backward_that_reads_it(isolated_registry, reads_y):
    """The forward saves the expert rows y [N, H] only where the device's experts_combine_backward will read them
    (experts_combine_backward_reads_y); a folding backward (here the reference, recomputing y, standing in for one)
    gets an empty y and gives the same gradients."""
    d = setup_moe(61, cf=0.5, gated=True, dtype=torch.float64, requires_grad=True)
    args = (d["rows"], d["offsets"], d["order"], d["weights"], d["w_in"], d["b_in"], d["w_out"], d["b_out"], "silu",
            True)

    def folding_backward(grad_out, x, offsets, order, weights, w_in, b_in, w_out, activation, gated, has_b_out, h,
                         y):
        assert y.numel() == 0
        y = R.experts(x, offsets, w_in, b_in, w_out, None, activation, gated)
        return R.experts_combine_backward(grad_out, x, offsets, order, weights, w_in, b_in, w_out, activation, gated,
                                          has_b_out, h, y)

    register_kernel("experts_combine_backward_reads_y", "cpu", lambda *a: reads_y)
    register_kernel("experts_combine_backward", "cpu", R.experts_combine_backward if reads_y else folding_backward)
    args = args[:7] + (None,) + args[8:]  # a folding backward takes no output bias
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.data_ptr()) or t, lambda t: t):
        out, _, y = OPS.experts_combine_train(*args)
    assert (y.data_ptr() in saved) is reads_y
    params = [d[n] for n in ("rows", "weights", "w_in", "b_in", "w_out")]
    grad_out = randn(d["g"], *out.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, params, grad_out)
    want = torch.autograd.grad(OPS.combine(OPS.experts(*args[:2], *args[4:]), d["order"], d["weights"]), params,
                               grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("activation,interleaved,fused", [("silu", False, True), ("swiglu_oai", True, False)])
def test_expert_ffn_combine_is_one_op_in_eager_training(moe_op_log, activation, interleaved, fused):
    """expert_ffn_combine: experts_combine_train when autograd will run the backward (not for GPT-OSS's activation
    arguments), experts + combine under no_grad; the same output and the same gradients (float64, dropped slots
    included) as combine(experts(...)), routing weights' included."""
    d = setup_moe(60, cf=0.5, gated=True, dtype=torch.float64, requires_grad=True)
    args = (d["rows"], d["offsets"], d["order"], d["weights"], d["w_in"], d["b_in"], d["w_out"], d["b_out"],
            activation, True, interleaved)
    with torch.no_grad(), moe_op_log() as log:
        moecompile.ir.ops.expert_ffn_combine(*args)
    assert log.names == ["moecompile::experts", "moecompile::combine"]
    with moe_op_log() as log:
        out = moecompile.ir.ops.expert_ffn_combine(*args)
    assert log.names == (["moecompile::experts_combine_train"] if fused
                         else ["moecompile::experts_train", "moecompile::combine"])
    params = [d[n] for n in ("rows", "weights", "w_in", "b_in", "w_out", "b_out")]
    grad_out = randn(d["g"], *out.shape, dtype=torch.float64)
    with moe_op_log() as log:
        got = torch.autograd.grad(out, params, grad_out)
    if fused:
        assert log.names == ["moecompile::experts_combine_backward"]
    want_out = OPS.combine(OPS.experts(*args[:2], *args[4:]), d["order"], d["weights"])
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-10)
    want = torch.autograd.grad(want_out, params, grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_opcheck_combine():
    d = setup_moe(7, cf=0.5, requires_grad=True)
    torch.library.opcheck(OPS.combine.default, (d["y"], d["order"], d["weights"]))


def test_opcheck_combine_backward():
    d = setup_moe(8, cf=0.5)
    grad_out = randn(d["g"], d["tokens"], d["hidden"])
    torch.library.opcheck(OPS.combine_backward.default, (grad_out, d["y"], d["order"], d["weights"]))


def test_all_ops_registered():
    for name in OP_NAMES:
        assert isinstance(getattr(OPS, name).default, torch._ops.OpOverload)


def test_experts_backward_op_returns_empty_tensors_for_missing_biases():
    d = setup_moe(9, bias_in=False, bias_out=False)
    grads = OPS.experts_backward(torch.ones_like(d["y"]), d["rows"], d["offsets"], d["w_in"], None, d["w_out"],
                                 "gelu", False, False)
    assert len(grads) == 5
    assert grads[2].numel() == 0 and grads[4].numel() == 0
    assert grads[0].shape == d["rows"].shape and grads[1].shape == d["w_in"].shape
    assert grads[3].shape == d["w_out"].shape


# opcheck of the additions for HF routers and experts: DeepSeek-V3 routing, GPT-OSS experts, the fused router op

def grouped_args(d, scoring="sigmoid", bias=True):
    corr = randn(d["g"], d["experts"], scale=0.3) if bias else None
    return (scoring, corr, 2, 1, 2.5) if d["experts"] % 2 == 0 else (scoring, corr, 1, 1, 2.5)


@pytest.mark.parametrize("scoring,bias", [("sigmoid", True), ("softmax", False)])
@pytest.mark.parametrize("cf", [0.0, 0.5])
def test_opcheck_route_grouped(scoring, bias, cf):
    d = setup_moe(50, experts=4, cf=cf, requires_grad=True)
    torch.library.opcheck(OPS.route_grouped.default, (d["logits"], 2, cf, True, *grouped_args(d, scoring, bias)))


def test_opcheck_route_grouped_defaults():
    d = setup_moe(51, experts=4, requires_grad=True)
    torch.library.opcheck(OPS.route_grouped.default, (d["logits"], 2, 0.0, False))


@pytest.mark.parametrize("renormalize", [True, False])
def test_opcheck_route_grouped_backward(renormalize):
    d = setup_moe(52, experts=4, cf=0.5)
    args = grouped_args(d)
    _, ids = OPS.route_grouped(d["logits"], 2, 0.5, renormalize, *args)
    grad_w = randn(d["g"], d["tokens"], 2)
    torch.library.opcheck(OPS.route_grouped_backward.default, (grad_w, d["logits"], ids, 2, renormalize, *args))


@pytest.mark.parametrize("act,interleaved", [("swiglu_oai", True), ("silu", True), ("swiglu_oai", False)])
def test_opcheck_experts_glu(act, interleaved):
    d = setup_moe(53, gated=True, requires_grad=True)
    torch.library.opcheck(OPS.experts.default, (d["rows"], d["offsets"], d["w_in"], d["b_in"], d["w_out"],
                                                d["b_out"], act, True, interleaved, 1.3, 2.0))


def test_opcheck_experts_backward_glu():
    d = setup_moe(54, gated=True)
    grad_y = randn(d["g"], *d["y"].shape)
    torch.library.opcheck(OPS.experts_backward.default, (grad_y, d["rows"], d["offsets"], d["w_in"], d["b_in"],
                                                         d["w_out"], "swiglu_oai", True, True, True, 1.3, 2.0))


@pytest.mark.parametrize("router_bias,logits_fp32", [(True, False), (False, True)])
def test_opcheck_route_dispatch(router_bias, logits_fp32):
    d = setup_moe(55, experts=4, cf=0.5, requires_grad=True)
    weight = randn(d["g"], 4, d["hidden"], requires_grad=True)
    bias = randn(d["g"], 4, requires_grad=True) if router_bias else None
    torch.library.opcheck(OPS.route_dispatch.default, (d["x"], weight, bias, 2, 0.5, True, *grouped_args(d),
                                                       logits_fp32))


def test_opcheck_route_dispatch_backward():
    d = setup_moe(56, experts=4, cf=0.5)
    weight, bias = randn(d["g"], 4, d["hidden"]), randn(d["g"], 4)
    args = grouped_args(d)
    weights, ids, rows, order, _ = OPS.route_dispatch(d["x"], weight, bias, 2, 0.5, True, *args, False)
    torch.library.opcheck(OPS.route_dispatch_backward.default,
                          (randn(d["g"], *weights.shape), randn(d["g"], *rows.shape), d["x"], weight, bias, ids,
                           order, 2, True, *args, False))


def test_gradcheck_route_grouped():
    g = gen(57)
    tokens, experts = 6, 8
    # well separated logits keep the selection fixed under the finite-difference perturbation
    logits = (torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]).double() * 0.7
              + torch.rand(tokens, experts, generator=g, dtype=torch.float64) * 0.1).requires_grad_()
    corr = torch.linspace(-0.01, 0.01, experts)
    assert torch.autograd.gradcheck(lambda lg: OPS.route_grouped(lg, 3, 0.5, True, "sigmoid", corr, 4, 2, 2.5)[0],
                                    (logits,), eps=1e-3, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("interleaved", [True, False])
def test_gradcheck_experts_swiglu_oai(interleaved):
    d = setup_moe(58, cf=0.5, gated=True, dtype=torch.float64, requires_grad=True)
    offsets = d["offsets"]
    assert torch.autograd.gradcheck(
        lambda x, wi, bi, wo, bo: OPS.experts(x, offsets, wi, bi, wo, bo, "swiglu_oai", True, interleaved, 1.3, 2.0),
        (d["rows"], d["w_in"], d["b_in"], d["w_out"], d["b_out"]))


def test_gradcheck_route_dispatch():
    g = gen(59)
    tokens, hidden, experts = 5, 4, 4
    x = randn(g, tokens, hidden, dtype=torch.float64, requires_grad=True)
    weight = randn(g, experts, hidden, dtype=torch.float64, requires_grad=True)
    bias = randn(g, experts, dtype=torch.float64, requires_grad=True)

    def fused(x, w, b):
        weights, _, rows, _, _ = OPS.route_dispatch(x, w, b, 2, 0.0, True, "softmax", None, 1, 1, 1.0, False)
        return weights.double().sum(-1, keepdim=True) * 0.3 + rows.sum()

    assert torch.autograd.gradcheck(fused, (x, weight, bias), eps=1e-3, atol=2e-3, rtol=1e-2)


def test_fused_and_unfused_ops_agree_with_grads():
    d = setup_moe(60, experts=4, gated=True, requires_grad=True)
    weight = randn(d["g"], 4, d["hidden"], requires_grad=True)
    args = ("sigmoid", randn(d["g"], 4, scale=0.3), 2, 1, 2.5)

    def unfused(x, w):
        weights, ids = OPS.route_grouped(torch.nn.functional.linear(x.float(), w.float()), 2, 0.0, True, *args)
        rows, order, offsets = OPS.dispatch(x, ids, 4)
        return OPS.combine(OPS.experts(rows, offsets, d["w_in"], None, d["w_out"], None, "silu", True), order,
                           weights)

    def fused(x, w):
        weights, _, rows, order, offsets = OPS.route_dispatch(x, w, None, 2, 0.0, True, *args, True)
        return OPS.combine(OPS.experts(rows, offsets, d["w_in"], None, d["w_out"], None, "silu", True), order,
                           weights)

    g = randn(d["g"], d["tokens"], d["hidden"])
    out_u, out_f = unfused(d["x"], weight), fused(d["x"], weight)
    torch.testing.assert_close(out_f, out_u, atol=1e-6, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(out_f, (d["x"], weight), g), torch.autograd.grad(out_u, (d["x"], weight), g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ float64 gradcheck

@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("cf", [0.0, 0.5])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_gradcheck_route(renormalize, cf, k):
    # route's weights are float32 by contract (the fake says so), so the finite differences need a larger eps.
    # Well-separated logits keep the top-k selection (and the drops) fixed under the perturbation.
    g = gen(20 + k)
    tokens, experts = 6, 4
    logits = (torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]).double() * 0.7
              + torch.rand(tokens, experts, generator=g, dtype=torch.float64) * 0.1).requires_grad_()
    _, ids = OPS.route(logits.detach(), k, cf, renormalize)
    if cf and k > 1:
        assert torch.any(ids == experts)
    assert torch.autograd.gradcheck(lambda lg: OPS.route(lg, k, cf, renormalize)[0], (logits,),
                                    eps=1e-3, atol=2e-4, rtol=1e-3)


def test_route_grad_matches_softmax_topk_autograd():
    d = setup_moe(21, cf=0.0, requires_grad=True)
    w, _ = OPS.route(d["logits"], d["k"], 0.0, True)
    g = randn(d["g"], *w.shape)
    (got,) = torch.autograd.grad(w, d["logits"], g)
    lg = d["logits"].detach().clone().requires_grad_()
    p, _ = torch.softmax(lg, -1).topk(d["k"], -1)
    (expected,) = torch.autograd.grad(p / p.sum(-1, keepdim=True), lg, g)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cf", [0.0, 0.5])
def test_gradcheck_dispatch(cf):
    d = setup_moe(22, cf=cf, dtype=torch.float64)
    x = d["x"].detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda h: OPS.dispatch(h, d["ids"], d["experts"])[0], (x,))


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("gated", [False, True])
def test_gradcheck_experts(act, gated):
    d = setup_moe(23, cf=0.5, gated=gated, dtype=torch.float64, requires_grad=True)
    offsets = d["offsets"]
    assert int(offsets[-1]) < d["rows"].shape[0]  # some dropped rows too
    assert torch.autograd.gradcheck(
        lambda x, wi, bi, wo, bo: OPS.experts(x, offsets, wi, bi, wo, bo, act, gated),
        (d["rows"], d["w_in"], d["b_in"], d["w_out"], d["b_out"]))


@pytest.mark.parametrize("gated", [False, True])
def test_gradcheck_experts_without_biases(gated):
    d = setup_moe(24, gated=gated, bias_in=False, bias_out=False, dtype=torch.float64, requires_grad=True)
    offsets = d["offsets"]
    assert torch.autograd.gradcheck(lambda x, wi, wo: OPS.experts(x, offsets, wi, None, wo, None, "silu", gated),
                                    (d["rows"], d["w_in"], d["w_out"]))


@pytest.mark.parametrize("cf", [0.0, 0.5])
def test_gradcheck_combine(cf):
    d = setup_moe(25, cf=cf, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, w: OPS.combine(y, d["order"], w), (d["y"], d["weights"]))


def test_gradcheck_through_whole_pipeline():
    # x, expert weights (float64) and logits (through the float32 route) all at once, with loose tolerances
    d = setup_moe(26, cf=0.0, gated=True, dtype=torch.float64, requires_grad=True)
    logits = (torch.stack([torch.randperm(3, generator=d["g"]) for _ in range(7)]).double() * 0.7
              ).requires_grad_()

    def moe(x, lg, wi, bi, wo, bo):
        w, ids = OPS.route(lg, 2, 0.0, True)
        rows, order, offsets = OPS.dispatch(x, ids, 3)
        return OPS.combine(OPS.experts(rows, offsets, wi, bi, wo, bo, "gelu", True), order, w.double())

    assert torch.autograd.gradcheck(moe, (d["x"], logits, d["w_in"], d["b_in"], d["w_out"], d["b_out"]),
                                    eps=1e-3, atol=2e-3, rtol=1e-2, fast_mode=True)


# ------------------------------------------------------------------------------------------- export / compile

def small_block(**overrides):
    torch.manual_seed(0)
    cfg = dict(hidden_size=8, expert_size=6, num_experts=4, top_k=2, gated=True, bias_in=True, bias_out="expert")
    cfg.update(overrides)
    block = MoEBlock(MoEConfig(**cfg))
    with torch.no_grad():  # larger weights than the 0.02 init, so that outputs are not all ~0
        for p in block.parameters():
            p.normal_(0.0, 0.5)
    return block


@pytest.mark.parametrize("overrides", [{}, {"capacity_factor": 1.0, "gate_weighting": "unit"},
                                       {"gated": False, "bias_in": False, "bias_out": "shared"}])
def test_export_keeps_ops_as_single_nodes(overrides):
    block = small_block(**overrides).eval()
    x = torch.randn(2, 5, 8, generator=gen(30))
    ep = torch.export.export(block, (x,), strict=False)
    expected = {"route": 1, "dispatch": 1, "experts": 1, "combine": 1}
    assert count_moe_nodes(ep.graph) == expected
    torch.testing.assert_close(ep.module()(x), block(x), atol=1e-5, rtol=1e-5)
    decomposed = ep.run_decompositions()
    assert count_moe_nodes(decomposed.graph) == expected
    torch.testing.assert_close(decomposed.module()(x), block(x), atol=1e-5, rtol=1e-5)


def test_export_with_dynamic_token_count():
    block = small_block().eval()
    x = torch.randn(2, 5, 8, generator=gen(31))
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(block, (x,), dynamic_shapes={"hidden_states": {0: batch}}, strict=False)
    assert count_moe_nodes(ep.graph) == {"route": 1, "dispatch": 1, "experts": 1, "combine": 1}
    x2 = torch.randn(3, 5, 8, generator=gen(32))
    torch.testing.assert_close(ep.module()(x2), block(x2), atol=1e-5, rtol=1e-5)


def test_compile_forward_and_backward_graphs_hold_single_op_nodes():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    block = small_block().eval()
    x = torch.randn(2, 3, 8, generator=gen(33), requires_grad=True)
    backend = aot_autograd(fw_compiler=capture("fw"), bw_compiler=capture("bw"))
    out = torch.compile(block, backend=backend, fullgraph=True)(x)
    out.square().sum().backward()
    torch._dynamo.reset()
    assert count_moe_nodes(graphs["fw"].graph) == {"route": 1, "dispatch": 1, "experts": 1, "combine": 1}
    assert count_moe_nodes(graphs["bw"].graph) == {"route_backward": 1, "dispatch_backward": 1,
                                                   "experts_backward": 1, "combine_backward": 1}
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("train", [False, True])
def test_compile_aot_eager_matches_eager(train):
    torch._dynamo.reset()
    block = small_block(capacity_factor=1.0).train(train)
    x = torch.randn(2, 6, 8, generator=gen(34))
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out_c = compiled(x)
    aux_c = block.aux_loss
    out_e = block(x)
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    if train:
        torch.testing.assert_close(aux_c, block.aux_loss, atol=1e-6, rtol=1e-5)
        g = torch.randn(out_e.shape, generator=gen(35))
        params = list(block.parameters())
        grads_c = torch.autograd.grad(compiled(x), params, g)
        grads_e = torch.autograd.grad(block(x), params, g)
        for gc, ge in zip(grads_c, grads_e):
            torch.testing.assert_close(gc, ge, atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------- registry

@pytest.fixture
def isolated_registry(monkeypatch):
    """Only the reference kernels; anything a test registers disappears with the fixture."""
    monkeypatch.setattr(registry, "_KERNELS", {k: v for k, v in registry._KERNELS.items() if k[1] == "reference"})
    monkeypatch.delenv("MOECOMPILE_KERNELS", raising=False)
    return registry._KERNELS


def test_reference_kernels_registered_for_every_op():
    kernels = registered_kernels()
    for name in OP_NAMES:
        assert kernels[(name, "reference")] is getattr(R, name)


def test_registered_kernels_is_a_copy(isolated_registry):
    snapshot = registered_kernels()
    snapshot[("route", "cpu")] = lambda *a: None
    assert ("route", "cpu") not in isolated_registry


def test_kernel_for_falls_back_to_reference(isolated_registry):
    for name in OP_NAMES:
        for device in ("cpu", torch.device("cpu"), "meta"):
            assert kernel_for(name, device) is getattr(R, name)


def test_cuda_kernels_load_on_first_use_and_reference_can_be_forced(monkeypatch):
    from moecompile.runtime import cuda as C
    from moecompile.runtime import fp8

    for name in ("route", "route_backward", "route_grouped", "route_grouped_backward", "dispatch", "route_dispatch",
                 "route_dispatch_backward", "experts", "experts_gathered", "experts_backward", "combine",
                 "combine_backward", "dispatch_backward", "decode_attention"):
        assert kernel_for(name, "cuda") is getattr(C, name)
    for name in ("quantize_fp8", "experts_fp8", "routed_experts_fp8", "linear_fp8"):
        assert kernel_for(name, "cuda") is getattr(fp8, name)
    monkeypatch.setenv("MOECOMPILE_KERNELS", "reference")
    assert kernel_for("experts", "cuda") is R.experts


def test_kernel_for_unknown_op(isolated_registry):
    with pytest.raises(KeyError):
        kernel_for("no_such_op", "cpu")


def _counting(fn, calls):
    def kernel(*args):
        calls.append(fn.__name__)
        return fn(*args)
    return kernel


def test_register_kernel_takes_precedence_for_its_device(isolated_registry):
    calls = []
    cuda_combine = kernel_for("combine", "cuda")  # the reference, or the CUDA module's where triton imports
    fn = register_kernel("combine", "cpu", _counting(R.combine, calls))
    assert kernel_for("combine", "cpu") is fn
    assert kernel_for("combine", "cuda") is cuda_combine  # other device types keep theirs
    assert kernel_for("route", "cpu") is R.route  # other ops too
    d = setup_moe(40)
    out = OPS.combine(d["y"], d["order"], d["weights"])
    assert calls == ["combine"]
    torch.testing.assert_close(out, R.combine(d["y"], d["order"], d["weights"]), atol=0, rtol=0)


def test_register_kernel_as_decorator(isolated_registry):
    calls = []

    @register_kernel("route", "cpu")
    def my_route(logits, top_k, cf, renorm):
        calls.append(1)
        return R.route(logits, top_k, cf, renorm)

    assert kernel_for("route", "cpu") is my_route
    OPS.route(torch.randn(3, 4), 2, 0.0, True)
    assert calls == [1]


def test_env_forces_reference(isolated_registry, monkeypatch):
    calls = []
    register_kernel("combine", "cpu", _counting(R.combine, calls))
    monkeypatch.setenv("MOECOMPILE_KERNELS", "reference")
    assert kernel_for("combine", "cpu") is R.combine
    d = setup_moe(41)
    OPS.combine(d["y"], d["order"], d["weights"])
    assert calls == []
    monkeypatch.setenv("MOECOMPILE_KERNELS", "other")
    assert kernel_for("combine", "cpu") is not R.combine


def test_registry_tests_leave_nothing_behind():
    # runs after the registry tests in file order: no kernel they registered survives the fixture
    assert all(fn.__module__ != __name__ for fn in registered_kernels().values())
    assert kernel_for("combine", "cpu") is registered_kernels().get(("combine", "cpu"), R.combine)
    assert len(moecompile.ir.ops.MOE_OPS) == 4


def test_eight_argument_experts_kernels_keep_serving_standard_calls(isolated_registry):
    calls = []

    @register_kernel("experts", "cpu")
    def original_contract(x, offsets, w_in, b_in, w_out, b_out, activation, gated):
        calls.append(activation)
        return R.experts(x, offsets, w_in, b_in, w_out, b_out, activation, gated)

    d = setup_moe(61, gated=True)
    OPS.experts(d["rows"], d["offsets"], d["w_in"], d["b_in"], d["w_out"], d["b_out"], "silu", True)
    assert calls == ["silu"]
    # GPT-OSS's experts need the three trailing arguments: that kernel cannot take them, the reference runs
    args = (d["rows"], d["offsets"], d["w_in"], d["b_in"], d["w_out"], d["b_out"], "swiglu_oai", True, True, 1.3, 2.0)
    torch.testing.assert_close(OPS.experts(*args), R.experts(*args), rtol=0, atol=0)
    assert calls == ["silu"]
