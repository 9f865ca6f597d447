"""MoEBlock.forward in the form the distillation stages train: dropless, eval, differentiable routing weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moecompile.core.activations import expert_activation
from moecompile.ir import ops
from moecompile.ir.block import MoEBlock


def masked_forward(block: MoEBlock, x: torch.Tensor, top_k: int, routed=None) -> torch.Tensor:
    """MoEBlock.forward (dropless, eval) as distillation trains it: the same function as the block's (a test checks
    it), faster to train on CPU than the grouped reference kernels. `routed` runs the routed experts; by default,
    at most a quarter of the experts per token: each expert's tokens gathered and run alone (routed_sparse);
    more: every expert on every token, masked by the routing weights (routed_dense)."""
    c = block.config
    e = c.num_experts
    out = block._shared_out(x)
    if top_k > 0:
        weights, ids = ops.route(block.router_logits(x), top_k, 0.0, c.renormalize)
        if c.gate_weighting == "unit":
            weights = torch.where(ids < e, weights - weights.detach() + 1.0, 0.0)
        routed = routed or (routed_sparse if 4 * top_k <= e else routed_dense)
        out = routed(block, x, weights, ids, out)
        out = out + block._compensation_out(x, ids)
    else:
        out = out + block._compensation_out(x, None)
    if block.bias is not None:
        out = out + block.bias
    return out


def routed_dense(block: MoEBlock, x, weights, ids, out):
    """out + the routed experts' weighted outputs, every expert computed on every token and masked."""
    c, ex = block.config, block.experts
    mask = x.new_zeros(x.shape[0], c.num_experts + 1).scatter(1, ids, weights.to(x.dtype))[:, :c.num_experts]
    h = torch.einsum("th,efh->tef", x, ex.w_in)
    if ex.b_in is not None:
        h = h + ex.b_in
    a = expert_activation(c.activation, c.gated, h) * mask.unsqueeze(-1)
    out = out + torch.einsum("tei,ehi->th", a, ex.w_out)
    if ex.b_out is not None:
        out = out + mask @ ex.b_out
    return out


def routed_sparse(block: MoEBlock, x, weights, ids, out):
    """routed_dense computing only the chosen experts: tokens sorted by expert, one matmul pair per expert; it
    pays off when a token picks few of the experts (bench/distill_step_time.py)."""
    c, ex = block.config, block.experts
    top_k = ids.shape[1]
    order = torch.argsort(ids.reshape(-1), stable=True)
    counts = torch.bincount(ids.reshape(-1), minlength=c.num_experts + 1)[:c.num_experts].tolist()
    kept = order[:sum(counts)]  # (dropped assignments, id E, sort last)
    tokens = kept // top_k
    rows = x.index_select(0, tokens).split(counts)
    outs = []
    for e, xe in enumerate(rows):
        if xe.shape[0]:
            h = F.linear(xe, ex.w_in[e], ex.b_in[e] if ex.b_in is not None else None)
            outs.append(F.linear(expert_activation(c.activation, c.gated, h), ex.w_out[e],
                                 ex.b_out[e] if ex.b_out is not None else None))
    if not outs:
        return out
    y = torch.cat(outs) * weights.reshape(-1).index_select(0, kept).unsqueeze(-1).to(outs[0].dtype)
    return out.index_add(0, tokens, y.to(out.dtype))
