"""MoEBlock and MoEConfig against a naive per-token MoE written in the test."""
import math

import pytest
import torch
import torch.nn.functional as F
from naive import naive_act
from torch import nn

import moecompile
from moecompile import MoEBlock, MoECompileError, MoEConfig
from moecompile.ir.block import aux_loss

ATOL, RTOL = 1e-5, 1e-4


def gen(seed):
    return torch.Generator().manual_seed(seed)


def naive_expert(block, e, v):
    c, ex = block.config, block.experts
    h = ex.w_in[e] @ v
    if ex.b_in is not None:
        h = h + ex.b_in[e]
    if c.gated:
        a = naive_act(c.activation, h[:c.expert_size]) * h[c.expert_size:]
    else:
        a = naive_act(c.activation, h)
    y = ex.w_out[e] @ a
    if ex.b_out is not None:
        y = y + ex.b_out[e]
    return y


def naive_selection(logits, k, cf):
    """Top-k ids per token (python sort of the softmax) and the slot-major capacity drops (True = kept)."""
    tokens, experts = logits.shape
    ids = [sorted(range(experts), key=lambda e: -F.softmax(logits[t], -1)[e].item())[:k] for t in range(tokens)]
    kept = [[True] * k for _ in range(tokens)]
    if cf != 0:
        cap = math.ceil(abs(cf) * tokens * k / experts)
        load = [0] * experts
        for j in range(k):
            for t in range(tokens):
                if load[ids[t][j]] < cap:
                    load[ids[t][j]] += 1
                else:
                    kept[t][j] = False
    return ids, kept


def naive_block(block, x, top_k=None, capacity_factor=None):
    """Per-token MoE straight from the block's parameters (differentiable w.r.t. all of them)."""
    c = block.config
    k = c.top_k if top_k is None else top_k
    cf = c.capacity_factor if capacity_factor is None else capacity_factor
    xs = x.reshape(-1, x.shape[-1])
    logits = xs @ block.router.weight.t()
    ids, kept = naive_selection(logits.detach(), k, cf)
    outs = []
    for t in range(xs.shape[0]):
        p = F.softmax(logits[t], -1)
        ws = p[ids[t]]
        if c.renormalize:
            ws = ws / ws.sum()
        acc = torch.zeros(xs.shape[-1])
        for j in range(k):
            if not kept[t][j]:
                continue
            w = ws[j]
            if c.gate_weighting == "unit":
                w = w - w.detach() + 1.0
            acc = acc + w * naive_expert(block, ids[t][j], xs[t])
        if block.bias is not None:
            acc = acc + block.bias
        outs.append(acc)
    return torch.stack(outs).reshape(x.shape)


def make_block(seed=0, **overrides):
    cfg = dict(hidden_size=6, expert_size=5, num_experts=4, top_k=2)
    cfg.update(overrides)
    torch.manual_seed(seed)
    block = MoEBlock(MoEConfig(**cfg))
    with torch.no_grad():  # O(1) weights so that every term matters at float32 tolerances
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen(seed + p.numel())) * 0.5)
    return block


def hidden(seed, *shape):
    return torch.randn(*shape, generator=gen(seed))


# ----------------------------------------------------------------------------------------------------- forward

@pytest.mark.parametrize("shape", [(2, 5, 6), (7, 6), (1, 1, 3, 6), (1, 6)])
def test_output_shape_and_dtype(shape):
    block = make_block().eval()
    out = block(hidden(1, *shape))
    assert out.shape == shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_zero_tokens_eval():
    block = make_block().eval()
    assert block(torch.zeros(0, 6)).shape == (0, 6)
    assert block(torch.zeros(2, 0, 6)).shape == (2, 0, 6)


CONFIGS = [
    dict(),
    dict(gated=True, activation="silu", bias_in=True, bias_out="expert"),
    dict(activation="relu", bias_out="shared", renormalize=False),
    dict(activation="gelu_tanh", gate_weighting="unit", bias_in=True, capacity_factor=0.5),
    dict(gated=True, top_k=3, capacity_factor=-0.6, bias_out="expert", renormalize=False),
    dict(num_experts=1, top_k=1, bias_in=True, bias_out="expert"),
    dict(hidden_size=5, expert_size=9, num_experts=3, top_k=3, gated=True, gate_weighting="unit"),
]


@pytest.mark.parametrize("overrides", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_forward_and_grads_match_naive(overrides):
    block = make_block(3, **overrides).eval()
    h = block.config.hidden_size
    x = hidden(4, 2, 5, h).requires_grad_()
    out = block(x)
    expected = naive_block(block, x)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    g = hidden(5, *out.shape)
    params = dict(block.named_parameters())
    got = torch.autograd.grad(out, [x, *params.values()], g)
    want = torch.autograd.grad(expected, [x, *params.values()], g, allow_unused=True)
    for name, a, b in zip(["x", *params], got, want):
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("overrides", [dict(gated=True, bias_in=True, bias_out="expert"),
                                       dict(bias_in=True, bias_out="shared", gate_weighting="unit")])
def test_gradients_reach_every_parameter(overrides):
    block = make_block(6, **overrides).train()
    x = hidden(7, 3, 4, 6)
    out = block(x)
    (out * hidden(8, *out.shape)).sum().backward()
    names = {n for n, _ in block.named_parameters()}
    assert "router.weight" in names and "experts.w_in" in names and "experts.w_out" in names
    assert any("b_in" in n for n in names)
    assert any(n.endswith("b_out") or n == "bias" for n in names)
    for name, p in block.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


# ------------------------------------------------------------------------------------------- per-call overrides

def test_top_k_override_equals_sum_of_all_experts_with_unit_weights():
    block = make_block(10, top_k=1, gate_weighting="unit", bias_in=True, bias_out="expert").eval()
    x = hidden(11, 5, 6)
    out = block(x, top_k=4)
    expected = torch.stack([sum(naive_expert(block, e, x[t]) for e in range(4)) for t in range(5)])
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert not torch.allclose(block(x), out, atol=1e-3)  # the config's top_k=1 is different
    torch.testing.assert_close(block(x), naive_block(block, x), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
def test_top_k_override_matches_naive(top_k):
    block = make_block(12, top_k=2).eval()
    x = hidden(13, 6, 6)
    torch.testing.assert_close(block(x, top_k=top_k), naive_block(block, x, top_k=top_k), atol=ATOL, rtol=RTOL)
    assert block.config.top_k == 2  # the override does not stick


def test_capacity_factor_override():
    block = make_block(14, top_k=1).eval()
    x = hidden(15, 16, 6)
    dropless = block(x)
    torch.testing.assert_close(block(x, capacity_factor=0.0), dropless, atol=0, rtol=0)
    tight = block(x, capacity_factor=0.25)  # capacity ceil(0.25 * 16 / 4) = 1 token per expert
    torch.testing.assert_close(tight, naive_block(block, x, capacity_factor=0.25), atol=ATOL, rtol=RTOL)
    zero_rows = int((tight.abs().sum(-1) == 0).sum())
    assert zero_rows >= 16 - 4  # at most one token per expert survives
    torch.testing.assert_close(block(x, capacity_factor=-0.25), tight, atol=0, rtol=0)
    # generous capacity: nothing dropped
    torch.testing.assert_close(block(x, capacity_factor=4.0), dropless, atol=0, rtol=0)
    assert block.config.capacity_factor == 0.0


def test_capacity_factor_override_to_dropless():
    block = make_block(16, capacity_factor=0.25).eval()
    x = hidden(17, 12, 6)
    torch.testing.assert_close(block(x, capacity_factor=0), naive_block(block, x, capacity_factor=0.0),
                               atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(block(x), naive_block(block, x), atol=ATOL, rtol=RTOL)
    assert not torch.allclose(block(x), block(x, capacity_factor=0), atol=1e-4)


@pytest.mark.parametrize("bad", [0, -1, 5, 100])
def test_bad_top_k_override_raises(bad):
    block = make_block(18)
    with pytest.raises(ValueError):
        block(hidden(19, 3, 6), top_k=bad)


# ------------------------------------------------------------------------------------------------ aux losses

def hand_aux(block, x, top_k=None, z=False):
    """coef * E * sum_e f_e P_e with f from the top-k choices (before drops), plus the z-loss, by loops."""
    c = block.config
    k = c.top_k if top_k is None else top_k
    xs = x.reshape(-1, x.shape[-1])
    logits = xs @ block.router.weight.detach().t()
    tokens, experts = logits.shape
    ids, _ = naive_selection(logits, k, 0.0)
    f = [sum(row.count(e) for row in ids) / (tokens * k) for e in range(experts)]
    probs = [F.softmax(logits[t], -1) for t in range(tokens)]
    p_mean = [sum(p[e].item() for p in probs) / tokens for e in range(experts)]
    loss = c.aux_loss_coef * experts * sum(fe * pe for fe, pe in zip(f, p_mean))
    if z:
        lse = [math.log(sum(math.exp(v) for v in logits[t].tolist())) for t in range(tokens)]
        loss += c.z_loss_coef * sum(v * v for v in lse) / tokens
    return loss


@pytest.mark.parametrize("top_k,cf", [(1, 0.0), (2, 0.0), (2, 0.25), (4, 0.0)])
def test_aux_loss_is_switch_loss(top_k, cf):
    block = make_block(20, top_k=top_k, capacity_factor=cf, aux_loss_coef=0.1).train()
    x = hidden(21, 3, 5, 6)
    assert block.aux_loss is None
    block(x)
    assert block.aux_loss is not None and block.aux_loss.dim() == 0
    assert block.aux_loss.item() == pytest.approx(hand_aux(block, x), rel=1e-5, abs=1e-7)
    if top_k == 4:  # every expert chosen by every token: f = 1/E, loss = coef * E * sum P / E = coef
        assert block.aux_loss.item() == pytest.approx(0.1, rel=1e-5)


def test_aux_loss_follows_top_k_override():
    block = make_block(22, top_k=1, aux_loss_coef=1.0).train()
    x = hidden(23, 8, 6)
    block(x, top_k=3)
    assert block.aux_loss.item() == pytest.approx(hand_aux(block, x, top_k=3), rel=1e-5, abs=1e-7)


def test_z_loss():
    block = make_block(24, aux_loss_coef=0.01, z_loss_coef=0.5).train()
    x = hidden(25, 2, 4, 6)
    block(x)
    assert block.aux_loss.item() == pytest.approx(hand_aux(block, x, z=True), rel=1e-5, abs=1e-7)
    no_z = make_block(24, aux_loss_coef=0.01).train()
    no_z(x)
    assert no_z.aux_loss.item() == pytest.approx(hand_aux(no_z, x), rel=1e-5, abs=1e-7)
    assert block.aux_loss.item() > no_z.aux_loss.item()


def test_aux_loss_absent_in_eval_and_has_router_gradient():
    block = make_block(26).eval()
    block(hidden(27, 4, 6))
    assert block.aux_loss is None
    block.train()
    block(hidden(27, 4, 6))
    block.aux_loss.backward()
    assert block.router.weight.grad is not None and block.router.weight.grad.abs().sum() > 0


def test_aux_loss_sums_blocks():
    model = nn.Sequential(make_block(28, aux_loss_coef=0.2), nn.Linear(6, 6), make_block(29, z_loss_coef=0.1))
    assert aux_loss(model).item() == 0.0  # nothing ran yet
    model.train()
    x = hidden(30, 5, 6)
    model(x)
    b1, b2 = model[0], model[2]
    torch.testing.assert_close(aux_loss(model), b1.aux_loss + b2.aux_loss)
    assert b1.aux_loss.item() == pytest.approx(hand_aux(b1, x), rel=1e-5)
    assert b2.aux_loss.item() == pytest.approx(hand_aux(b2, model[1](b1(x)).detach(), z=True), rel=1e-5)
    assert aux_loss(nn.Linear(2, 2)).item() == 0.0


# ----------------------------------------------------------------------------------------------- router jitter

def test_router_jitter_only_in_training():
    block = make_block(31, router_jitter=0.3)
    x = hidden(32, 10, 6)
    plain = x @ block.router.weight.t()
    block.eval()
    torch.testing.assert_close(block.router_logits(x), plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(block.router_logits(x), block.router_logits(x), atol=0, rtol=0)
    block.train()
    torch.manual_seed(0)
    j1 = block.router_logits(x)
    j2 = block.router_logits(x)
    assert not torch.allclose(j1, plain, atol=1e-4)
    assert not torch.allclose(j1, j2, atol=1e-4)
    # no jitter configured: training logits are the plain ones
    block0 = make_block(31)
    torch.testing.assert_close(block0.train().router_logits(x), plain, atol=1e-6, rtol=1e-6)


def test_router_jitter_does_not_touch_expert_inputs():
    # with unit weights and top_k = E the output is independent of routing: jitter must not change it
    block = make_block(33, router_jitter=0.5, gate_weighting="unit", top_k=4).train()
    x = hidden(34, 6, 6)
    expected = torch.stack([sum(naive_expert(block, e, x[t]) for e in range(4)) for t in range(6)])
    torch.testing.assert_close(block(x), expected, atol=ATOL, rtol=RTOL)


def test_router_jitter_is_bounded():
    block = make_block(35, router_jitter=0.2, num_experts=1, top_k=1, hidden_size=1).train()
    with torch.no_grad():
        block.router.weight.fill_(1.0)
    x = torch.full((500, 1), 2.0)
    logits = block.router_logits(x)
    assert logits.min() >= 2.0 * 0.8 - 1e-6 and logits.max() <= 2.0 * 1.2 + 1e-6
    assert logits.std() > 0


# ---------------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs", [
    dict(num_experts=0, top_k=1),
    dict(num_experts=-2, top_k=1),
    dict(num_experts=4, top_k=5),
    dict(num_experts=4, top_k=0),
    dict(num_experts=4, top_k=2, activation="tanhh"),
    dict(num_experts=4, top_k=2, activation="sigmoid"),
    dict(num_experts=4, top_k=2, gate_weighting="softmax"),
    dict(num_experts=4, top_k=2, bias_out="yes"),
])
def test_config_validation(kwargs):
    with pytest.raises(MoECompileError):
        MoEConfig(hidden_size=6, expert_size=5, **kwargs)


@pytest.mark.parametrize("hidden_size,expert_size", [(0, 5), (6, 0)])
def test_config_rejects_empty_sizes(hidden_size, expert_size):
    with pytest.raises(MoECompileError):
        MoEConfig(hidden_size=hidden_size, expert_size=expert_size, num_experts=2)


@pytest.mark.parametrize("alias,canonical", [("swish", "silu"), ("gelu_new", "gelu_tanh"),
                                             ("gelu_pytorch_tanh", "gelu_tanh"), ("relu", "relu")])
def test_config_activation_aliases(alias, canonical):
    assert MoEConfig(hidden_size=4, expert_size=3, num_experts=2, activation=alias).activation == canonical


def test_config_round_trip_and_unknown_keys():
    cfg = MoEConfig(hidden_size=4, expert_size=3, num_experts=2, top_k=1, gated=True, bias_out="shared")
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(MoECompileError):
        MoEConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    assert issubclass(MoECompileError, Exception)


@pytest.mark.parametrize("overrides", [dict(), dict(gated=True), dict(bias_in=True, bias_out="expert"),
                                       dict(gated=True, bias_in=True, bias_out="shared")])
def test_params_per_expert_matches_module(overrides):
    block = make_block(36, **overrides)
    expert_params = sum(p.numel() for p in block.experts.parameters())
    assert expert_params == block.config.num_experts * block.config.params_per_expert()
    assert block.experts.w_in.shape == (4, block.config.expert_in_features, 6)
    assert block.experts.w_out.shape == (4, 6, 5)
    assert (block.bias is not None) == (block.config.bias_out == "shared")
    assert moecompile.MoEBlock is MoEBlock


def test_float32_router_logits_backward_matches_the_float32_linear(monkeypatch):
    """Eager CUDA training's router logits (_Float32Logits: a 16-bit GEMM with a float32 output, 16-bit backward GEMMs)
    against F.linear of upcast copies: same logits, gradients within bf16 rounding. (The CPU has no mm with
    out_dtype: it is emulated by upcasting, which is what the CUDA kernel computes up to summation order.)"""
    from moecompile.ir import block as B

    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, out_dtype=None: mm(a.float(), b.float()) if out_dtype else mm(a, b))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(8, 32, generator=gen) * 0.1).bfloat16().requires_grad_()
    grad = torch.randn(64, 8, generator=gen)
    logits = B._Float32Logits.apply(x, w)
    logits.backward(grad)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = torch.nn.functional.linear(x32, w32)
    want.backward(grad)
    assert logits.dtype == torch.float32 and x.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits, want)
    for got, ref in ((x.grad, x32.grad), (w.grad, w32.grad)):  # relative error: bf16 rounding of grad and result
        assert (got.float() - ref).norm() / ref.norm() < 1e-2


def test_float32_logits_upcast_off_cuda_and_add_the_bias():
    """core/logits.py: float32 logits of bf16 operands; off CUDA (or for 3-D or float32 inputs) the upcast product,
    with the bias added in float32. On CUDA, 16-bit 2-D operands take the tensor cores (tests/test_gpu.py)."""
    from moecompile.core.logits import float32_logits, on_tensor_cores

    gen = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(*s, generator=gen).bfloat16() for s in ((5, 16), (4, 16), (4,)))
    got = float32_logits(x, w, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float() @ w.float().t() + b.float(), atol=1e-6, rtol=1e-6)
    assert not on_tensor_cores(x, w) and not on_tensor_cores(x.float(), w.float())
