"""The MoE ops: torch.library custom ops in the `moecompile` namespace.

Each op is one graph node through torch.export, Dynamo and AOT autograd (register_fake gives its shapes) and
runs the kernel the runtime registry picks for the input's device. Backward passes are ops too, so a device can
supply fused backward kernels. Shapes: T tokens, k = top_k, E experts, N = T * k, H hidden, F expert rows.
"""
from typing import Optional

import torch
from torch import Tensor

from moecompile.core.errors import MoECompileError
from moecompile.runtime import choices
from moecompile.runtime.registry import INTERLEAVED, KEPT_H, Kernel, kernel_entry, kernel_for


def _kernel(op: str, tensor: Tensor):
    return kernel_for(op, tensor.device)


# ---- route: router logits [T, E] -> weights [T, k] float32, expert ids [T, k] int64 (E marks a dropped slot)

@torch.library.custom_op("moecompile::route", mutates_args=())
def route(router_logits: Tensor, top_k: int, capacity_factor: float, renormalize: bool) -> tuple[Tensor, Tensor]:
    return _kernel("route", router_logits)(router_logits, top_k, capacity_factor, renormalize)


@route.register_fake
def _(router_logits, top_k, capacity_factor, renormalize):
    tokens = router_logits.shape[0]
    return (router_logits.new_empty(tokens, top_k, dtype=torch.float32),
            router_logits.new_empty(tokens, top_k, dtype=torch.int64))


@torch.library.custom_op("moecompile::route_backward", mutates_args=())
def route_backward(grad_weights: Tensor, router_logits: Tensor, expert_ids: Tensor, top_k: int,
                   renormalize: bool) -> Tensor:
    return _kernel("route_backward", router_logits)(grad_weights, router_logits, expert_ids, top_k, renormalize)


@route_backward.register_fake
def _(grad_weights, router_logits, expert_ids, top_k, renormalize):
    return torch.empty_like(router_logits)


def _route_setup(ctx, inputs, output):
    router_logits, top_k, _, renormalize = inputs
    ctx.save_for_backward(router_logits, output[1])
    ctx.top_k, ctx.renormalize = top_k, renormalize


def _route_backward(ctx, grad_weights, grad_ids):
    router_logits, expert_ids = ctx.saved_tensors
    grad = route_backward(grad_weights.contiguous(), router_logits, expert_ids, ctx.top_k, ctx.renormalize)
    return grad, None, None, None


route.register_autograd(_route_backward, setup_context=_route_setup)


# ---- route_grouped: route generalised to DeepSeek-V3's router: softmax or sigmoid scores, a correction bias used
# for selection only, group-limited top-k (the topk_group best of n_group groups), a scaling factor

@torch.library.custom_op("moecompile::route_grouped", mutates_args=())
def route_grouped(router_logits: Tensor, top_k: int, capacity_factor: float, renormalize: bool,
                  scoring: str = "softmax", correction_bias: Optional[Tensor] = None, n_group: int = 1,
                  topk_group: int = 1, scaling_factor: float = 1.0) -> tuple[Tensor, Tensor]:
    return _kernel("route_grouped", router_logits)(router_logits, top_k, capacity_factor, renormalize, scoring,
                                                   correction_bias, n_group, topk_group, scaling_factor)


@route_grouped.register_fake
def _(router_logits, top_k, capacity_factor, renormalize, scoring="softmax", correction_bias=None, n_group=1,
      topk_group=1, scaling_factor=1.0):
    tokens = router_logits.shape[0]
    return (router_logits.new_empty(tokens, top_k, dtype=torch.float32),
            router_logits.new_empty(tokens, top_k, dtype=torch.int64))


@torch.library.custom_op("moecompile::route_grouped_backward", mutates_args=())
def route_grouped_backward(grad_weights: Tensor, router_logits: Tensor, expert_ids: Tensor, top_k: int,
                           renormalize: bool, scoring: str, correction_bias: Optional[Tensor], n_group: int,
                           topk_group: int, scaling_factor: float) -> Tensor:
    return _kernel("route_grouped_backward", router_logits)(grad_weights, router_logits, expert_ids, top_k,
                                                            renormalize, scoring, correction_bias, n_group,
                                                            topk_group, scaling_factor)


@route_grouped_backward.register_fake
def _(grad_weights, router_logits, expert_ids, top_k, renormalize, scoring, correction_bias, n_group, topk_group,
      scaling_factor):
    return torch.empty_like(router_logits)


def _route_grouped_setup(ctx, inputs, output):
    router_logits, top_k, _, *routing = inputs
    ctx.save_for_backward(router_logits, output[1], routing[2])
    ctx.top_k, ctx.routing = top_k, routing[:2] + [None] + routing[3:]  # the bias tensor goes through saved_tensors


def _route_grouped_backward(ctx, grad_weights, grad_ids):
    router_logits, expert_ids, correction_bias = ctx.saved_tensors
    renormalize, scoring, _, n_group, topk_group, scaling_factor = ctx.routing
    grad = route_grouped_backward(grad_weights.contiguous(), router_logits, expert_ids, ctx.top_k, renormalize,
                                  scoring, correction_bias, n_group, topk_group, scaling_factor)
    return grad, None, None, None, None, None, None, None, None


route_grouped.register_autograd(_route_grouped_backward, setup_context=_route_grouped_setup)


# ---- dispatch: tokens [T, H] -> rows in expert order [N, H], order [N] int64, offsets [E] int32

_UNCOPIED_ROWS = ("moecompile::{op} without copy_rows is inference-only (experts_gathered reads the tokens instead, "
                  "and has no backward)")

@torch.library.custom_op("moecompile::dispatch", mutates_args=())
def dispatch(hidden: Tensor, expert_ids: Tensor, num_experts: int, copy_rows: bool = True
             ) -> tuple[Tensor, Tensor, Tensor]:
    """Without copy_rows, rows is empty ([0, H]): the experts gather the token rows themselves (experts_gathered)."""
    return _kernel("dispatch", hidden)(hidden, expert_ids, num_experts, copy_rows)


@dispatch.register_fake
def _(hidden, expert_ids, num_experts, copy_rows=True):
    rows = expert_ids.numel()
    return (hidden.new_empty(rows if copy_rows else 0, hidden.shape[-1]),
            expert_ids.new_empty(rows, dtype=torch.int64), expert_ids.new_empty(num_experts, dtype=torch.int32))


@torch.library.custom_op("moecompile::dispatch_backward", mutates_args=())
def dispatch_backward(grad_sorted: Tensor, order: Tensor, tokens: int, top_k: int) -> Tensor:
    return _kernel("dispatch_backward", grad_sorted)(grad_sorted, order, tokens, top_k)


@dispatch_backward.register_fake
def _(grad_sorted, order, tokens, top_k):
    return grad_sorted.new_empty(tokens, grad_sorted.shape[-1])


def _dispatch_setup(ctx, inputs, output):
    hidden, expert_ids, _, copy_rows = inputs
    ctx.save_for_backward(output[1])
    ctx.tokens, ctx.top_k, ctx.copy_rows = hidden.shape[0], expert_ids.shape[-1], copy_rows


def _dispatch_backward(ctx, grad_sorted, grad_order, grad_offsets):
    if not ctx.copy_rows:
        raise MoECompileError(_UNCOPIED_ROWS.format(op="dispatch"))
    (order,) = ctx.saved_tensors
    return dispatch_backward(grad_sorted.contiguous(), order, ctx.tokens, ctx.top_k), None, None, None


dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


# ---- experts: grouped FFN over rows in expert order, weights w_in [E, F, H], w_out [E, H, I]
# Gated w_in rows are [gate | up] halves, or interleaved row by row when `interleaved` (GPT-OSS); alpha and limit
# only parameterise activation "swiglu_oai" (GPT-OSS's clamped SwiGLU).

def glu_args(activation: str, interleaved: bool, alpha: float, limit: float) -> tuple:
    """The trailing kernel arguments, passed only when used, so kernels written for the original eight-argument
    contract keep serving every model that needs nothing more."""
    return (interleaved, alpha, limit) if interleaved or activation == "swiglu_oai" else ()


def _experts_kernel(op: str, x: Tensor, glu: tuple) -> Kernel:
    """op's kernel for x's device; the reference kernel when GPT-OSS's arguments are needed and that kernel does
    not declare them."""
    return kernel_entry(op, x.device, needs=(INTERLEAVED,) if glu else ())


@torch.library.custom_op("moecompile::experts", mutates_args=())
def experts(x: Tensor, offsets: Tensor, w_in: Tensor, b_in: Optional[Tensor], w_out: Tensor,
            b_out: Optional[Tensor], activation: str, gated: bool, interleaved: bool = False, alpha: float = 1.702,
            limit: float = 7.0) -> Tensor:
    glu = glu_args(activation, interleaved, alpha, limit)
    return _experts_kernel("experts", x, glu).fn(x, offsets, w_in, b_in, w_out, b_out, activation, gated, *glu)


@experts.register_fake
def _(x, offsets, w_in, b_in, w_out, b_out, activation, gated, interleaved=False, alpha=1.702, limit=7.0):
    return x.new_empty(x.shape[0], w_out.shape[1])


@torch.library.custom_op("moecompile::experts_gathered", mutates_args=())
def experts_gathered(hidden: Tensor, order: Tensor, offsets: Tensor, top_k: int, w_in: Tensor,
                     b_in: Optional[Tensor], w_out: Tensor, b_out: Optional[Tensor], activation: str,
                     gated: bool) -> Tensor:
    """experts(hidden[order // top_k], offsets, ...): the grouped FFN over the token rows in expert order, read
    from hidden [T, H] by the kernel instead of a dispatched copy (route_dispatch's order and offsets, rows not
    copied). Inference only."""
    return _kernel("experts_gathered", hidden)(hidden, order, offsets, top_k, w_in, b_in, w_out, b_out, activation,
                                               gated)


@experts_gathered.register_fake
def _(hidden, order, offsets, top_k, w_in, b_in, w_out, b_out, activation, gated):
    return hidden.new_empty(order.shape[0], w_out.shape[1])


@torch.library.custom_op("moecompile::experts_train", mutates_args=())
def experts_train(x: Tensor, offsets: Tensor, w_in: Tensor, b_in: Optional[Tensor], w_out: Tensor,
                  b_out: Optional[Tensor], activation: str, gated: bool, interleaved: bool = False,
                  alpha: float = 1.702, limit: float = 7.0) -> tuple[Tensor, Tensor]:
    """experts() for training: (y, h) with h the first projection, kept for the backward, which then skips
    recomputing it (a quarter of its GEMM FLOPs) for N x F more activation memory. h is in the form the same device's
    experts_backward reads (the reference's: x W_in^T before the bias); it is not differentiable and rows past the
    groups are unspecified."""
    glu = glu_args(activation, interleaved, alpha, limit)
    return _experts_kernel("experts_train", x, glu).fn(x, offsets, w_in, b_in, w_out, b_out, activation, gated, *glu)


@experts_train.register_fake
def _(x, offsets, w_in, b_in, w_out, b_out, activation, gated, interleaved=False, alpha=1.702, limit=7.0):
    return x.new_empty(x.shape[0], w_out.shape[1]), x.new_empty(x.shape[0], w_in.shape[1])


@torch.library.custom_op("moecompile::experts_backward", mutates_args=())
def experts_backward(grad_y: Tensor, x: Tensor, offsets: Tensor, w_in: Tensor, b_in: Optional[Tensor],
                     w_out: Tensor, activation: str, gated: bool, has_b_out: bool, interleaved: bool = False,
                     alpha: float = 1.702, limit: float = 7.0,
                     h: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (grad_x, grad_w_in, grad_b_in, grad_w_out, grad_b_out); a missing bias's grad is an empty tensor
    (custom ops cannot return None). h: experts_train's first projection (else recomputed; so too by a kernel
    that takes no h)."""
    glu = glu_args(activation, interleaved, alpha, limit)
    kernel = _experts_kernel("experts_backward", x, glu)
    kept = {"h": h} if h is not None and KEPT_H in kernel.supports else {}
    grads = kernel.fn(grad_y, x, offsets, w_in, b_in, w_out, activation, gated, has_b_out, *glu, **kept)
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@experts_backward.register_fake
def _(grad_y, x, offsets, w_in, b_in, w_out, activation, gated, has_b_out, interleaved=False, alpha=1.702,
      limit=7.0, h=None):
    return (torch.empty_like(x), torch.empty_like(w_in), x.new_empty(0) if b_in is None else torch.empty_like(b_in),
            torch.empty_like(w_out), w_out.new_empty(w_out.shape[0], w_out.shape[1]) if has_b_out else x.new_empty(0))


def _experts_setup(ctx, inputs, output):
    x, offsets, w_in, b_in, w_out, b_out, activation, gated, *glu = inputs
    h = None
    if isinstance(output, tuple):  # experts_train: (y, h)
        h = output[1]
        ctx.mark_non_differentiable(h)
    ctx.save_for_backward(x, offsets, w_in, b_in, w_out, h)
    ctx.activation, ctx.gated, ctx.has_b_out, ctx.glu = activation, gated, b_out is not None, glu


def _experts_backward(ctx, grad_y, grad_h=None):
    x, offsets, w_in, b_in, w_out, h = ctx.saved_tensors
    gx, gw_in, gb_in, gw_out, gb_out = experts_backward(grad_y.contiguous(), x, offsets, w_in, b_in, w_out,
                                                        ctx.activation, ctx.gated, ctx.has_b_out, *ctx.glu, h=h)
    return (gx, None, gw_in, gb_in if b_in is not None else None, gw_out, gb_out if ctx.has_b_out else None,
            None, None, None, None, None)


experts.register_autograd(_experts_backward, setup_context=_experts_setup)
experts_train.register_autograd(_experts_backward, setup_context=_experts_setup)


def _eager_autograd(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records this call for a backward: grad mode on, an input needing grad, and no graph being
    captured (captured graphs get the inference ops, which the compile pipeline rewrites for training itself)."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and any(t is not None and t.requires_grad for t in tensors))


def expert_ffn(x: Tensor, offsets: Tensor, w_in: Tensor, b_in: Optional[Tensor], w_out: Tensor,
               b_out: Optional[Tensor], activation: str, gated: bool, interleaved: bool = False, alpha: float = 1.702,
               limit: float = 7.0) -> Tensor:
    """The experts' output: experts(), or in eager training (autograd will run the backward) experts_train(), whose
    kept first projection costs N x F activations, as autograd over plain linears would (activation checkpointing
    gives them back). Captured graphs (export, Dynamo) get experts(), the node the passes rewrite (in training graphs
    the compile pipeline's keep_first_projection then makes it experts_train). What the MoE modules call."""
    args = (x, offsets, w_in, b_in, w_out, b_out, activation, gated, interleaved, alpha, limit)
    if _eager_autograd(x, w_in, b_in, w_out, b_out):
        return experts_train(*args)[0]
    return experts(*args)


# ---- combine: rows in expert order [N, H] + weights [T, k] -> tokens [T, H]

@torch.library.custom_op("moecompile::combine", mutates_args=())
def combine(expert_out: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    return _kernel("combine", expert_out)(expert_out, order, weights)


@combine.register_fake
def _(expert_out, order, weights):
    return expert_out.new_empty(weights.shape[0], expert_out.shape[-1])


@torch.library.custom_op("moecompile::combine_backward", mutates_args=())
def combine_backward(grad_out: Tensor, expert_out: Tensor, order: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    return _kernel("combine_backward", expert_out)(grad_out, expert_out, order, weights)


@combine_backward.register_fake
def _(grad_out, expert_out, order, weights):
    return torch.empty_like(expert_out), torch.empty_like(weights)


def _combine_setup(ctx, inputs, output):
    expert_out, order, weights = inputs
    ctx.save_for_backward(expert_out, order, weights)


def _combine_backward(ctx, grad_out):
    expert_out, order, weights = ctx.saved_tensors
    grad_rows, grad_weights = combine_backward(grad_out.contiguous(), expert_out, order, weights)
    return grad_rows, None, grad_weights


combine.register_autograd(_combine_backward, setup_context=_combine_setup)


# ---- experts_combine_train: experts_train -> combine as one training op, so that its backward takes the combine's
# gradient [T, H] whole: a device may fuse the combine's backward into the expert GEMMs' (no [N, H] gradient rows)

@torch.library.custom_op("moecompile::experts_combine_train", mutates_args=())
def experts_combine_train(x: Tensor, offsets: Tensor, order: Tensor, weights: Tensor, w_in: Tensor,
                          b_in: Optional[Tensor], w_out: Tensor, b_out: Optional[Tensor], activation: str,
                          gated: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(combine(y, order, weights), h, y) with (y, h) = experts_train(x, ...): the expert rows y are kept for a
    backward that computes the weights' gradient from them; h and y are not differentiable."""
    return _kernel("experts_combine_train", x)(x, offsets, order, weights, w_in, b_in, w_out, b_out, activation, gated)


@experts_combine_train.register_fake
def _(x, offsets, order, weights, w_in, b_in, w_out, b_out, activation, gated):
    return (x.new_empty(weights.shape[0], w_out.shape[1]), x.new_empty(x.shape[0], w_in.shape[1]),
            x.new_empty(x.shape[0], w_out.shape[1]))


@torch.library.custom_op("moecompile::experts_combine_backward", mutates_args=())
def experts_combine_backward(grad_out: Tensor, x: Tensor, offsets: Tensor, order: Tensor, weights: Tensor,
                             w_in: Tensor, b_in: Optional[Tensor], w_out: Tensor, activation: str, gated: bool,
                             has_b_out: bool, h: Tensor, y: Tensor
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (grad_x, grad_weights, grad_w_in, grad_b_in, grad_w_out, grad_b_out); a missing bias's grad is an
    empty tensor. grad_x rows past the groups are zero, as experts_backward's."""
    grads = _kernel("experts_combine_backward", x)(grad_out, x, offsets, order, weights, w_in, b_in, w_out,
                                                   activation, gated, has_b_out, h, y)
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@experts_combine_backward.register_fake
def _(grad_out, x, offsets, order, weights, w_in, b_in, w_out, activation, gated, has_b_out, h, y):
    return (torch.empty_like(x), torch.empty_like(weights), torch.empty_like(w_in),
            x.new_empty(0) if b_in is None else torch.empty_like(b_in), torch.empty_like(w_out),
            w_out.new_empty(w_out.shape[0], w_out.shape[1]) if has_b_out else x.new_empty(0))


def _experts_combine_setup(ctx, inputs, output):
    x, offsets, order, weights, w_in, b_in, w_out, b_out, activation, gated = inputs
    ctx.mark_non_differentiable(output[1], output[2])
    # eager only: a traced graph's saved tensors are the partitioner's, and the kernel's choice is made at run time
    reads_y = torch.compiler.is_compiling() or _kernel("experts_combine_backward_reads_y", x)(
        x, w_in, w_out, activation, gated, b_out is not None)
    y = output[2] if reads_y else output[2].new_empty(0)  # [N, H] not kept where the backward will not read it
    ctx.save_for_backward(x, offsets, order, weights, w_in, b_in, w_out, output[1], y)
    ctx.activation, ctx.gated, ctx.has_b_out = activation, gated, b_out is not None


def _experts_combine_backward(ctx, grad_out, grad_h=None, grad_y=None):
    x, offsets, order, weights, w_in, b_in, w_out, h, y = ctx.saved_tensors
    gx, gweights, gw_in, gb_in, gw_out, gb_out = experts_combine_backward(
        grad_out.contiguous(), x, offsets, order, weights, w_in, b_in, w_out, ctx.activation, ctx.gated,
        ctx.has_b_out, h, y)
    return (gx, None, None, gweights, gw_in, gb_in if b_in is not None else None, gw_out,
            gb_out if ctx.has_b_out else None, None, None)


experts_combine_train.register_autograd(_experts_combine_backward, setup_context=_experts_combine_setup)


def expert_ffn_combine(x: Tensor, offsets: Tensor, order: Tensor, weights: Tensor, w_in: Tensor,
                       b_in: Optional[Tensor], w_out: Tensor, b_out: Optional[Tensor], activation: str, gated: bool,
                       interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """combine(expert_ffn(...), order, weights): in eager training the one op experts_combine_train (GPT-OSS's
    activation arguments excepted), whose backward a device may fuse; else the two ops, as captured graphs get them
    (the compile pipeline's keep_first_projection makes the same rewrite there). What the MoE modules call."""
    glu = glu_args(activation, interleaved, alpha, limit)
    if _eager_autograd(x, weights, w_in, b_in, w_out, b_out) and not glu:
        return experts_combine_train(x, offsets, order, weights, w_in, b_in, w_out, b_out, activation, gated)[0]
    return combine(expert_ffn(x, offsets, w_in, b_in, w_out, b_out, activation, gated, interleaved, alpha, limit),
                   order, weights)


def gathers_rows(assignments, num_experts: int) -> bool:
    """Whether the experts read their rows from the tokens (experts_gathered) rather than from dispatch's copy: for
    batches (a symbolic count: a dynamic prefill), where the first projection may gather them itself; below, the
    copy is part of dispatch's one-launch kernels, and gathering would be one launch more."""
    return not isinstance(assignments, int) or choices.is_batch(assignments, num_experts)


def dispatch_ffn_combine(x: Tensor, weights: Tensor, expert_ids: Tensor, num_experts: int, w_in: Tensor,
                         b_in: Optional[Tensor], w_out: Tensor, b_out: Optional[Tensor], activation: str, gated: bool,
                         interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """dispatch, the experts, combine: what the MoE modules call. In eager inference of a batch (gathers_rows) the
    experts gather their rows from x (experts_gathered: dispatch writes no row copy), as gather_expert_rows makes a
    compiled graph run; else expert_ffn_combine over dispatch's rows (captured graphs get those ops, for the passes
    to rewrite)."""
    if (not glu_args(activation, interleaved, alpha, limit) and not torch.compiler.is_compiling()
            and not _eager_autograd(x, weights, w_in, b_in, w_out, b_out)
            and gathers_rows(expert_ids.numel(), num_experts)):
        _, order, offsets = dispatch(x, expert_ids, num_experts, copy_rows=False)
        return combine(experts_gathered(x, order, offsets, expert_ids.shape[-1], w_in, b_in, w_out, b_out, activation,
                                        gated), order, weights)
    rows, order, offsets = dispatch(x, expert_ids, num_experts)
    return expert_ffn_combine(rows, offsets, order, weights, w_in, b_in, w_out, b_out, activation, gated, interleaved,
                              alpha, limit)


# ---- routed_experts: dispatch -> experts -> combine's terms in one op for few tokens (emitted by direct_experts)

@torch.library.custom_op("moecompile::routed_experts", mutates_args=())
def routed_experts(x: Tensor, weights: Tensor, expert_ids: Tensor, w_in: Tensor, b_in: Optional[Tensor],
                   w_out: Tensor, b_out: Optional[Tensor], activation: str, gated: bool, interleaved: bool = False,
                   alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """x [T, H], weights / expert_ids [T, k] (route's outputs) -> [T, k, H] in >= float32: weights[t, j] *
    FFN_{expert_ids[t, j]}(x[t]), 0 for a dropped assignment. Their sum over k, cast to x's dtype, is what dispatch,
    experts and combine compute; the graph does that sum (inductor compiles it with the cast).
    Inference only."""
    glu = glu_args(activation, interleaved, alpha, limit)
    return _experts_kernel("routed_experts", x, glu).fn(x, weights, expert_ids, w_in, b_in, w_out, b_out, activation,
                                                        gated, *glu)


@routed_experts.register_fake
def _(x, weights, expert_ids, w_in, b_in, w_out, b_out, activation, gated, interleaved=False, alpha=1.702,
      limit=7.0):
    return x.new_empty(*expert_ids.shape, w_out.shape[1], dtype=torch.promote_types(x.dtype, torch.float32))


# ---- route_dispatch: router linear -> route_grouped -> dispatch in one op (emitted by fuse_route_dispatch)

@torch.library.custom_op("moecompile::route_dispatch", mutates_args=())
def route_dispatch(hidden: Tensor, router_weight: Tensor, router_bias: Optional[Tensor], top_k: int,
                   capacity_factor: float, renormalize: bool, scoring: str = "softmax",
                   correction_bias: Optional[Tensor] = None, n_group: int = 1, topk_group: int = 1,
                   scaling_factor: float = 1.0, logits_fp32: bool = True, copy_rows: bool = True
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hidden [T, H], router_weight [E, H] -> (weights [T, k] float32, expert_ids [T, k], rows [T * k, H],
    order [T * k], offsets [E]): the outputs of route_grouped and dispatch, router logits never leave the op.
    Without copy_rows, rows is empty ([0, H]): the experts gather the token rows themselves (experts_gathered)."""
    return _kernel("route_dispatch", hidden)(hidden, router_weight, router_bias, top_k, capacity_factor, renormalize,
                                             scoring, correction_bias, n_group, topk_group, scaling_factor,
                                             logits_fp32, copy_rows)


@route_dispatch.register_fake
def _(hidden, router_weight, router_bias, top_k, capacity_factor, renormalize, scoring="softmax",
      correction_bias=None, n_group=1, topk_group=1, scaling_factor=1.0, logits_fp32=True, copy_rows=True):
    tokens, rows = hidden.shape[0], hidden.shape[0] * top_k
    return (hidden.new_empty(tokens, top_k, dtype=torch.float32), hidden.new_empty(tokens, top_k, dtype=torch.int64),
            hidden.new_empty(rows if copy_rows else 0, hidden.shape[-1]), hidden.new_empty(rows, dtype=torch.int64),
            hidden.new_empty(router_weight.shape[0], dtype=torch.int32))


@torch.library.custom_op("moecompile::route_dispatch_backward", mutates_args=())
def route_dispatch_backward(grad_weights: Tensor, grad_rows: Tensor, hidden: Tensor, router_weight: Tensor,
                            router_bias: Optional[Tensor], expert_ids: Tensor, order: Tensor, top_k: int,
                            renormalize: bool, scoring: str, correction_bias: Optional[Tensor], n_group: int,
                            topk_group: int, scaling_factor: float, logits_fp32: bool
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (grad_hidden, grad_router_weight, grad_router_bias); without a router bias the last is empty."""
    grads = _kernel("route_dispatch_backward", hidden)(grad_weights, grad_rows, hidden, router_weight, router_bias,
                                                       expert_ids, order, top_k, renormalize, scoring,
                                                       correction_bias, n_group, topk_group, scaling_factor,
                                                       logits_fp32)
    return tuple(hidden.new_empty(0) if g is None else g for g in grads)


@route_dispatch_backward.register_fake
def _(grad_weights, grad_rows, hidden, router_weight, router_bias, expert_ids, order, top_k, renormalize, scoring,
      correction_bias, n_group, topk_group, scaling_factor, logits_fp32):
    return (torch.empty_like(hidden), torch.empty_like(router_weight),
            hidden.new_empty(0) if router_bias is None else torch.empty_like(router_bias))


def _route_dispatch_setup(ctx, inputs, output):
    hidden, router_weight, router_bias, top_k, _, *routing, copy_rows = inputs
    ctx.save_for_backward(hidden, router_weight, router_bias, routing[2], output[1], output[3])
    ctx.top_k, ctx.routing, ctx.copy_rows = top_k, routing[:2] + [None] + routing[3:], copy_rows


def _route_dispatch_backward(ctx, grad_weights, grad_ids, grad_rows, grad_order, grad_offsets):
    if not ctx.copy_rows:
        raise MoECompileError(_UNCOPIED_ROWS.format(op="route_dispatch"))
    hidden, router_weight, router_bias, correction_bias, expert_ids, order = ctx.saved_tensors
    renormalize, scoring, _, n_group, topk_group, scaling_factor, logits_fp32 = ctx.routing
    g_hidden, g_weight, g_bias = route_dispatch_backward(
        grad_weights.contiguous(), grad_rows.contiguous(), hidden, router_weight, router_bias, expert_ids, order,
        ctx.top_k, renormalize, scoring, correction_bias, n_group, topk_group, scaling_factor, logits_fp32)
    return (g_hidden, g_weight, g_bias if router_bias is not None else None) + (None,) * 10


route_dispatch.register_autograd(_route_dispatch_backward, setup_context=_route_dispatch_setup)


# ---- FP8 (float8_e4m3fn), inference only; scale conventions in moecompile/core/fp8_format.py (x ≈ x_fp8 * scale_inv)
# quantize_fp8: x [N, H] -> (x_fp8 [N, H], scale_inv [N, ceil(H / group)] float32), per row per `group` channels.
# experts_fp8: experts() on x quantised per row per 128 channels and weights w_in [E, F, H], w_out [E, H, I] in
# float8_e4m3fn with one float32 scale_inv per 128 x 128 tile ([E, ceil(F/128), ceil(H/128)] and
# [E, ceil(H/128), ceil(I/128)]); the intermediate activation is quantised per row per 128 channels before the
# second GEMM. Output [N, H] in out_dtype; the same row semantics as experts() (rows >= offsets[-1] unspecified).

FP8_GROUP = 128  # activation group and weight tile edge of experts_fp8


@torch.library.custom_op("moecompile::quantize_fp8", mutates_args=())
def quantize_fp8(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    return _kernel("quantize_fp8", x)(x, group)


@quantize_fp8.register_fake
def _(x, group):
    rows, hidden = x.shape
    return (x.new_empty(rows, hidden, dtype=torch.float8_e4m3fn),
            x.new_empty(rows, (hidden + group - 1) // group, dtype=torch.float32))


def _tiles(n: int) -> int:
    return (n + FP8_GROUP - 1) // FP8_GROUP


def _check_experts_fp8(x, x_scale_inv, w_in, w_in_scale_inv, w_out, w_out_scale_inv):
    e, f, h = w_in.shape
    expected = {"x_scale_inv": (x_scale_inv, (x.shape[0], _tiles(h))),
                "w_in_scale_inv": (w_in_scale_inv, (e, _tiles(f), _tiles(h))),
                "w_out_scale_inv": (w_out_scale_inv, (e, _tiles(w_out.shape[1]), _tiles(w_out.shape[2])))}
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"moecompile::experts_fp8: {name} has shape {tuple(t.shape)}, expected {shape}")
    for name, t in (("x", x), ("w_in", w_in), ("w_out", w_out)):
        if t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"moecompile::experts_fp8: {name} must be float8_e4m3fn, got {t.dtype}")


@torch.library.custom_op("moecompile::experts_fp8", mutates_args=())
def experts_fp8(x: Tensor, x_scale_inv: Tensor, offsets: Tensor, w_in: Tensor, w_in_scale_inv: Tensor,
                b_in: Optional[Tensor], w_out: Tensor, w_out_scale_inv: Tensor, b_out: Optional[Tensor],
                activation: str, gated: bool, out_dtype: torch.dtype) -> Tensor:
    _check_experts_fp8(x, x_scale_inv, w_in, w_in_scale_inv, w_out, w_out_scale_inv)
    return _kernel("experts_fp8", x)(x, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv,
                                     b_out, activation, gated, out_dtype)


@experts_fp8.register_fake
def _(x, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out, activation, gated,
      out_dtype):
    return x.new_empty(x.shape[0], w_out.shape[1], dtype=out_dtype)


# routed_experts_fp8: routed_experts() over experts_fp8's weights, weight-only (x is not quantised): what insert_fp8
# makes of direct_experts' routed_experts. linear_fp8: a linear over one FP8 block-scaled weight [N, K] (scale_inv
# [ceil(N/128), ceil(K/128)]), weight-only, output in x's dtype: what insert_fp8_linears makes of a linear.

def _check_fp8_weight(op: str, name: str, w: Tensor, scale_inv: Tensor) -> None:
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"moecompile::{op}: {name} must be float8_e4m3fn, got {w.dtype}")
    expected = (*w.shape[:-2], _tiles(w.shape[-2]), _tiles(w.shape[-1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"moecompile::{op}: {name}_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected}")


@torch.library.custom_op("moecompile::routed_experts_fp8", mutates_args=())
def routed_experts_fp8(x: Tensor, weights: Tensor, expert_ids: Tensor, w_in: Tensor, w_in_scale_inv: Tensor,
                       b_in: Optional[Tensor], w_out: Tensor, w_out_scale_inv: Tensor, b_out: Optional[Tensor],
                       activation: str, gated: bool) -> Tensor:
    """x [T, H], weights / expert_ids [T, k] -> [T, k, H] in >= float32, as routed_experts computes them from the
    dequantised weights."""
    _check_fp8_weight("routed_experts_fp8", "w_in", w_in, w_in_scale_inv)
    _check_fp8_weight("routed_experts_fp8", "w_out", w_out, w_out_scale_inv)
    return _kernel("routed_experts_fp8", x)(x, weights, expert_ids, w_in, w_in_scale_inv, b_in, w_out,
                                            w_out_scale_inv, b_out, activation, gated)


@routed_experts_fp8.register_fake
def _(x, weights, expert_ids, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out, activation, gated):
    return x.new_empty(*expert_ids.shape, w_out.shape[1], dtype=torch.promote_types(x.dtype, torch.float32))


@torch.library.custom_op("moecompile::linear_fp8", mutates_args=())
def linear_fp8(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, bias: Optional[Tensor]) -> Tensor:
    _check_fp8_weight("linear_fp8", "weight", weight, weight_scale_inv)
    return _kernel("linear_fp8", x)(x, weight, weight_scale_inv, bias)


@linear_fp8.register_fake
def _(x, weight, weight_scale_inv, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# ---- decode_attention: attention of one query token per sequence over a key/value cache (emitted by the
# decode_attention pass in place of SDPA)

@torch.library.custom_op("moecompile::decode_attention", mutates_args=())
def decode_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], scale: float) -> Tensor:
    """query [B, H, 1, Dk], key [B, KV, L, Dk], value [B, KV, L, Dv] (H a multiple of KV: query head h reads
    key/value head h // (H / KV)), attn_mask [B or 1, 1, 1, L] bool (True: attend) or None -> [B, H, 1, Dv] in
    query's dtype: softmax(scale q k^T + mask) v. A row that attends to nothing gives 0. Inference only."""
    if query.dim() != 4 or query.shape[2] != 1 or query.shape[1] % key.shape[1]:
        raise ValueError(f"moecompile::decode_attention: one query token and H a multiple of KV, got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}")
    return _kernel("decode_attention", query)(query, key, value, attn_mask, scale)


@decode_attention.register_fake
def _(query, key, value, attn_mask, scale):
    return query.new_empty(*query.shape[:3], value.shape[-1])


def _no_backward(op_name: str, why: str = "the FP8 ops have no backward",
                 then: str = ", or moecompile.ir.fp8.dequantize(model) to train it"):
    def backward(ctx, *grads):
        raise MoECompileError(f"moecompile::{op_name} is inference-only ({why}): run the model under "
                              f"torch.no_grad(){then}")
    return backward


quantize_fp8.register_autograd(_no_backward("quantize_fp8"), setup_context=lambda ctx, inputs, output: None)
experts_fp8.register_autograd(_no_backward("experts_fp8"), setup_context=lambda ctx, inputs, output: None)
routed_experts_fp8.register_autograd(_no_backward("routed_experts_fp8"), setup_context=lambda ctx, inputs, output: None)
linear_fp8.register_autograd(_no_backward("linear_fp8"), setup_context=lambda ctx, inputs, output: None)
decode_attention.register_autograd(_no_backward("decode_attention", "a decode step's attention", then=""),
                                   setup_context=lambda ctx, inputs, output: None)
experts_gathered.register_autograd(
    _no_backward("experts_gathered", "a training graph keeps dispatch's row copy", then=""),
    setup_context=lambda ctx, inputs, output: None)


# ---- autocast: the expert GEMMs run in the autocast dtype (their float inputs cast, as autocast casts a linear's);
# the FP8 ops keep their own precision (float32 scales, out_dtype chosen by the caller). Each runs with autocast
# off inside, so a kernel's own arithmetic (the reference kernels' float32) is not re-cast.

_autocast_lib = torch.library.Library("moecompile", "IMPL")


def _register_autocast(name: str, cast: tuple[int, ...]):
    op = getattr(torch.ops.moecompile, name).default
    for device_type in ("cpu", "cuda"):
        def kernel(_keyset, *args, device_type=device_type):
            dtype = torch.get_autocast_dtype(device_type)
            args = [a.to(dtype) if i in cast and isinstance(a, Tensor) and a.is_floating_point()
                    and a.dtype != torch.float64 and a.device.type == device_type else a for i, a in enumerate(args)]
            with torch.autocast(device_type, enabled=False):
                return op(*args)
        _autocast_lib.impl(name, kernel, "Autocast" + torch._C._dispatch_key_for_device(device_type),
                           with_keyset=True)


_register_autocast("experts", cast=(0, 2, 3, 4, 5))  # x, w_in, b_in, w_out, b_out
_register_autocast("experts_train", cast=(0, 2, 3, 4, 5))
_register_autocast("experts_gathered", cast=(0, 4, 5, 6, 7))  # hidden, w_in, b_in, w_out, b_out
_register_autocast("experts_combine_train", cast=(0, 4, 5, 6, 7))  # x, w_in, b_in, w_out, b_out (not the weights)
_register_autocast("quantize_fp8", cast=())
_register_autocast("experts_fp8", cast=())
_register_autocast("routed_experts_fp8", cast=())
_register_autocast("linear_fp8", cast=())

MOE_OPS = (route, dispatch, experts, combine)
FUSED_OPS = (route_grouped, route_dispatch, experts_gathered)
FP8_OPS = (quantize_fp8, experts_fp8, routed_experts_fp8, linear_fp8)
