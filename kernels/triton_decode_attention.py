"""Decode attention, one query token per sequence over a static key/value cache, split over the cache positions (as
flash-decoding does): each key/value head is read once for all its query heads.

    out[b, h] = softmax(scale * q[b, h] . K[b, h // n] + where(mask[b], 0, -inf)) V[b, h // n]    (n = H / KV)

Launch 1, one program per (sequence, key/value head, run of positions): the online softmax of the head's n query
heads over its run (a tensor-core dot of the query heads, padded to 16, against each block of keys), written as
partial (max, sum, weighted values). Launch 2 merges the runs in a fixed order (deterministic) and divides; with
one run the first launch divides and writes the output itself.
A row whose mask keeps no position gives 0 (SDPA gives NaN there; a decode step always keeps its own token).
The op moecompile::decode_attention runs it on CUDA under option decode_attention, off by default until
bench/generate.py (--attention-probe, mode moecompile-split-kv) shows it ahead of SDPA's backends.
"""
import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # q / k / v dtypes the kernel takes (math: float32)


@triton.jit
def _attend_run_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, scale, length, run,
                       k_strides_b, k_strides_h, k_strides_l, v_strides_b, v_strides_h, v_strides_l, mask_stride_b,
                       splits, kv_heads: tl.constexpr, group: tl.constexpr, key_dim: tl.constexpr,
                       value_dim: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_L: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, WHOLE: tl.constexpr, HAS_MASK: tl.constexpr):
    """Partials of program (b * kv_heads + head, split) over positions [split * run, min(+run, length)): per query
    head g of the group, m = the largest score, l = sum of exp(score - m), acc = sum of exp(score - m) v, at
    [(b * kv_heads + head) * group + g, split] (acc: times value_dim). WHOLE (one run over all positions): the
    attention output acc / l itself, in acc_ptr's dtype at [(b * kv_heads + head) * group + g] (no merge launch)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // kv_heads
    head = pid % kv_heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    rows = pid.to(tl.int64) * group + g  # the group's query heads, as rows of q [B * H, key_dim]
    q = tl.load(q_ptr + rows[:, None] * key_dim + d[None, :], mask=(g < group)[:, None] & (d < key_dim)[None, :],
                other=0.0)
    k_base = k_ptr + b.to(tl.int64) * k_strides_b + head.to(tl.int64) * k_strides_h
    v_base = v_ptr + b.to(tl.int64) * v_strides_b + head.to(tl.int64) * v_strides_h
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)
    start = split * run
    end = tl.minimum(start + run, length)
    for p0 in range(start, end, BLOCK_L):
        pos = p0 + tl.arange(0, BLOCK_L)
        inside = pos < end
        keep = inside
        if HAS_MASK:
            keep = keep & (tl.load(mask_ptr + b.to(tl.int64) * mask_stride_b + pos, mask=inside, other=0) != 0)
        k = tl.load(k_base + pos[:, None].to(tl.int64) * k_strides_l + d[None, :],
                    mask=inside[:, None] & (d < key_dim)[None, :], other=0.0)
        scores = tl.where(keep[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))  # [BLOCK_G, BLOCK_L]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no position kept yet: every exp below is 0
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(v_base + pos[:, None].to(tl.int64) * v_strides_l + dv[None, :],
                    mask=inside[:, None] & (dv < value_dim)[None, :], other=0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = rows * splits + split
    live = g < group
    if WHOLE:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    else:
        tl.store(m_ptr + out, m_i, mask=live)
        tl.store(l_ptr + out, l_i, mask=live)
    tl.store(acc_ptr + out[:, None] * value_dim + dv[None, :], acc.to(acc_ptr.dtype.element_ty),
             mask=live[:, None] & (dv < value_dim)[None, :])


@triton.jit
def _merge_runs_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, splits, value_dim: tl.constexpr, BLOCK_S: tl.constexpr,
                       BLOCK_DV: tl.constexpr):
    """out[row] = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s over the runs s of one query head (M: the
    largest m_s), 0 where no run kept a position."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    m = tl.load(m_ptr + row * splits + s, mask=s < splits, other=float("-inf"))
    top = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.where(top == float("-inf"), 0.0, top)))
    total = tl.sum(w * tl.load(l_ptr + row * splits + s, mask=s < splits, other=0.0), axis=0)
    acc = tl.load(acc_ptr + (row * splits + s)[:, None] * value_dim + dv[None, :],
                  mask=(s < splits)[:, None] & (dv < value_dim)[None, :], other=0.0)
    y = tl.sum(w[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * value_dim + dv, y.to(out_ptr.dtype.element_ty), mask=dv < value_dim)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     splits: int, block_l: int = 64, num_warps: int = 4) -> torch.Tensor:
    """q [B, H, 1, Dk] (one query token), k [B, KV, L, Dk], v [B, KV, L, Dv] (H a multiple of KV; the last dimension
    contiguous), mask [B, L] bool (True: attend; positions contiguous, a stride-0 batch dimension is fine) or None
    (every position) -> [B, H, 1, Dv] in q's dtype. The L positions are cut into `splits` runs of whole BLOCK_L
    blocks (fewer where L has fewer blocks)."""
    batch, heads, queries, key_dim = q.shape
    _, kv_heads, length, value_dim = v.shape
    if queries != 1 or heads % kv_heads or k.shape[:3] != v.shape[:3] or k.shape[-1] != key_dim:
        raise ValueError(f"decode_attention takes one query token and H a multiple of KV, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or (mask is not None and (mask.shape != (batch, length)
                                                                       or mask.stride(-1) != 1)):
        raise ValueError("decode_attention needs contiguous head dimensions and a [B, L] mask of contiguous "
                         "positions")
    group = heads // kv_heads
    run = triton.cdiv(triton.cdiv(length, block_l), max(1, splits)) * block_l
    splits = max(1, triton.cdiv(length, run))
    rows = batch * heads
    out = q.new_empty(batch, heads, 1, value_dim)
    whole = splits == 1  # one run: the first launch writes the output
    m = q.new_empty(0 if whole else rows, splits, dtype=torch.float32)
    total = torch.empty_like(m)
    acc = out if whole else q.new_empty(rows, splits, value_dim, dtype=torch.float32)
    block_d, block_dv = (max(16, triton.next_power_of_2(n)) for n in (key_dim, value_dim))
    _attend_run_kernel[(batch * kv_heads, splits)](
        q.contiguous(), k, v, q if mask is None else mask.view(torch.uint8), m, total, acc, scale, length, run,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        0 if mask is None else mask.stride(0), splits,
        kv_heads=kv_heads, group=group, key_dim=key_dim, value_dim=value_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_L=block_l, BLOCK_D=block_d, BLOCK_DV=block_dv,
        WHOLE=whole, HAS_MASK=mask is not None, num_warps=num_warps)
    if not whole:
        _merge_runs_kernel[(rows,)](m, total, acc, out, splits, value_dim=value_dim,
                                    BLOCK_S=triton.next_power_of_2(splits), BLOCK_DV=block_dv)
    return out
