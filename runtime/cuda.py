"""The moecompile ops' CUDA entry points, registered for device type "cuda" (imported by the registry on first use;
without triton the import fails and the reference kernels run). Each decides what runs: the reference kernel for
what the device kernels cannot take, else Triton routing and counting-sort dispatch, the expert GEMMs on the Triton
grouped GEMMs or torch._grouped_mm as runtime/choices.py picks for the shape, the Triton weighted combine. The FP8
ops are runtime/fp8.py's. No host synchronisation: CUDA-graph capturable.

Rows of `experts`' output at or past offsets[-1] (dropped assignments) are left unspecified here; combine never
reads them.
"""
import torch

from moecompile.core.logits import float32_logits, float32_logits_backward
from moecompile.kernels import (
    grouped_mm,
    quack_gemm,
    reference,
    triton_decode_attention,
    triton_direct,
    triton_moe,
    triton_routing,
)
from moecompile.runtime import choices, fp8
from moecompile.runtime.registry import KEPT_H, register_kernel


def _routable(router_logits: torch.Tensor, n_group: int = 1, topk_group: int = 1) -> bool:
    """Whether the Triton routing kernels take these logits and this expert grouping."""
    num_experts = router_logits.shape[-1]
    return (router_logits.is_cuda and num_experts <= triton_routing.MAX_EXPERTS
            and triton_routing.groups_supported(num_experts, n_group, topk_group))


def route(router_logits, top_k: int, capacity_factor: float, renormalize: bool):
    if not _routable(router_logits):
        return reference.route(router_logits, top_k, capacity_factor, renormalize)
    weights, ids = triton_routing.topk(router_logits, top_k, renormalize,
                                       pdl=choices.programmatic_launch(router_logits))
    return reference.drop_over_capacity(weights, ids, capacity_factor, router_logits.shape[-1])


def route_grouped(router_logits, top_k: int, capacity_factor: float, renormalize: bool, scoring: str,
                  correction_bias, n_group: int, topk_group: int, scaling_factor: float):
    if not _routable(router_logits, n_group, topk_group):
        return reference.route_grouped(router_logits, top_k, capacity_factor, renormalize, scoring, correction_bias,
                                       n_group, topk_group, scaling_factor)
    weights, ids = triton_routing.topk(router_logits, top_k, renormalize, scoring, correction_bias, scaling_factor,
                                       n_group, topk_group, pdl=choices.programmatic_launch(router_logits))
    return reference.drop_over_capacity(weights, ids, capacity_factor, router_logits.shape[-1])


def route_backward(grad_weights, router_logits, expert_ids, top_k: int, renormalize: bool):
    if not _routable(router_logits):
        return reference.route_backward(grad_weights, router_logits, expert_ids, top_k, renormalize)
    return triton_routing.topk_backward(grad_weights, router_logits, expert_ids, top_k, renormalize)


def route_grouped_backward(grad_weights, router_logits, expert_ids, top_k: int, renormalize: bool, scoring: str,
                           correction_bias, n_group: int, topk_group: int, scaling_factor: float):
    if not _routable(router_logits, n_group, topk_group):
        return reference.route_grouped_backward(grad_weights, router_logits, expert_ids, top_k, renormalize, scoring,
                                                correction_bias, n_group, topk_group, scaling_factor)
    return triton_routing.topk_backward(grad_weights, router_logits, expert_ids, top_k, renormalize, scoring,
                                        correction_bias, scaling_factor, n_group, topk_group)


def dispatch(hidden, expert_ids, num_experts: int, copy_rows: bool = True, ranks=None):
    """(rows, order, offsets); without copy_rows the rows are empty ([0, H]), for experts that gather them. ranks:
    triton_routing.topk(ranked=True)'s, in place of dispatch's own."""
    if not hidden.is_cuda:
        return reference.dispatch(hidden, expert_ids, num_experts, copy_rows)
    rows, order, offsets = triton_routing.dispatch(hidden, expert_ids, num_experts, copy_rows=copy_rows, ranks=ranks)
    return rows if copy_rows else hidden.new_empty(0, hidden.shape[1]), order, offsets


def _router_logits(hidden, router_weight, router_bias, logits_fp32: bool):
    """The reference's, float32 ones as the module's router computes them (core/logits.py: on tensor cores for
    16-bit operands)."""
    if logits_fp32:
        return float32_logits(hidden, router_weight, router_bias)
    return reference.router_logits(hidden, router_weight, router_bias, logits_fp32)


def route_dispatch(hidden, router_weight, router_bias, top_k: int, capacity_factor: float, renormalize: bool,
                   scoring: str, correction_bias, n_group: int, topk_group: int, scaling_factor: float,
                   logits_fp32: bool, copy_rows: bool = True):
    logits = _router_logits(hidden, router_weight, router_bias, logits_fp32)
    tokens, num_experts = logits.shape
    if (_routable(logits, n_group, topk_group) and triton_routing.route_dispatch_fits(tokens, num_experts)
            and choices.one_launch_route(tokens, num_experts)
            and reference.capacity(capacity_factor, tokens, top_k, num_experts) < 0):  # decode: one launch
        weights, ids, rows, order, offsets = triton_routing.small_route_dispatch(
            hidden, logits, top_k, renormalize, scoring, correction_bias, scaling_factor, n_group, topk_group)
        return weights, ids, rows if copy_rows else hidden.new_empty(0, hidden.shape[1]), order, offsets
    if (_routable(logits, n_group, topk_group) and triton_routing.sorts_by_counting(tokens * top_k, copy_rows)
            and reference.capacity(capacity_factor, tokens, top_k, num_experts) < 0):  # the top-k ranks (no drops)
        weights, ids, ranks = triton_routing.topk(logits, top_k, renormalize, scoring, correction_bias, scaling_factor,
                                                  n_group, topk_group, pdl=choices.programmatic_launch(logits),
                                                  ranked=True)
        return (weights, ids, *dispatch(hidden, ids, num_experts, copy_rows, ranks))
    weights, ids = route_grouped(logits, top_k, capacity_factor, renormalize, scoring, correction_bias, n_group,
                                 topk_group, scaling_factor)
    return (weights, ids, *dispatch(hidden, ids, num_experts, copy_rows))


def route_dispatch_backward(grad_weights, grad_rows, hidden, router_weight, router_bias, expert_ids, order,
                            top_k: int, renormalize: bool, scoring: str, correction_bias, n_group: int,
                            topk_group: int, scaling_factor: float, logits_fp32: bool):
    """As the reference's, with the logits of _router_logits and their gradient's GEMMs as the module's router
    trains them, and the rows' gradient summed by a per-token gather."""
    logits = _router_logits(hidden, router_weight, router_bias, logits_fp32)
    grad_logits = route_grouped_backward(grad_weights, logits, expert_ids, top_k, renormalize, scoring,
                                         correction_bias, n_group, topk_group, scaling_factor)
    grad_x, grad_weight = (float32_logits_backward(grad_logits, hidden, router_weight) if logits_fp32 else
                           (grad_logits @ router_weight, grad_logits.t() @ hidden))
    grad_hidden = dispatch_backward(grad_rows, order, hidden.shape[0], top_k) + grad_x.to(hidden.dtype)
    grad_bias = grad_logits.sum(0).to(router_bias.dtype) if router_bias is not None else None
    return grad_hidden, grad_weight.to(router_weight.dtype), grad_bias


def _projection_kernels(x, w_in, w_out, activation: str, gated: bool, training: bool = False,
                        rows: int | None = None) -> tuple[str, str]:
    """(first, second) projection kernels for x's rows (or `rows` of them, gathered from x)."""
    rows = x.shape[0] if rows is None else rows
    first, second = choices.expert_gemm_kernels(rows, x.shape[1], w_out.shape[2], w_out.shape[0], training)
    if {first, second} & set(choices.QUACK_KERNELS) and not quack_gemm.supported(x, w_in, w_out, activation, gated):
        first, second = (choices.QUACK_FALLBACK if v in choices.QUACK_KERNELS else v for v in (first, second))
    if not triton_moe.tma_supported(x, w_in):  # unaligned rows: the pointer-load kernel
        first, second = ("triton" if triton_moe.needs_tma(v) else v for v in (first, second))
    return first, second


def _group_starts(offsets, kernels: tuple[str, str]):
    """QuACK's group starts (cu_seqlens) where a projection runs on QuACK: one launch that both share."""
    return triton_routing.group_starts(offsets) if set(kernels) & set(choices.QUACK_KERNELS) else None


def _second_projection(a, offsets, w_out, b_out, kernel: str, starts):
    """a W_out^T + b_out over dispatched rows on `kernel`; starts: _group_starts'."""
    if kernel == "quack":
        return quack_gemm.second_projection(a, starts, w_out, b_out,
                                            config=choices.quack_config("second", w_out.shape[2], w_out.shape[1]))
    if kernel.startswith("triton"):
        return triton_moe.grouped_ffn_in(a, offsets, w_out, b_out, None, False, variant=kernel)
    y = grouped_mm.grouped(a, w_out.transpose(-2, -1), offsets)
    if b_out is not None:
        grouped_mm.add_expert_bias(y, offsets, b_out)
    return y


def _grouped_mm_first_projection(x, offsets, w_in, b_in, activation: str, gated: bool):
    """(a, h): h = x W_in^T on torch._grouped_mm, then a = act(h + b_in) in one Triton pass."""
    h = grouped_mm.grouped(x, w_in.transpose(-2, -1), offsets)
    return triton_moe.expert_activation(h, offsets, b_in, activation, gated), h


def _quack_first_projection(x, w_in, b_in, activation: str, gated: bool, starts):
    """(a, h) on QuACK over dispatched rows (groups from starts: _group_starts'), with the tuned configuration: QuACK
    writes h there in any case."""
    return quack_gemm.first_projection_train(x, starts, w_in, b_in, activation, gated,
                                             config=choices.quack_config("first", w_in.shape[2], w_in.shape[1]))


def experts(x, offsets, w_in, b_in, w_out, b_out, activation: str, gated: bool):
    if not grouped_mm.supported(x, w_in, w_out):
        return reference.experts(x, offsets, w_in, b_in, w_out, b_out, activation, gated)
    first, second = _projection_kernels(x, w_in, w_out, activation, gated)
    starts = _group_starts(offsets, (first, second))
    return _second_projection(_first_projection(x, offsets, w_in, b_in, activation, gated, first, starts), offsets,
                              w_out, b_out, second, starts)


def _first_projection(x, offsets, w_in, b_in, activation: str, gated: bool, kernel: str, starts):
    """act(x W_in^T + b_in) over dispatched rows on `kernel` (QuACK gathering reads the rows as given here)."""
    if kernel in choices.QUACK_KERNELS:
        return _quack_first_projection(x, w_in, b_in, activation, gated, starts)[0]
    if kernel.startswith("triton"):
        return triton_moe.grouped_ffn_in(x, offsets, w_in, b_in, activation, gated, variant=kernel)
    return _grouped_mm_first_projection(x, offsets, w_in, b_in, activation, gated)[0]


def experts_gathered(hidden, order, offsets, top_k: int, w_in, b_in, w_out, b_out, activation: str, gated: bool):
    """QuACK's first projection gathers its rows from hidden where "quack_gathered" is the chosen kernel (no row copy,
    and no pre-activation written); the other kernels read a gathered copy, as dispatch would have written it."""
    if order.shape[0] and grouped_mm.supported(hidden, w_in, w_out):
        a, second, starts = gathered_first_projection(hidden, order, offsets, top_k, w_in, b_in, w_out, activation,
                                                      gated)
        return _second_projection(a, offsets, w_out, b_out, second, starts)
    return experts(hidden.index_select(0, order // top_k), offsets, w_in, b_in, w_out, b_out, activation, gated)


def gathered_first_projection(hidden, order, offsets, top_k: int, w_in, b_in, w_out, activation: str, gated: bool):
    """(the first projection's output over the rows hidden[order // top_k], the second projection's kernel, QuACK's
    group starts or None), on the kernels the table picks for this many rows: QuACK gathering the rows itself, or
    any kernel on their copy."""
    first, second = _projection_kernels(hidden, w_in, w_out, activation, gated, rows=order.shape[0])
    if first == "quack_gathered":
        starts, tokens = triton_routing.gather_indices(order, offsets, top_k)
        a = quack_gemm.first_projection(hidden.contiguous(), starts, w_in, b_in, activation, gated, gather_rows=tokens,
                                        config=choices.quack_config("first", w_in.shape[2], w_in.shape[1],
                                                                    gathered=True))
        return a, second, starts
    starts = _group_starts(offsets, (first, second))
    return _first_projection(triton_routing.gather_rows(hidden, order, top_k), offsets, w_in, b_in, activation, gated,
                             first, starts), second, starts


def _trains_on_quack(x, w_in, w_out, activation: str, gated: bool) -> bool:
    """Whether training runs its GEMMs on QuACK: where training's first projection is QuACK's, as experts_train
    picks it, so the h experts_train keeps is the h the backward reads."""
    return _projection_kernels(x, w_in, w_out, activation, gated, training=True)[0] in choices.QUACK_KERNELS


def experts_train(x, offsets, w_in, b_in, w_out, b_out, activation: str, gated: bool):
    """(experts(...), h): the first projection's pre-activation kept for experts_backward, in the form its GEMMs
    read: QuACK's (bias added, gated columns alternating) where training runs on QuACK, else torch._grouped_mm's
    x W_in^T followed by the activation in one Triton pass. The second projection as experts() runs it."""
    if not grouped_mm.supported(x, w_in, w_out):
        return reference.experts_train(x, offsets, w_in, b_in, w_out, b_out, activation, gated)
    first, second = _projection_kernels(x, w_in, w_out, activation, gated, training=True)
    starts = _group_starts(offsets, (first, second))
    if first in choices.QUACK_KERNELS:
        a, h = _quack_first_projection(x, w_in, b_in, activation, gated, starts)
    else:
        a, h = _grouped_mm_first_projection(x, offsets, w_in, b_in, activation, gated)
    return _second_projection(a, offsets, w_out, b_out, second, starts), h


def experts_backward(grad_y, x, offsets, w_in, b_in, w_out, activation: str, gated: bool, has_b_out: bool, h=None):
    if not grouped_mm.supported(x, w_in, w_out):
        return reference.experts_backward(grad_y, x, offsets, w_in, b_in, w_out, activation, gated, has_b_out, h=h)
    num_experts = w_in.shape[0]
    on_quack = _trains_on_quack(x, w_in, w_out, activation, gated)
    if on_quack:
        starts = triton_routing.group_starts(offsets)
        if h is None:  # experts() kept nothing: recompute the first projection
            h = _quack_first_projection(x, w_in, b_in, activation, gated, starts)[1]
        configs = choices.quack_backward_configs(x.shape[1], w_out.shape[2], w_in.shape[1])
        grad_x, grad_w_in, grad_w_out, grad_h = quack_gemm.backward(
            grad_y, x, starts, w_in, w_out, h, activation, gated, configs)
    else:
        if h is None:
            h = grouped_mm.grouped(x, w_in.transpose(-2, -1), offsets)
        grad_a = grouped_mm.grouped(grad_y, w_out, offsets)
        a, grad_h = triton_moe.expert_activation_backward(h, offsets, b_in, grad_a, activation, gated)
        grad_w_out = grouped_mm.grouped(grad_y.t(), a, offsets)
        grad_w_in = grouped_mm.grouped(grad_h.t(), x, offsets)
        grad_x = grouped_mm.grouped(grad_h, w_in, offsets)
    grad_b_in = _finish_backward(grad_x, grad_h, offsets, b_in, num_experts, on_quack and gated)
    grad_b_out = grouped_mm.segment_sum(grad_y, offsets, num_experts) if has_b_out else None
    return grad_x, grad_w_in, grad_b_in, grad_w_out, grad_b_out


def _finish_backward(grad_x, grad_h, offsets, b_in, num_experts: int, alternating: bool):
    """Zeroes grad_x's rows past the groups (dropped slots) and returns b_in's gradient (None without b_in) from
    grad_h, whose gated columns alternate gate / up where `alternating` (QuACK's h)."""
    triton_moe.zero_rows_past_groups(grad_x, offsets)
    if b_in is None:
        return None
    grad_b_in = grouped_mm.segment_sum(grad_h, offsets, num_experts)
    return quack_gemm.concatenated_columns(grad_b_in) if alternating else grad_b_in


def experts_combine_train(x, offsets, order, weights, w_in, b_in, w_out, b_out, activation: str, gated: bool):
    y, h = experts_train(x, offsets, w_in, b_in, w_out, b_out, activation, gated)
    return combine(y, order, weights), h, y


def _folds_combine(x, w_in, w_out, activation: str, gated: bool, has_b_out: bool) -> bool:
    """Whether experts_combine_backward folds the combine's backward into the QuACK backward: gated experts without
    an output bias, trained on QuACK, where choices.folds_combine."""
    return (gated and not has_b_out and grouped_mm.supported(x, w_in, w_out)
            and choices.folds_combine(x.shape[1], w_out.shape[2], w_in.shape[1])
            and _trains_on_quack(x, w_in, w_out, activation, gated))


def experts_combine_backward_reads_y(x, w_in, w_out, activation: str, gated: bool, has_b_out: bool) -> bool:
    return not _folds_combine(x, w_in, w_out, activation, gated, has_b_out)


def experts_combine_backward(grad_out, x, offsets, order, weights, w_in, b_in, w_out, activation: str, gated: bool,
                             has_b_out: bool, h, y):
    """Where _folds_combine the combine's backward runs inside the experts' QuACK GEMMs
    (quack_gemm.combined_backward: no [N, H] row gradient written, y unread: the forward kept none); else
    combine_backward, then experts_backward. A y the forward did not keep means the forward chose the fold, so the
    backward follows that choice even if the settings changed in between."""
    forward_folded = y.numel() == 0 < order.numel()
    if not (forward_folded or _folds_combine(x, w_in, w_out, activation, gated, has_b_out)):
        grad_rows, grad_weights = combine_backward(grad_out, y, order, weights)
        grad_x, grad_w_in, grad_b_in, grad_w_out, grad_b_out = experts_backward(
            grad_rows, x, offsets, w_in, b_in, w_out, activation, gated, has_b_out, h=h)
        return grad_x, grad_weights, grad_w_in, grad_b_in, grad_w_out, grad_b_out
    starts, tokens = triton_routing.gather_indices(order, offsets, weights.shape[1])
    scores = weights.reshape(-1).index_select(0, order).float()
    configs = choices.quack_backward_configs(x.shape[1], w_out.shape[2], w_in.shape[1], combined=True)
    grad_x, grad_w_in, grad_w_out, grad_h, grad_scores = quack_gemm.combined_backward(
        grad_out, tokens, scores, x, starts, w_in, w_out, h, activation, configs)
    # a dropped slot (weight 0, its row past the groups, grad_scores unwritten there) gets none, as in combine_backward
    grad_weights = grad_scores.new_empty(scores.shape).index_copy_(0, order, grad_scores).view(weights.shape)
    grad_weights = torch.where(weights != 0, grad_weights, 0.0).to(weights.dtype)
    grad_b_in = _finish_backward(grad_x, grad_h, offsets, b_in, w_in.shape[0], True)
    return grad_x, grad_weights, grad_w_in, grad_b_in, grad_w_out, None


def routed_experts(x, weights, expert_ids, w_in, b_in, w_out, b_out, activation: str, gated: bool):
    if x.dtype in triton_direct.DTYPES:  # the graph asked for it (direct_experts): the batch is decode-sized
        return triton_direct.routed_experts(x, weights, expert_ids, w_in, b_in, w_out, b_out, activation, gated,
                                            choices.direct_expert_tiles(x.shape[1], w_out.shape[2]),
                                            pdl=choices.programmatic_launch(x))
    rows, order, offsets = dispatch(x, expert_ids, w_in.shape[0])
    return reference.weighted_terms(experts(rows, offsets, w_in, b_in, w_out, b_out, activation, gated), order,
                                    weights)


def decode_attention(query, key, value, attn_mask, scale: float):
    batch, kv_heads, length, value_dim = value.shape
    mask = None if attn_mask is None else attn_mask[:, 0, 0].expand(batch, length)
    if (query.dtype not in triton_decode_attention.DTYPES or max(query.shape[-1], value_dim) > 256
            or key.stride(-1) != 1 or value.stride(-1) != 1 or (mask is not None and mask.stride(-1) != 1)):
        return reference.decode_attention(query, key, value, attn_mask, scale)
    runs = choices.decode_attention_runs(batch, kv_heads, length,
                                         torch.cuda.get_device_properties(query.device).multi_processor_count)
    return triton_decode_attention.decode_attention(query, key, value, mask, scale, runs,
                                                    block_l=choices.DECODE_ATTENTION_BLOCK)


def combine(expert_out, order, weights):
    return triton_moe.combine(expert_out, order, weights)


def combine_backward(grad_out, expert_out, order, weights):
    return triton_moe.combine_backward(grad_out, expert_out, order, weights)


def dispatch_backward(grad_sorted, order, tokens: int, top_k: int):
    return triton_moe.gather_sum(grad_sorted, order, tokens, top_k)


for _op in ("route", "route_backward", "route_grouped", "route_grouped_backward", "dispatch", "route_dispatch",
            "route_dispatch_backward", "experts", "experts_gathered", "experts_train",
            "routed_experts", "decode_attention", "combine", "combine_backward", "dispatch_backward",
            "experts_combine_train", "experts_combine_backward", "experts_combine_backward_reads_y"):
    register_kernel(_op, "cuda", globals()[_op])
register_kernel("experts_backward", "cuda", experts_backward, supports={KEPT_H})
register_kernel("quantize_fp8", "cuda", fp8.quantize_fp8)
register_kernel("experts_fp8", "cuda", fp8.experts_fp8)
register_kernel("routed_experts_fp8", "cuda", fp8.routed_experts_fp8)
register_kernel("linear_fp8", "cuda", fp8.linear_fp8)
