"""Triton kernels for the MoE ops' elementwise stages (fused bias + activation, weighted combine).

They run on CUDA and, for testing, on CPU under TRITON_INTERPRET=1. Math is in float32 whatever the storage dtype.
"""
import torch
import triton
import triton.language as tl

ACTIVATION_IDS = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3}


@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == 0:
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 1:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (2.0 * tl.sigmoid(2.0 * inner))  # 1 + tanh(u) = 2 sigmoid(2u)
    elif ACT == 2:
        return tl.maximum(x, 0.0)
    else:
        return x * tl.sigmoid(x)


@triton.jit
def _row_expert(rows, offsets_ptr, num_experts, E_PAD: tl.constexpr):
    """Expert of each sorted row: the number of group ends at or before it (offsets are cumulative ends)."""
    e = tl.arange(0, E_PAD)
    ends = tl.load(offsets_ptr + e, mask=e < num_experts, other=2147483647)
    expert = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
    return tl.minimum(expert, num_experts - 1)


@triton.jit
def _expert_activation_kernel(h_ptr, bias_ptr, offsets_ptr, out_ptr, n_rows, width, stride_h, stride_out,
                              num_experts, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, E_PAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    h_row = h_ptr + rows[:, None].to(tl.int64) * stride_h
    x = tl.load(h_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(h_row + width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        expert = _row_expert(rows, offsets_ptr, num_experts, E_PAD)
        b_row = bias_ptr + expert[:, None].to(tl.int64) * (2 * width if GATED else width)
        x += tl.load(b_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATED:
            up += tl.load(b_row + width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = _activation(x, ACT)
    if GATED:
        a = a * up
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], a.to(out_ptr.dtype.element_ty),
             mask=mask)


def expert_activation(h: torch.Tensor, offsets: torch.Tensor, bias, activation: str, gated: bool,
                      block_m: int = 32, block_n: int = 128) -> torch.Tensor:
    """act(h + b_in[expert of row]) (plain) or act(gate + b) * (up + b) (gated, h = [gate | up]) in one pass."""
    n_rows = h.shape[0]
    width = h.shape[1] // 2 if gated else h.shape[1]
    out = h.new_empty(n_rows, width)
    if n_rows == 0:
        return out
    num_experts = offsets.shape[0]
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(width, block_n))
    _expert_activation_kernel[grid](
        h, bias if bias is not None else h, offsets, out, n_rows, width, h.stride(0), out.stride(0), num_experts,
        HAS_BIAS=bias is not None, GATED=gated, ACT=ACTIVATION_IDS[activation], BLOCK_M=block_m, BLOCK_N=block_n,
        E_PAD=triton.next_power_of_2(num_experts))
    return out


@triton.jit
def _combine_kernel(y_ptr, row_of_ptr, w_ptr, out_ptr, tokens, hidden, stride_y, stride_out,
                    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = tok < tokens
    cmask = cols < hidden
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(TOP_K):
        w = tl.load(w_ptr + tok * TOP_K + j, mask=tmask, other=0.0)
        row = tl.load(row_of_ptr + tok * TOP_K + j, mask=tmask, other=0)
        keep = tmask & (w != 0.0)  # dropped assignments' rows are never read
        v = tl.load(y_ptr + row[:, None].to(tl.int64) * stride_y + cols[None, :],
                    mask=keep[:, None] & cmask[None, :], other=0.0)
        acc += w[:, None] * v.to(tl.float32)
    tl.store(out_ptr + tok[:, None].to(tl.int64) * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


def combine(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
            block_t: int = 16, block_h: int = 256) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * expert_out[row of (t, j)]: a gather per token, no atomics, deterministic."""
    tokens, top_k = weights.shape
    hidden = expert_out.shape[1]
    out = expert_out.new_empty(tokens, hidden)
    if tokens == 0:
        return out
    row_of = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    weights = weights.float().contiguous()
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(hidden, block_h))
    _combine_kernel[grid](expert_out, row_of, weights, out, tokens, hidden, expert_out.stride(0), out.stride(0),
                          TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h)
    return out
