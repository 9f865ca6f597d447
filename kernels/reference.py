"""Reference kernels for the moecompile ops: plain PyTorch, any device, float32-exact.

Layout conventions shared by every kernel:
- T tokens, k assignments per token, E experts, N = T * k assignment rows.
- route() marks an assignment dropped by capacity with expert id E and weight 0.
- dispatch() orders the N assignment rows by expert (stable: token order inside an expert, dropped rows last);
  `order[i]` is the flat assignment index (token * k + slot) of sorted row i, and `offsets[e]` is the end row of
  expert e's group (torch._grouped_mm's convention), so rows >= offsets[-1] are the dropped ones.
- experts() here writes zeros to the dropped rows; device kernels may leave them unspecified, so combine() reads
  only the rows of assignments with a nonzero weight.
- quantize_fp8() / experts_fp8() are the FP8 (e4m3, inference-only) forms; moecompile/core/fp8_format.py fixes their
  scales.
- No kernel synchronises with the host except experts(), which walks the groups on the host (outside CUDA-graph
  capture): route and dispatch count with scatter_add rather than bincount (whose output size depends on the data).
"""
import math

import torch

from moecompile.core import fp8_format as fp8
from moecompile.core.activations import expert_activation, expert_activation_backward


def capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """Per-expert token capacity, or -1 for dropless (capacity_factor == 0)."""
    if capacity_factor == 0:
        return -1
    return max(1, math.ceil(abs(capacity_factor) * tokens * top_k / num_experts))


def _top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, the lowest index first among equal values, as the Triton routing
    kernels pick (torch.topk leaves ties unspecified; 16-bit logits tie often)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k].contiguous()


def _topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    probs = torch.softmax(router_logits.float(), dim=-1)
    ids = _top_indices(probs, top_k)
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _counts(flat_ids: torch.Tensor, bins: int) -> torch.Tensor:
    return torch.zeros(bins, dtype=torch.int64, device=flat_ids.device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids))


def _rank_in_expert(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Position of each assignment in its expert's queue, in the order of flat_ids (no host sync)."""
    order = torch.argsort(flat_ids.to(torch.int32), stable=True)  # 32-bit keys: half the radix passes
    counts = _counts(flat_ids, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    sorted_rank = torch.arange(flat_ids.numel(), device=flat_ids.device) - starts[flat_ids[order]]
    return torch.empty_like(flat_ids).scatter_(0, order, sorted_rank)


def route(router_logits: torch.Tensor, top_k: int, capacity_factor: float, renormalize: bool):
    """Softmax top-k routing. Returns (weights [T, k] float32, expert_ids [T, k] int64).

    With a capacity, assignments are admitted slot-major (every token's first choice before any second choice,
    GShard's priority), in token order inside a slot; the rest are dropped (id E, weight 0).
    """
    weights, ids = _topk(router_logits, top_k, renormalize)
    return drop_over_capacity(weights, ids, capacity_factor, router_logits.shape[-1])


def route_backward(grad_weights, router_logits, expert_ids, top_k: int, renormalize: bool):
    """Gradient of route's weights w.r.t. the router logits (ids are not differentiable)."""
    num_experts = router_logits.shape[-1]
    probs = torch.softmax(router_logits.float(), dim=-1)
    full_weights, full_ids = _topk(router_logits, top_k, renormalize)
    g = torch.where(expert_ids < num_experts, grad_weights.float(), 0.0)
    if renormalize:
        # weights = softmax over the selected logits
        g_sel = full_weights * (g - (g * full_weights).sum(-1, keepdim=True))
        grad = torch.zeros_like(probs).scatter_add_(1, full_ids, g_sel)
    else:
        g_probs = torch.zeros_like(probs).scatter_add_(1, full_ids, g)
        grad = probs * (g_probs - (g_probs * probs).sum(-1, keepdim=True))
    return grad.to(router_logits.dtype)


# ---- route_grouped: DeepSeek-V3's router (sigmoid scores, correction bias, expert groups, scaling); with softmax
# scores, no bias, one group and scale 1 it is route

SCORINGS = ("softmax", "sigmoid")
_RENORM_EPS = 1e-20  # DeepSeek-V3's guard; a no-op for softmax weights


def drop_over_capacity(weights, ids, capacity_factor: float, num_experts: int):
    """Drop the assignments over capacity: admitted slot-major (every token's first choice before any second
    choice, GShard's priority), in token order inside a slot; the rest get id E and weight 0."""
    tokens, top_k = ids.shape
    cap = capacity(capacity_factor, tokens, top_k, num_experts)
    if cap >= 0:
        slot_major = ids.t().reshape(-1)
        # contiguous: a transposed mask would make both outputs transposed, unlike the op's fake (and kernels)
        keep = (_rank_in_expert(slot_major, num_experts) < cap).reshape(top_k, tokens).t().contiguous()
        ids = torch.where(keep, ids, num_experts)
        weights = torch.where(keep, weights, 0.0)
    return weights, ids


def _scores(router_logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "softmax":
        return torch.softmax(router_logits.float(), dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(router_logits.float())
    raise ValueError(f"unknown scoring {scoring!r}; expected one of {', '.join(SCORINGS)}")


def _select(scores, top_k: int, correction_bias, n_group: int, topk_group: int):
    """Expert ids [T, k]: top-k of score + correction bias, among the topk_group best of n_group expert groups
    (a group's score is the sum of its two best experts, DeepSeek-V3's rule)."""
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        tokens, num_experts = choice.shape
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"bad expert groups: {num_experts} experts, n_group={n_group}, topk_group={topk_group}")
        size = num_experts // n_group
        group_scores = choice.view(tokens, n_group, size).topk(min(2, size), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, _top_indices(group_scores, topk_group), True)
        choice = choice.masked_fill(~keep.repeat_interleave(size, dim=1), float("-inf"))
    return _top_indices(choice, top_k)


def route_grouped(router_logits: torch.Tensor, top_k: int, capacity_factor: float, renormalize: bool,
                  scoring: str, correction_bias, n_group: int, topk_group: int, scaling_factor: float):
    """General top-k routing. Returns (weights [T, k] float32, expert_ids [T, k] int64): the selected experts'
    scores (without the correction bias), optionally renormalised to sum to 1, times scaling_factor; capacity as
    in route."""
    scores = _scores(router_logits, scoring)
    ids = _select(scores, top_k, correction_bias, n_group, topk_group)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _RENORM_EPS)
    return drop_over_capacity(weights * scaling_factor, ids, capacity_factor, router_logits.shape[-1])


def route_grouped_backward(grad_weights, router_logits, expert_ids, top_k: int, renormalize: bool, scoring: str,
                           correction_bias, n_group: int, topk_group: int, scaling_factor: float):
    """Gradient of route_grouped's weights w.r.t. the router logits (ids and the correction bias get none)."""
    num_experts = router_logits.shape[-1]
    scores = _scores(router_logits, scoring)
    full_ids = _select(scores, top_k, correction_bias, n_group, topk_group)  # the selection before capacity drops
    g = torch.where(expert_ids < num_experts, grad_weights.float(), 0.0) * scaling_factor
    if renormalize:  # w_j = s_j / (sum s + eps)
        selected = scores.gather(1, full_ids)
        denom = selected.sum(-1, keepdim=True) + _RENORM_EPS
        g = (g - (g * selected).sum(-1, keepdim=True) / denom) / denom
    grad_scores = torch.zeros_like(scores).scatter_add_(1, full_ids, g)
    if scoring == "softmax":
        grad = scores * (grad_scores - (grad_scores * scores).sum(-1, keepdim=True))
    else:
        grad = grad_scores * scores * (1.0 - scores)
    return grad.to(router_logits.dtype)


def dispatch(hidden: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, copy_rows: bool = True):
    """Permute token rows into expert-contiguous order. Returns (sorted_hidden, order, offsets); without copy_rows
    sorted_hidden is empty ([0, H])."""
    top_k = expert_ids.shape[-1]
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids.to(torch.int32), stable=True)  # 32-bit keys: half the radix passes
    counts = _counts(flat_ids, num_experts + 1)[:num_experts]
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    rows = hidden.index_select(0, order // top_k) if copy_rows else hidden.new_empty(0, hidden.shape[-1])
    return rows, order, offsets


def dispatch_backward(grad_sorted: torch.Tensor, order: torch.Tensor, tokens: int, top_k: int):
    grad = grad_sorted.new_zeros(tokens, grad_sorted.shape[-1])
    return grad.index_add_(0, order // top_k, grad_sorted)


def _groups(offsets: torch.Tensor):
    start = 0
    for e, end in enumerate(offsets.tolist()):
        yield e, start, end
        start = end


def _grouped_ffn(x, offsets, expert_weights, b_in, b_out, out_features: int, activation: str, gated: bool,
                 interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0, between=None, first=None,
                 keep_h=None):
    """Rows of group e go through expert e: act(x W_in[e]^T + b_in[e]) W_out[e]^T + b_out[e], with
    (W_in[e], W_out[e]) = expert_weights(e), `first` (if given) applied to x W_in[e]^T before the bias and
    `between` to the activation (how a kernel rounds them). keep_h (if given) receives each group's x W_in[e]^T."""
    def ffn(e, rows):
        w_in, w_out = expert_weights(e)
        h = rows @ w_in.t()
        pre = h if first is None else first(h)
        if b_in is not None:
            pre = pre + b_in[e]
        a = expert_activation(activation, gated, pre, interleaved, alpha, limit)
        out = (a if between is None else between(a)) @ w_out.t()
        return h, out + b_out[e] if b_out is not None else out

    y = x.new_zeros(x.shape[0], out_features)
    if offsets.is_cuda and torch.cuda.is_current_stream_capturing():
        # the group bounds cannot be read on the host while a CUDA graph is captured: every expert takes every row
        # and keeps its group's (E times the work; what device kernels cannot take, e.g. float32, still captures)
        row = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
        starts = torch.cat([offsets.new_zeros(1), offsets[:-1]])
        for e in range(offsets.shape[0]):
            mine = (row >= starts[e]) & (row < offsets[e])
            h, out = ffn(e, x)
            y = torch.where(mine, out, y)
            if keep_h is not None:
                keep_h.copy_(torch.where(mine, h, keep_h))
        return y
    for e, start, end in _groups(offsets):
        if end > start:
            h, y[start:end] = ffn(e, x[start:end])
            if keep_h is not None:
                keep_h[start:end] = h
    return y


def experts(x, offsets, w_in, b_in, w_out, b_out, activation: str, gated: bool, interleaved: bool = False,
            alpha: float = 1.702, limit: float = 7.0):
    """Grouped FFN: rows of group e go through expert e: act(x W_in[e]^T + b_in[e]) W_out[e]^T + b_out[e].

    Gated experts hold gate and up rows in w_in as [gate | up] halves, or interleaved row by row (GPT-OSS);
    alpha and limit parameterise the "swiglu_oai" activation. Weights may be strided views (a transposed HF
    parameter), never copied here."""
    return _grouped_ffn(x, offsets, lambda e: (w_in[e], w_out[e]), b_in, b_out, w_out.shape[1], activation, gated,
                        interleaved, alpha, limit)


def experts_train(x, offsets, w_in, b_in, w_out, b_out, activation: str, gated: bool, interleaved: bool = False,
                  alpha: float = 1.702, limit: float = 7.0):
    """(experts(...), h): h = x W_in[e]^T per group, before the bias (zero on rows past the groups), which
    experts_backward then takes instead of recomputing the first projection."""
    h = x.new_zeros(x.shape[0], w_in.shape[1])
    y = _grouped_ffn(x, offsets, lambda e: (w_in[e], w_out[e]), b_in, b_out, w_out.shape[1], activation, gated,
                     interleaved, alpha, limit, keep_h=h)
    return y, h


def quantize_fp8(x, group: int):
    """Per row per `group` channels: (x_fp8, scale_inv) with x ≈ x_fp8 * scale_inv (moecompile/core/fp8_format.py)."""
    return fp8.quantize_groups(x, group)


def experts_fp8(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                activation: str, gated: bool, out_dtype: torch.dtype):
    """experts() on FP8 operands, as a block-scaled FP8 GEMM computes it: x (1 × 128 scales) and the weights
    (128 × 128 scales) dequantised to float32, float32 products, and the intermediate activation quantised per row
    per 128 channels before the second GEMM. Each expert's weights are dequantised only when it has rows."""
    x = fp8.dequantize_groups(x_fp8, x_scale_inv, fp8.ACT_GROUP)

    def expert_weights(e):
        return (fp8.dequantize_blocks(w_in[e], w_in_scale_inv[e]), fp8.dequantize_blocks(w_out[e], w_out_scale_inv[e]))

    y = _grouped_ffn(x, offsets, expert_weights, b_in, b_out, w_out.shape[1], activation, gated,
                     between=fp8.fake_quantize_groups)
    return y.to(out_dtype)


def experts_backward(grad_y, x, offsets, w_in, b_in, w_out, activation: str, gated: bool, has_b_out: bool,
                     interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0, h=None):
    """Returns (grad_x, grad_w_in, grad_b_in, grad_w_out, grad_b_out); bias grads are None without a bias.
    h: experts_train's first projection (before the bias), read instead of recomputed when given."""
    glu = (interleaved, alpha, limit)
    grad_x = torch.zeros_like(x)
    grad_w_in, grad_w_out = torch.zeros_like(w_in), torch.zeros_like(w_out)
    grad_b_in = torch.zeros_like(b_in) if b_in is not None else None
    grad_b_out = grad_y.new_zeros(w_out.shape[0], w_out.shape[1]) if has_b_out else None
    for e, start, end in _groups(offsets):
        if end == start:
            continue
        xe, ge = x[start:end], grad_y[start:end]
        he = xe @ w_in[e].t() if h is None else h[start:end]
        if b_in is not None:
            he = he + b_in[e]
        a = expert_activation(activation, gated, he, *glu)
        grad_w_out[e] = ge.t() @ a
        if grad_b_out is not None:
            grad_b_out[e] = ge.sum(0)
        grad_h = expert_activation_backward(activation, gated, he, ge @ w_out[e], *glu)
        grad_w_in[e] = grad_h.t() @ xe
        if grad_b_in is not None:
            grad_b_in[e] = grad_h.sum(0)
        grad_x[start:end] = grad_h @ w_in[e]
    return grad_x, grad_w_in, grad_b_in, grad_w_out, grad_b_out


def _unpermute(sorted_rows: torch.Tensor, order: torch.Tensor, tokens: int, top_k: int):
    rows = sorted_rows.new_empty(sorted_rows.shape).index_copy_(0, order, sorted_rows)
    return rows.view(tokens, top_k, sorted_rows.shape[-1])  # explicit width: -1 is ambiguous when tokens == 0


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in at least float32 (half/bf16 upcast, float64 kept)."""
    return torch.promote_types(dtype, torch.float32)


def weighted_terms(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor):
    """[T, k, H] in >= float32: weights[t, j] * expert_out[row of assignment (t, j)], 0 for a dropped assignment."""
    tokens, top_k = weights.shape
    rows = _unpermute(expert_out, order, tokens, top_k)
    acc = acc_dtype(expert_out.dtype)
    kept = (weights != 0).unsqueeze(-1)
    return torch.where(kept, rows.to(acc) * weights.to(acc).unsqueeze(-1), 0.0)


def combine(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor):
    """out[t] = sum_j weights[t, j] * expert_out[row of assignment (t, j)], accumulated in >= float32."""
    return weighted_terms(expert_out, order, weights).sum(1).to(expert_out.dtype)


def combine_backward(grad_out, expert_out, order, weights):
    """Returns (grad_expert_out, grad_weights)."""
    tokens, top_k = weights.shape
    rows = _unpermute(expert_out, order, tokens, top_k)
    acc = acc_dtype(expert_out.dtype)
    grad_weights = torch.where(weights != 0, (rows.to(acc) * grad_out.to(acc).unsqueeze(1)).sum(-1), 0.0)
    grad_rows = grad_out.to(acc).unsqueeze(1) * weights.to(acc).unsqueeze(-1)
    grad_rows = grad_rows.reshape(tokens * top_k, grad_out.shape[-1])
    return grad_rows.index_select(0, order).to(expert_out.dtype), grad_weights.to(weights.dtype)


def experts_combine_train(x, offsets, order, weights, w_in, b_in, w_out, b_out, activation: str, gated: bool):
    """(combine(y, order, weights), h, y) with (y, h) = experts_train(...)."""
    y, h = experts_train(x, offsets, w_in, b_in, w_out, b_out, activation, gated)
    return combine(y, order, weights), h, y


def experts_combine_backward(grad_out, x, offsets, order, weights, w_in, b_in, w_out, activation: str, gated: bool,
                             has_b_out: bool, h, y):
    """(grad_x, grad_weights, grad_w_in, grad_b_in, grad_w_out, grad_b_out) of combine(experts_train(...)): the
    combine's backward, then the experts'."""
    grad_rows, grad_weights = combine_backward(grad_out, y, order, weights)
    grad_x, grad_w_in, grad_b_in, grad_w_out, grad_b_out = experts_backward(
        grad_rows, x, offsets, w_in, b_in, w_out, activation, gated, has_b_out, h=h)
    return grad_x, grad_weights, grad_w_in, grad_b_in, grad_w_out, grad_b_out


def experts_combine_backward_reads_y(x, w_in, w_out, activation: str, gated: bool, has_b_out: bool) -> bool:
    """Whether experts_combine_backward reads the expert rows y for these operands (always: the combine's backward
    takes the weights' gradient from them); a device whose backward does not lets the forward drop y."""
    return True


# ---- routed_experts: dispatch + experts + combine as one op (what direct_experts emits)

def routed_experts(x, weights, expert_ids, w_in, b_in, w_out, b_out, activation: str, gated: bool,
                   interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0):
    rows, order, offsets = dispatch(x, expert_ids, w_in.shape[0])
    out = experts(rows, offsets, w_in, b_in, w_out, b_out, activation, gated, interleaved, alpha, limit)
    return weighted_terms(out, order, weights)


def routed_experts_fp8(x, weights, expert_ids, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                       activation: str, gated: bool):
    """routed_experts() over FP8 block-scaled expert weights (weight-only: x is not quantised), in float32: each
    expert's weights dequantised when some assignment names it."""
    rows, order, offsets = dispatch(x.float(), expert_ids, w_in.shape[0])

    def expert_weights(e):
        return fp8.dequantize_blocks(w_in[e], w_in_scale_inv[e]), fp8.dequantize_blocks(w_out[e], w_out_scale_inv[e])

    as_float = (lambda b: None if b is None else b.float())
    y = _grouped_ffn(rows, offsets, expert_weights, as_float(b_in), as_float(b_out), w_out.shape[1], activation, gated)
    return weighted_terms(y, order, weights)


# ---- linear_fp8: a linear over FP8 block-scaled weights (weight-only)

def linear_fp8(x, weight, weight_scale_inv, bias):
    """x [..., K] W^T + b with W [N, K] dequantised from its 128 x 128 blocks; float32 math, output in x's dtype."""
    w = fp8.dequantize_blocks(weight, weight_scale_inv)
    return torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


# ---- decode_attention: one query token per sequence over a key/value cache (what the decode_attention pass emits)

def decode_attention(query, key, value, attn_mask, scale: float):
    """softmax(scale q k^T + mask) v in float32, key/value head h // n for query head h (n = H / KV), 0 for a row
    whose mask keeps nothing; output in query's dtype."""
    n = query.shape[1] // key.shape[1]
    k, v = (t.float().repeat_interleave(n, dim=1) for t in (key, value))
    scores = (query.float() @ k.transpose(-1, -2)) * scale
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    kept = torch.isfinite(scores).any(-1, keepdim=True)
    weights = torch.softmax(torch.where(kept, scores, 0.0), dim=-1) * kept
    return (weights @ v).to(query.dtype)


# ---- route_dispatch: router linear + route_grouped + dispatch as one op (what fuse_route_dispatch emits)

def router_logits(hidden, router_weight, router_bias, logits_fp32: bool):
    """hidden @ router_weight^T (+ bias), in float32 when logits_fp32 (DeepSeek-V3, MoEBlock) or else in the
    operands' dtype (Mixtral, Qwen: the router runs in the model dtype and only the softmax in float32)."""
    if logits_fp32:
        bias = router_bias.float() if router_bias is not None else None
        return torch.nn.functional.linear(hidden.float(), router_weight.float(), bias)
    return torch.nn.functional.linear(hidden, router_weight, router_bias)


def route_dispatch(hidden, router_weight, router_bias, top_k: int, capacity_factor: float, renormalize: bool,
                   scoring: str, correction_bias, n_group: int, topk_group: int, scaling_factor: float,
                   logits_fp32: bool, copy_rows: bool = True):
    """Returns (weights [T, k] float32, expert_ids [T, k], sorted rows [T * k, H] (without copy_rows: [0, H]),
    order [T * k], offsets [E])."""
    logits = router_logits(hidden, router_weight, router_bias, logits_fp32)
    weights, ids = route_grouped(logits, top_k, capacity_factor, renormalize, scoring, correction_bias, n_group,
                                 topk_group, scaling_factor)
    return (weights, ids, *dispatch(hidden, ids, router_weight.shape[0], copy_rows))


def experts_gathered(hidden, order, offsets, top_k: int, w_in, b_in, w_out, b_out, activation: str, gated: bool):
    """experts over hidden's rows in expert order: hidden[order // top_k]."""
    return experts(hidden.index_select(0, order // top_k), offsets, w_in, b_in, w_out, b_out, activation, gated)


def route_dispatch_backward(grad_weights, grad_rows, hidden, router_weight, router_bias, expert_ids, order,
                            top_k: int, renormalize: bool, scoring: str, correction_bias, n_group: int,
                            topk_group: int, scaling_factor: float, logits_fp32: bool):
    """Returns (grad_hidden, grad_router_weight, grad_router_bias or None): the rows' gradient un-permuted plus
    the routing weights' gradient through the router linear (logits recomputed, not stored)."""
    logits = router_logits(hidden, router_weight, router_bias, logits_fp32)
    grad_logits = route_grouped_backward(grad_weights, logits, expert_ids, top_k, renormalize, scoring,
                                         correction_bias, n_group, topk_group, scaling_factor)
    x = hidden.float() if logits_fp32 else hidden
    w = router_weight.float() if logits_fp32 else router_weight
    grad_hidden = dispatch_backward(grad_rows, order, hidden.shape[0], top_k) + (grad_logits @ w).to(hidden.dtype)
    grad_weight = (grad_logits.t() @ x).to(router_weight.dtype)
    grad_bias = grad_logits.sum(0).to(router_bias.dtype) if router_bias is not None else None
    return grad_hidden, grad_weight, grad_bias
