"""Reference kernels (moecompile.kernels.reference / activations) against naive plain-PyTorch references.

Every reference here is written the slow, obvious way (python loops over tokens / experts / rows, one dense FFN
per token) so that it shares no code path with the kernels under test.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from naive import naive_act

from moecompile.core import activations as A
from moecompile.kernels import reference as R

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
ATOL, RTOL = 1e-5, 1e-5


# ----------------------------------------------------------------------------------------------- naive helpers

def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=torch.float32) * scale


def naive_ffn(v, e, w_in, b_in, w_out, b_out, act, gated):
    """One token vector v [H] through expert e, written out per token."""
    h = w_in[e] @ v
    if b_in is not None:
        h = h + b_in[e]
    if gated:
        half = h.shape[0] // 2
        a = naive_act(act, h[:half]) * h[half:]
    else:
        a = naive_act(act, h)
    y = w_out[e] @ a
    if b_out is not None:
        y = y + b_out[e]
    return y


def naive_topk(logits_row, k):
    p = F.softmax(logits_row, dim=-1)
    ranked = sorted(range(p.shape[0]), key=lambda e: -p[e].item())[:k]
    return p, ranked


def naive_capacity(cf, tokens, k, experts):
    return math.ceil(abs(cf) * tokens * k / experts)


def naive_route(logits, k, cf, renormalize):
    """Python reimplementation of route: softmax top-k, optional renorm, then slot-major capacity drops."""
    tokens, experts = logits.shape
    weights = torch.zeros(tokens, k)
    ids = torch.zeros(tokens, k, dtype=torch.int64)
    for t in range(tokens):
        p, ranked = naive_topk(logits[t], k)
        ws = [p[e].item() for e in ranked]
        if renormalize:
            s = sum(ws)
            ws = [w / s for w in ws]
        for j in range(k):
            weights[t, j] = ws[j]
            ids[t, j] = ranked[j]
    return naive_apply_capacity(weights, ids, cf, experts)


def naive_apply_capacity(weights, ids, cf, experts):
    """Drop assignments over capacity in place, slot-major then token order (GShard's priority)."""
    tokens, k = ids.shape
    if cf != 0:
        cap = naive_capacity(cf, tokens, k, experts)
        load = [0] * experts
        for j in range(k):  # slot-major: every token's j-th choice before any (j+1)-th choice
            for t in range(tokens):  # token order inside a slot
                e = ids[t, j].item()
                if load[e] < cap:
                    load[e] += 1
                else:
                    ids[t, j] = experts
                    weights[t, j] = 0.0
    return weights, ids


def naive_dispatch_order(ids, experts):
    flat = ids.reshape(-1).tolist()
    order = []
    for e in range(experts + 1):  # expert E (dropped) last
        order += [i for i, x in enumerate(flat) if x == e]
    return order


def naive_combine(expert_out, order, weights):
    tokens, k = weights.shape
    order = order.tolist()
    out = []
    for t in range(tokens):
        acc = torch.zeros(expert_out.shape[-1], dtype=expert_out.dtype)
        for j in range(k):
            row = order.index(t * k + j)
            acc = acc + weights[t, j] * expert_out[row]
        out.append(acc)
    return torch.stack(out) if out else expert_out.new_zeros(0, expert_out.shape[-1])


def naive_moe(x, logits, k, cf, renormalize, w_in, b_in, w_out, b_out, act, gated):
    """The whole MoE computed per token straight from the logits."""
    weights, ids = naive_route(logits, k, cf, renormalize)
    experts = logits.shape[1]
    out = torch.zeros(x.shape[0], w_out.shape[1])
    for t in range(x.shape[0]):
        for j in range(k):
            e = ids[t, j].item()
            if e == experts:
                continue
            out[t] += weights[t, j] * naive_ffn(x[t], e, w_in, b_in, w_out, b_out, act, gated)
    return out


def expert_params(g, experts, hidden, inter, gated, bias_in, bias_out, scale=0.5, requires_grad=False):
    f = 2 * inter if gated else inter
    w_in = randn(g, experts, f, hidden, scale=scale)
    w_out = randn(g, experts, hidden, inter, scale=scale)
    b_in = randn(g, experts, f, scale=scale) if bias_in else None
    b_out = randn(g, experts, hidden, scale=scale) if bias_out else None
    if requires_grad:
        for p in (w_in, w_out, b_in, b_out):
            if p is not None:
                p.requires_grad_(True)
    return w_in, b_in, w_out, b_out


def offsets_from_counts(counts):
    return torch.tensor(list(torch.tensor(counts).cumsum(0).tolist()), dtype=torch.int32)


def expert_of_row(offsets, row):
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if start <= row < end:
            return e
        start = end
    return None  # past offsets[-1]: dropped


# ------------------------------------------------------------------------------------------------ activations

@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_matches_formula(name):
    x = torch.cat([randn(gen(1), 64, scale=3.0), torch.tensor([0.0, -1e-3, 1e-3, 8.0, -8.0])])
    torch.testing.assert_close(A.activation(name, x), naive_act(name, x), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_grad_matches_autograd(name):
    x = torch.cat([randn(gen(2), 64, scale=3.0), torch.tensor([0.0, -1e-3, 1e-3, 8.0, -8.0])]).requires_grad_()
    (expected,) = torch.autograd.grad(A.activation(name, x).sum(), x)
    torch.testing.assert_close(A.activation_grad(name, x.detach()), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("gated", [False, True])
def test_expert_activation_forward(name, gated):
    h = randn(gen(3), 6, 10, scale=2.0)
    out = A.expert_activation(name, gated, h)
    if gated:
        expected = naive_act(name, h[:, :5]) * h[:, 5:]
    else:
        expected = naive_act(name, h)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("gated", [False, True])
def test_expert_activation_backward_matches_autograd(name, gated):
    g = gen(4)
    h = randn(g, 6, 10, scale=2.0).requires_grad_()
    out = A.expert_activation(name, gated, h)
    grad_a = randn(g, *out.shape)
    (expected,) = torch.autograd.grad(out, h, grad_a)
    got = A.expert_activation_backward(name, gated, h.detach(), grad_a)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_unknown_activation_raises():
    x = torch.ones(3)
    with pytest.raises(ValueError):
        A.activation("tanhh", x)
    with pytest.raises(ValueError):
        A.activation_grad("tanhh", x)


# ------------------------------------------------------------------------------------------------------ route

def test_capacity_formula():
    assert R.capacity(0.0, 10, 2, 4) == -1
    assert R.capacity(1.0, 10, 2, 4) == 5
    assert R.capacity(1.25, 10, 2, 4) == math.ceil(1.25 * 10 * 2 / 4) == 7
    assert R.capacity(-1.25, 10, 2, 4) == 7
    assert R.capacity(0.01, 10, 2, 4) == 1


ROUTE_SHAPES = [(8, 4, 2), (7, 3, 2), (16, 8, 1), (5, 4, 4), (6, 1, 1), (9, 5, 3)]


@pytest.mark.parametrize("tokens,experts,k", ROUTE_SHAPES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("cf", [0.0, 1.0, -1.0, 0.5, -0.3, 1.25])
def test_route_matches_naive(tokens, experts, k, renormalize, cf):
    logits = randn(gen(10 + tokens * experts + k), tokens, experts, scale=2.0)
    weights, ids = R.route(logits, k, cf, renormalize)
    exp_w, exp_ids = naive_route(logits, k, cf, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == (tokens, k) and ids.shape == (tokens, k)
    assert torch.equal(ids, exp_ids)
    torch.testing.assert_close(weights, exp_w, atol=1e-6, rtol=1e-5)
    assert torch.all(weights[ids == experts] == 0)
    if cf == 0:
        assert not torch.any(ids == experts)  # dropless
    else:
        assert torch.all((ids >= 0) & (ids <= experts))


@pytest.mark.parametrize("tokens,experts,k", ROUTE_SHAPES)
@pytest.mark.parametrize("cf", [1.0, -1.0, 0.5, -0.3, 0.26])
def test_route_exact_drop_counts(tokens, experts, k, cf):
    logits = randn(gen(20 + tokens + experts), tokens, experts, scale=3.0)
    free_w, free_ids = R.route(logits, k, 0.0, True)
    weights, ids = R.route(logits, k, cf, True)
    cap = naive_capacity(cf, tokens, k, experts)
    dropped_total = 0
    for e in range(experts):
        load = int((free_ids == e).sum())
        assert int((ids == e).sum()) == min(load, cap)
        dropped_total += max(0, load - cap)
    assert int((ids == experts).sum()) == dropped_total
    keep = ids < experts
    # a kept assignment keeps its expert and its (pre-drop) weight; a dropped one has id E and weight 0
    assert torch.equal(ids[keep], free_ids[keep])
    torch.testing.assert_close(weights[keep], free_w[keep], atol=0, rtol=0)
    assert torch.all(weights[~keep] == 0)


def test_route_drops_slot_major_then_token_order():
    # 4 tokens, 2 experts, k = 2 = E: every token uses both experts. Tokens 0, 1 prefer expert 0; 2, 3 expert 1.
    # capacity ceil(0.5 * 4 * 2 / 2) = 2: the first choices fill both experts, so every second choice drops
    # (token-major priority would instead keep both choices of tokens 0 and 1).
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 2.0]])
    weights, ids = R.route(logits, 2, 0.5, True)
    assert ids.tolist() == [[0, 2], [0, 2], [1, 2], [1, 2]]
    assert torch.all(weights[:, 1] == 0)
    # capacity 1: token order inside slot 0 keeps token 0 on expert 0 and token 2 on expert 1
    weights, ids = R.route(logits, 2, 0.25, False)
    assert ids.tolist() == [[0, 2], [2, 2], [1, 2], [2, 2]]
    assert weights[0, 0] > 0 and weights[2, 0] > 0


def test_route_k_equals_e_is_full_softmax():
    logits = randn(gen(30), 6, 4)
    for renormalize in (True, False):
        weights, ids = R.route(logits, 4, 0.0, renormalize)
        probs = F.softmax(logits, dim=-1)
        assert torch.equal(ids.sort(-1).values, torch.arange(4).expand(6, 4))
        torch.testing.assert_close(weights, probs.gather(1, ids), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(weights.sum(-1), torch.ones(6), atol=1e-6, rtol=0)
        # sorted by decreasing probability
        assert torch.all(weights[:, :-1] >= weights[:, 1:])


@pytest.mark.parametrize("k", [1, 2])
def test_route_all_tokens_to_one_expert(k):
    tokens, experts = 8, 4
    logits = randn(gen(31), tokens, experts)
    logits[:, 0] += 30.0
    _, ids = R.route(logits, k, 0.0, True)
    assert torch.all(ids[:, 0] == 0)
    weights, ids = R.route(logits, k, 1.0, True)
    cap = naive_capacity(1.0, tokens, k, experts)
    assert cap < tokens
    # the first `cap` tokens (token order) keep expert 0, the rest are dropped from it
    assert ids[:cap, 0].tolist() == [0] * cap
    assert ids[cap:, 0].tolist() == [experts] * (tokens - cap)
    assert torch.all(weights[cap:, 0] == 0)
    exp_w, exp_ids = naive_route(logits, k, 1.0, True)
    assert torch.equal(ids, exp_ids)
    torch.testing.assert_close(weights, exp_w, atol=1e-6, rtol=1e-5)


def test_route_empty_experts():
    logits = randn(gen(32), 10, 5)
    logits[:, :2] += 20.0  # experts 2..4 never chosen with k = 2
    weights, ids = R.route(logits, 2, 0.0, True)
    assert set(ids.reshape(-1).tolist()) == {0, 1}
    hidden = randn(gen(33), 10, 3)
    _, _, offsets = R.dispatch(hidden, ids, 5)
    counts = torch.diff(offsets, prepend=torch.zeros(1, dtype=offsets.dtype))
    assert counts.tolist()[2:] == [0, 0, 0] and int(offsets[-1]) == 20


@pytest.mark.parametrize("cf", [0.0, 1.0, -2.0])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_zero_tokens(cf, renormalize):
    weights, ids = R.route(torch.zeros(0, 4), 2, cf, renormalize)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64


@pytest.mark.parametrize("cf", [0.0, 1.0])
def test_route_single_expert(cf):
    logits = randn(gen(34), 7, 1)
    for renormalize in (True, False):
        weights, ids = R.route(logits, 1, cf, renormalize)
        assert torch.all(ids == 0)  # capacity ceil(cf * 7 * 1 / 1) = 7 keeps everything
        torch.testing.assert_close(weights, torch.ones(7, 1), atol=1e-6, rtol=0)


def test_route_float64_logits_give_float32_weights():
    logits = randn(gen(35), 5, 4).double()
    weights, ids = R.route(logits, 2, 0.0, True)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    exp_w, exp_ids = naive_route(logits.float(), 2, 0.0, True)
    assert torch.equal(ids, exp_ids)
    torch.testing.assert_close(weights, exp_w, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------------- dispatch

def _dispatch_cases():
    cases = []
    for seed, (tokens, experts, k, cf) in enumerate([(8, 4, 2, 0.0), (7, 3, 2, 1.0), (9, 5, 3, 0.5), (6, 1, 1, 0.0),
                                                     (5, 4, 4, -0.5), (12, 6, 2, 0.3), (0, 3, 2, 1.0)]):
        logits = randn(gen(40 + seed), tokens, experts, scale=2.0)
        _, ids = R.route(logits, k, cf, True)
        cases.append(pytest.param(ids, experts, id=f"T{tokens}-E{experts}-k{k}-cf{cf}"))
    # hand-made: empty experts, dropped rows interleaved
    cases.append(pytest.param(torch.tensor([[3, 0], [1, 3], [0, 1], [3, 3], [1, 0]]), 3, id="handmade-drops"))
    cases.append(pytest.param(torch.tensor([[2], [2], [2]]), 4, id="one-expert-of-4"))
    return cases


@pytest.mark.parametrize("ids,experts", _dispatch_cases())
def test_dispatch_layout(ids, experts):
    tokens, k = ids.shape
    n = tokens * k
    hidden = randn(gen(50), tokens, 5)
    rows, order, offsets = R.dispatch(hidden, ids, experts)
    assert rows.shape == (n, 5) and order.shape == (n,) and offsets.shape == (experts,)
    assert order.dtype == torch.int64 and offsets.dtype == torch.int32
    # nothing lost, nothing doubled
    assert sorted(order.tolist()) == list(range(n))
    # exactly the naive stable expert sort (groups contiguous in expert order, token order inside, dropped last)
    assert order.tolist() == naive_dispatch_order(ids, experts)
    flat = ids.reshape(-1)
    sorted_ids = flat[order]
    assert torch.all(sorted_ids[1:] >= sorted_ids[:-1])
    for e in range(experts + 1):
        members = order[sorted_ids == e]
        assert torch.all(members[1:] > members[:-1])
    # offsets: cumulative counts, rows >= offsets[-1] are the dropped ones
    counts = [int((flat == e).sum()) for e in range(experts)]
    expected_offsets = [sum(counts[:e + 1]) for e in range(experts)]
    assert offsets.tolist() == expected_offsets
    assert torch.all(sorted_ids[int(offsets[-1]):] == experts)
    assert torch.all(sorted_ids[:int(offsets[-1])] < experts)
    for i in range(n):
        assert expert_of_row(offsets, i) == (sorted_ids[i].item() if sorted_ids[i] < experts else None)
        assert torch.equal(rows[i], hidden[order[i].item() // k])


# ---------------------------------------------------------------------------------------------------- experts

BIAS_COMBOS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias_in,bias_out", BIAS_COMBOS)
def test_experts_per_row(act, gated, bias_in, bias_out):
    g = gen(60)
    hidden, inter = 5, 9
    counts = [3, 0, 4]
    dropped = 2
    w_in, b_in, w_out, b_out = expert_params(g, 3, hidden, inter, gated, bias_in, bias_out)
    x = randn(g, sum(counts) + dropped, hidden)
    x[-dropped:] = 1e3  # garbage in the dropped rows must not leak
    offsets = offsets_from_counts(counts)
    y = R.experts(x, offsets, w_in, b_in, w_out, b_out, act, gated)
    assert y.shape == (x.shape[0], hidden) and y.dtype == torch.float32
    for i in range(x.shape[0]):
        e = expert_of_row(offsets, i)
        if e is None:
            assert torch.all(y[i] == 0)
        else:
            expected = naive_ffn(x[i], e, w_in, b_in, w_out, b_out, act, gated)
            torch.testing.assert_close(y[i], expected, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("rows", [0, 4])
def test_experts_all_groups_empty(rows):
    g = gen(61)
    w_in, b_in, w_out, b_out = expert_params(g, 3, 4, 6, True, True, True)
    x = randn(g, rows, 4)
    y = R.experts(x, torch.zeros(3, dtype=torch.int32), w_in, b_in, w_out, b_out, "silu", True)
    assert y.shape == (rows, 4)
    assert torch.all(y == 0)


# ---------------------------------------------------------------------------------------------------- combine

@pytest.mark.parametrize("tokens,k,hidden", [(6, 2, 4), (7, 3, 5), (5, 1, 3), (1, 4, 2)])
def test_combine_matches_naive(tokens, k, hidden):
    g = gen(70 + tokens)
    n = tokens * k
    expert_out = randn(g, n, hidden)
    order = torch.randperm(n, generator=g)
    weights = torch.rand(tokens, k, generator=g)
    weights[0, 0] = 0.0  # a dropped slot with a finite row contributes nothing
    out = R.combine(expert_out, order, weights)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out, naive_combine(expert_out, order, weights), atol=ATOL, rtol=RTOL)


def test_combine_zero_tokens():
    out = R.combine(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2))
    assert out.shape == (0, 4)
    grad_rows, grad_w = R.combine_backward(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64),
                                           torch.zeros(0, 2))
    assert grad_rows.shape == (0, 4) and grad_w.shape == (0, 2)


def test_combine_float64_is_not_downcast():
    g = gen(71)
    expert_out = randn(g, 6, 3).double() + 1.0 / 3.0
    order = torch.randperm(6, generator=g)
    weights = torch.rand(3, 2, generator=g).double()
    out = R.combine(expert_out, order, weights)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, naive_combine(expert_out, order, weights), atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------------------------ full pipeline

def _pipeline(x, logits, k, cf, renormalize, w_in, b_in, w_out, b_out, act, gated):
    experts = logits.shape[1]
    weights, ids = R.route(logits, k, cf, renormalize)
    rows, order, offsets = R.dispatch(x, ids, experts)
    y = R.experts(rows, offsets, w_in, b_in, w_out, b_out, act, gated)
    return R.combine(y, order, weights), ids


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias_in,bias_out", BIAS_COMBOS)
def test_pipeline_activation_bias_grid(act, gated, bias_in, bias_out):
    g = gen(80)
    tokens, hidden, experts, inter, k = 7, 5, 3, 9, 2
    x = randn(g, tokens, hidden)
    logits = randn(g, tokens, experts, scale=2.0)
    w_in, b_in, w_out, b_out = expert_params(g, experts, hidden, inter, gated, bias_in, bias_out)
    out, ids = _pipeline(x, logits, k, 1.0, True, w_in, b_in, w_out, b_out, act, gated)
    expected = naive_moe(x, logits, k, 1.0, True, w_in, b_in, w_out, b_out, act, gated)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tokens,hidden,experts,inter,k", [(7, 5, 3, 9, 2), (12, 8, 4, 6, 3), (6, 4, 1, 3, 1),
                                                           (5, 3, 4, 2, 4), (10, 4, 6, 5, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("cf", [0.0, 1.0, -0.75, 0.3])
def test_pipeline_shapes_routing_grid(tokens, hidden, experts, inter, k, renormalize, cf):
    g = gen(81 + tokens)
    x = randn(g, tokens, hidden)
    logits = randn(g, tokens, experts, scale=2.0)
    w_in, b_in, w_out, b_out = expert_params(g, experts, hidden, inter, True, True, True)
    out, _ = _pipeline(x, logits, k, cf, renormalize, w_in, b_in, w_out, b_out, "gelu", True)
    expected = naive_moe(x, logits, k, cf, renormalize, w_in, b_in, w_out, b_out, "gelu", True)
    assert out.shape == (tokens, hidden)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_pipeline_fully_dropped_token_is_zero():
    g = gen(82)
    x = randn(g, 8, 4)
    logits = randn(g, 8, 4)
    logits[:, 0] += 30.0
    w_in, b_in, w_out, b_out = expert_params(g, 4, 4, 3, False, True, True)
    out, ids = _pipeline(x, logits, 1, 1.0, True, w_in, b_in, w_out, b_out, "relu", False)
    cap = naive_capacity(1.0, 8, 1, 4)  # 2
    assert torch.all(ids[cap:] == 4)
    assert torch.all(out[cap:] == 0)
    torch.testing.assert_close(out, naive_moe(x, logits, 1, 1.0, True, w_in, b_in, w_out, b_out, "relu", False),
                               atol=1e-5, rtol=1e-4)


def test_pipeline_zero_tokens():
    g = gen(83)
    w_in, b_in, w_out, b_out = expert_params(g, 3, 5, 4, True, True, True)
    out, _ = _pipeline(torch.zeros(0, 5), torch.zeros(0, 3), 2, 1.0, True, w_in, b_in, w_out, b_out, "silu", True)
    assert out.shape == (0, 5)


# ---------------------------------------------------------------------------------------------------- backward

def naive_route_weights(logits, full_ids, keep, renormalize):
    """Differentiable route weights given the (non-differentiable) selection."""
    p = F.softmax(logits, dim=-1)
    w = p.gather(1, full_ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * keep


@pytest.mark.parametrize("tokens,experts,k", [(8, 4, 2), (7, 3, 2), (9, 5, 3), (5, 4, 4), (6, 1, 1), (6, 5, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("cf", [0.0, 0.5, -0.3])
def test_route_backward_matches_autograd(tokens, experts, k, renormalize, cf):
    g = gen(90 + tokens * k)
    logits = randn(g, tokens, experts, scale=2.0)
    _, full_ids = R.route(logits, k, 0.0, renormalize)
    _, ids = R.route(logits, k, cf, renormalize)
    if cf != 0 and experts > 1:
        assert torch.any(ids == experts), "test case should exercise drops"
    keep = (ids < experts).float()
    lg = logits.clone().requires_grad_()
    w = naive_route_weights(lg, full_ids, keep, renormalize)
    grad_w = randn(g, tokens, k)
    (expected,) = torch.autograd.grad(w, lg, grad_w)
    got = R.route_backward(grad_w, logits, ids, k, renormalize)
    assert got.shape == logits.shape and got.dtype == logits.dtype
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("ids,experts", _dispatch_cases())
def test_dispatch_backward_matches_autograd(ids, experts):
    tokens, k = ids.shape
    g = gen(100)
    hidden = randn(g, tokens, 5).requires_grad_()
    _, order, _ = R.dispatch(hidden.detach(), ids, experts)
    naive_rows = [hidden[order[i].item() // k] for i in range(tokens * k)]
    naive_rows = torch.stack(naive_rows) if naive_rows else hidden.new_zeros(0, 5)
    grad_rows = randn(g, tokens * k, 5)
    if tokens:
        (expected,) = torch.autograd.grad(naive_rows, hidden, grad_rows)
    else:
        expected = torch.zeros(0, 5)
    got = R.dispatch_backward(grad_rows, order, tokens, k)
    assert got.shape == (tokens, 5)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias_in,bias_out", BIAS_COMBOS)
@pytest.mark.parametrize("counts,keep_h", [([2, 0, 3, 1], False), ([2, 0, 3, 1], True), ([0, 0, 6, 0], True)])
def test_experts_backward_matches_autograd(act, gated, bias_in, bias_out, counts, keep_h):
    """keep_h: experts_train's h (its output equal to experts') goes to the backward instead of a recomputation."""
    g = gen(110)
    hidden, inter, dropped = 5, 4, 2
    w_in, b_in, w_out, b_out = expert_params(g, 4, hidden, inter, gated, bias_in, bias_out, requires_grad=True)
    x = randn(g, sum(counts) + dropped, hidden).requires_grad_()
    offsets = offsets_from_counts(counts)
    ys = []
    for i in range(x.shape[0]):
        e = expert_of_row(offsets, i)
        ys.append(x.new_zeros(hidden) if e is None else naive_ffn(x[i], e, w_in, b_in, w_out, b_out, act, gated))
    y = torch.stack(ys)
    grad_y = randn(g, *y.shape)
    params = [p for p in (x, w_in, b_in, w_out, b_out) if p is not None]
    expected = dict(zip([id(p) for p in params], torch.autograd.grad(y, params, grad_y)))
    detached = [None if p is None else p.detach() for p in (x, w_in, b_in, w_out, b_out)]
    h = None
    if keep_h:
        y_train, h = R.experts_train(detached[0], offsets, *detached[1:], act, gated)
        torch.testing.assert_close(y_train, y.detach(), atol=1e-5, rtol=1e-4)
        first = torch.cat([x[a:b].detach() @ w_in[e].detach().t() for e, (a, b) in
                           enumerate(zip([0, *offsets[:-1].tolist()], offsets.tolist()))])
        torch.testing.assert_close(h[:sum(counts)], first, atol=1e-5, rtol=1e-4)
        assert torch.all(h[sum(counts):] == 0)
    gx, gw_in, gb_in, gw_out, gb_out = R.experts_backward(
        grad_y, detached[0], offsets, detached[1], detached[2], detached[3], act, gated, bias_out, h=h)
    torch.testing.assert_close(gx, expected[id(x)], atol=1e-5, rtol=1e-4)
    assert torch.all(gx[sum(counts):] == 0)
    torch.testing.assert_close(gw_in, expected[id(w_in)], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw_out, expected[id(w_out)], atol=1e-5, rtol=1e-4)
    if bias_in:
        torch.testing.assert_close(gb_in, expected[id(b_in)], atol=1e-5, rtol=1e-4)
    else:
        assert gb_in is None
    if bias_out:
        torch.testing.assert_close(gb_out, expected[id(b_out)], atol=1e-5, rtol=1e-4)
    else:
        assert gb_out is None
    # the empty expert gets exactly zero gradient
    assert torch.all(gw_in[1] == 0) and torch.all(gw_out[1] == 0)


@pytest.mark.parametrize("tokens,k,hidden", [(6, 2, 4), (7, 3, 5), (5, 1, 3)])
def test_combine_backward_matches_autograd(tokens, k, hidden):
    g = gen(120 + tokens)
    n = tokens * k
    expert_out = randn(g, n, hidden).requires_grad_()
    order = torch.randperm(n, generator=g)
    weights = torch.rand(tokens, k, generator=g).requires_grad_()
    out = naive_combine(expert_out, order, weights)
    grad_out = randn(g, tokens, hidden)
    exp_rows, exp_w = torch.autograd.grad(out, (expert_out, weights), grad_out)
    got_rows, got_w = R.combine_backward(grad_out, expert_out.detach(), order, weights.detach())
    torch.testing.assert_close(got_rows, exp_rows, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got_w, exp_w, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("cf", [0.0, 0.5])
def test_backward_kernels_chain_matches_autograd(renormalize, cf):
    """The four backward kernels chained by hand equal autograd through the naive MoE (x and logits)."""
    g = gen(130)
    tokens, hidden, experts, inter, k = 7, 5, 3, 4, 2
    x = randn(g, tokens, hidden)
    logits = randn(g, tokens, experts, scale=2.0)
    w_in, b_in, w_out, b_out = expert_params(g, experts, hidden, inter, True, True, True)
    grad_out = randn(g, tokens, hidden)
    # kernels
    weights, ids = R.route(logits, k, cf, renormalize)
    rows, order, offsets = R.dispatch(x, ids, experts)
    y = R.experts(rows, offsets, w_in, b_in, w_out, b_out, "gelu", True)
    g_y, g_w = R.combine_backward(grad_out, y, order, weights)
    g_rows, *_ = R.experts_backward(g_y, rows, offsets, w_in, b_in, w_out, "gelu", True, True)
    g_x = R.dispatch_backward(g_rows, order, tokens, k)
    g_logits = R.route_backward(g_w, logits, ids, k, renormalize)
    # naive autograd
    _, full_ids = R.route(logits, k, 0.0, renormalize)
    keep = (ids < experts).float()
    xr, lr = x.clone().requires_grad_(), logits.clone().requires_grad_()
    w = naive_route_weights(lr, full_ids, keep, renormalize)
    out = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(k):
            if ids[t, j] < experts:
                out = out.index_add(0, torch.tensor([t]),
                                    (w[t, j] * naive_ffn(xr[t], ids[t, j].item(), w_in, b_in, w_out, b_out,
                                                         "gelu", True)).unsqueeze(0))
    exp_x, exp_logits = torch.autograd.grad(out, (xr, lr), grad_out)
    torch.testing.assert_close(g_x, exp_x, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g_logits, exp_logits, atol=1e-5, rtol=1e-4)


# ------------------------------------------------- HF routers: route_grouped (DeepSeek-V3), GLU experts (GPT-OSS)

def naive_grouped_route(logits, k, cf, renormalize, scoring, bias, n_group, topk_group, scale):
    """Per token: scores, selection by score + bias inside the best groups (sum of a group's two best), weights
    = selected scores (no bias), renormalised with DeepSeek's 1e-20, scaled; then capacity drops."""
    tokens, experts = logits.shape
    size = experts // n_group
    weights = torch.zeros(tokens, k)
    ids = torch.zeros(tokens, k, dtype=torch.int64)
    for t in range(tokens):
        row = logits[t].double()
        s = torch.exp(row) / torch.exp(row).sum() if scoring == "softmax" else 1.0 / (1.0 + torch.exp(-row))
        choice = [s[e].item() + (bias[e].item() if bias is not None else 0.0) for e in range(experts)]
        group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        allowed = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        ranked = sorted([e for e in range(experts) if e // size in allowed], key=lambda e: -choice[e])[:k]
        ws = [s[e].item() for e in ranked]
        if renormalize:
            total = sum(ws) + 1e-20
            ws = [w / total for w in ws]
        for j in range(k):
            weights[t, j] = ws[j] * scale
            ids[t, j] = ranked[j]
    return naive_apply_capacity(weights, ids, cf, experts)


GROUPED_CASES = [  # tokens, experts, k, n_group, topk_group
    (9, 8, 2, 4, 2), (7, 8, 3, 2, 1), (6, 12, 4, 3, 2), (5, 4, 2, 1, 1), (8, 6, 1, 6, 3), (4, 8, 8, 4, 4)]


@pytest.mark.parametrize("tokens,experts,k,n_group,topk_group", GROUPED_CASES)
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("renormalize,scale,use_bias", [(True, 2.5, True), (False, 1.0, True), (True, 1.0, False)])
@pytest.mark.parametrize("cf", [0.0, 0.6])
def test_route_grouped_matches_naive(tokens, experts, k, n_group, topk_group, scoring, renormalize, scale, use_bias,
                                     cf):
    g = gen(300 + tokens * experts + k)
    logits = randn(g, tokens, experts, scale=2.0)
    bias = randn(g, experts, scale=0.3) if use_bias else None
    weights, ids = R.route_grouped(logits, k, cf, renormalize, scoring, bias, n_group, topk_group, scale)
    exp_w, exp_ids = naive_grouped_route(logits, k, cf, renormalize, scoring, bias, n_group, topk_group, scale)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, exp_ids)
    torch.testing.assert_close(weights, exp_w, atol=1e-6, rtol=1e-5)
    size = experts // n_group
    for row in ids.tolist():  # a token's experts come from at most topk_group groups
        assert len({e // size for e in row if e < experts}) <= topk_group


def test_route_grouped_defaults_are_route():
    logits = randn(gen(310), 11, 6, scale=2.0)
    for cf in (0.0, 0.5):
        for renormalize in (True, False):
            w1, i1 = R.route(logits, 3, cf, renormalize)
            w2, i2 = R.route_grouped(logits, 3, cf, renormalize, "softmax", None, 1, 1, 1.0)
            assert torch.equal(i1, i2)
            torch.testing.assert_close(w1, w2, atol=0, rtol=0)


def test_route_grouped_bias_selects_but_does_not_weigh():
    # expert 3 has the lowest score but a large bias: it is chosen, and its weight is its own (unbiased) score
    logits = torch.tensor([[2.0, 1.0, 0.5, -3.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    weights, ids = R.route_grouped(logits, 2, 0.0, False, "sigmoid", bias, 1, 1, 1.0)
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(weights, torch.sigmoid(logits[:, [3, 0]]), atol=1e-7, rtol=0)


def test_route_grouped_rejects_bad_groups():
    with pytest.raises(ValueError):
        R.route_grouped(torch.zeros(2, 6), 2, 0.0, True, "sigmoid", None, 4, 2, 1.0)  # 6 experts in 4 groups
    with pytest.raises(ValueError):
        R.route_grouped(torch.zeros(2, 8), 2, 0.0, True, "sigmoid", None, 4, 5, 1.0)  # topk_group > n_group
    with pytest.raises(ValueError):
        R.route_grouped(torch.zeros(2, 8), 2, 0.0, True, "tanh", None, 1, 1, 1.0)


def test_route_grouped_zero_tokens():
    weights, ids = R.route_grouped(torch.zeros(0, 8), 2, 1.0, True, "sigmoid", torch.zeros(8), 4, 2, 2.0)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)


def naive_grouped_weights(logits, full_ids, keep, renormalize, scoring, scale):
    """The weights as a differentiable function of the logits for a fixed selection."""
    s = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    w = s.gather(1, full_ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return torch.where(keep, w * scale, 0.0)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("cf", [0.0, 0.5])
def test_route_grouped_backward_matches_autograd(scoring, renormalize, cf):
    g = gen(320)
    logits = randn(g, 9, 8, scale=2.0)
    bias = randn(g, 8, scale=0.3)
    args = (scoring, bias, 4, 2, 2.5)
    weights, ids = R.route_grouped(logits, 3, cf, renormalize, *args)
    _, full_ids = R.route_grouped(logits, 3, 0.0, renormalize, *args)
    grad_w = randn(g, *weights.shape)
    lg = logits.clone().requires_grad_()
    (expected,) = torch.autograd.grad(naive_grouped_weights(lg, full_ids, ids < 8, renormalize, scoring, 2.5), lg,
                                      grad_w)
    got = R.route_grouped_backward(grad_w, logits, ids, 3, renormalize, *args)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def naive_swiglu_oai(gate, up, alpha, limit):
    g = torch.where(gate > limit, torch.full_like(gate, limit), gate)
    u = torch.where(up > limit, torch.full_like(up, limit), torch.where(up < -limit, torch.full_like(up, -limit), up))
    return (u + 1.0) * g / (1.0 + torch.exp(-alpha * g))


def naive_glu_ffn(v, e, w_in, b_in, w_out, b_out, act, interleaved, alpha, limit):
    h = w_in[e] @ v
    if b_in is not None:
        h = h + b_in[e]
    if interleaved:
        gate, up = h[0::2], h[1::2]
    else:
        gate, up = h[: h.shape[0] // 2], h[h.shape[0] // 2:]
    a = naive_swiglu_oai(gate, up, alpha, limit) if act == "swiglu_oai" else naive_act(act, gate) * up
    y = w_out[e] @ a
    return y + b_out[e] if b_out is not None else y


@pytest.mark.parametrize("act", ["swiglu_oai", "silu", "gelu"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_experts_glu_per_row(act, interleaved, bias):
    g = gen(330)
    w_in, b_in, w_out, b_out = expert_params(g, 3, 5, 4, True, bias, bias, scale=1.5)
    counts = [3, 0, 4]  # an empty expert, and two dropped rows past offsets[-1]
    offsets = offsets_from_counts(counts)
    x = randn(g, 9, 5, scale=2.0)
    alpha, limit = 1.3, 2.0  # small limit: the clamps bite on these inputs
    y = R.experts(x, offsets, w_in, b_in, w_out, b_out, act, True, interleaved, alpha, limit)
    for row in range(9):
        e = expert_of_row(offsets, row)
        expected = torch.zeros(5) if e is None else naive_glu_ffn(x[row], e, w_in, b_in, w_out, b_out, act,
                                                                  interleaved, alpha, limit)
        torch.testing.assert_close(y[row], expected, atol=1e-5, rtol=1e-5)


def test_swiglu_oai_clamps_bite():
    h = torch.tensor([[9.0, 9.0, -9.0, -9.0]])  # interleaved: gate 9 (clamped), up 9 (clamped); gate -9, up -9
    out = A.expert_activation("swiglu_oai", True, h, True, 1.702, 7.0)
    expected = torch.tensor([[(7.0 + 1) * 7.0 * torch.sigmoid(torch.tensor(1.702 * 7.0)).item(),
                              (-7.0 + 1) * -9.0 * torch.sigmoid(torch.tensor(-1.702 * 9.0)).item()]])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        A.expert_activation("swiglu_oai", False, h)


@pytest.mark.parametrize("act", ["swiglu_oai", "silu"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_expert_glu_activation_backward_matches_autograd(act, interleaved):
    g = gen(340)
    h = (randn(g, 6, 10, scale=4.0)).requires_grad_()
    out = A.expert_activation(act, True, h, interleaved, 1.5, 3.0)
    grad_a = randn(g, *out.shape)
    (expected,) = torch.autograd.grad(out, h, grad_a)
    got = A.expert_activation_backward(act, True, h.detach(), grad_a, interleaved, 1.5, 3.0)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("interleaved", [True, False])
def test_experts_glu_backward_matches_autograd(interleaved):
    g = gen(350)
    w_in, b_in, w_out, b_out = expert_params(g, 3, 5, 4, True, True, True, scale=1.5, requires_grad=True)
    offsets = offsets_from_counts([2, 0, 4])
    x = randn(g, 8, 5, scale=2.0).requires_grad_()
    glu = (interleaved, 1.3, 2.0)

    def naive(x, w_in, b_in, w_out, b_out):
        rows = []
        for row in range(x.shape[0]):
            e = expert_of_row(offsets, row)
            rows.append(torch.zeros(5) if e is None else
                        naive_glu_ffn(x[row], e, w_in, b_in, w_out, b_out, "swiglu_oai", *glu))
        return torch.stack(rows)

    grad_y = randn(g, 8, 5)
    params = (x, w_in, b_in, w_out, b_out)
    expected = torch.autograd.grad(naive(*params), params, grad_y)
    got = R.experts_backward(grad_y, x.detach(), offsets, w_in.detach(), b_in.detach(), w_out.detach(),
                             "swiglu_oai", True, True, *glu)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("logits_fp32,router_bias", [(True, False), (False, True)])
def test_route_dispatch_is_linear_route_dispatch(logits_fp32, router_bias):
    g = gen(360)
    hidden, weight = randn(g, 10, 6), randn(g, 8, 6)
    bias = randn(g, 8) if router_bias else None
    corr = randn(g, 8, scale=0.3)
    routing = (3, 0.7, True, "sigmoid", corr, 4, 2, 2.5)
    got = R.route_dispatch(hidden, weight, bias, *routing, logits_fp32)
    logits = hidden @ weight.t() + (bias if bias is not None else 0.0)
    w, ids = naive_grouped_route(logits, 3, 0.7, True, "sigmoid", corr, 4, 2, 2.5)
    assert torch.equal(got[1], ids)
    torch.testing.assert_close(got[0], w, atol=1e-6, rtol=1e-5)
    assert got[3].tolist() == naive_dispatch_order(ids, 8)
    torch.testing.assert_close(got[2], hidden[got[3] // 3], atol=0, rtol=0)
    counts = [int((ids == e).sum()) for e in range(8)]
    assert got[4].tolist() == torch.tensor(counts).cumsum(0).tolist()


def test_route_dispatch_backward_matches_autograd():
    g = gen(370)
    hidden, weight, bias = randn(g, 9, 6), randn(g, 8, 6), randn(g, 8)
    routing = dict(top_k=3, renormalize=True, scoring="softmax", correction_bias=None, n_group=2, topk_group=1,
                   scaling_factor=1.5)
    args = (routing["top_k"], 0.0, True, "softmax", None, 2, 1, 1.5, False)
    weights, ids, rows, order, _ = R.route_dispatch(hidden, weight, bias, *args)
    grad_w, grad_rows = randn(g, *weights.shape), randn(g, *rows.shape)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    logits = h @ w.t() + b
    expected_w = naive_grouped_weights(logits, ids, ids < 8, True, "softmax", 1.5)
    expected_rows = h[order // 3]
    expected = torch.autograd.grad((expected_w * grad_w).sum() + (expected_rows * grad_rows).sum(), (h, w, b))
    got = R.route_dispatch_backward(grad_w, grad_rows, hidden, weight, bias, ids, order, 3, True, "softmax", None, 2,
                                    1, 1.5, False)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
