"""Triton kernels for the MoE ops' elementwise stages (fused bias + activation, weighted combine).

They run on CUDA and, for testing, on CPU under TRITON_INTERPRET=1. Math is in float32 whatever the storage dtype.
"""
import torch
import triton
import triton.language as tl

ACTIVATION_IDS = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3}
# Up to this many assignments (decode) combine finds each one's sorted row by a search of `order` in its own
# kernel instead of building the inverse permutation first (an arange and a scatter launch).
SEARCH_ROWS = 64
COMBINE_COLUMNS = 2048  # the combine's widest column tile (one program per token and tile)
# Whether this Triton has the grid dependency controls of programmatic dependent launch (PDL, sm_90+).
HAS_GRID_DEPENDENCY = hasattr(tl.extra.cuda, "gdc_wait")


@triton.jit
def dependent_launch(PDL: tl.constexpr):
    """As a programmatic dependent (PDL, launched with launch_pdl): wait until the kernel before has finished and its
    writes are visible, then let the next kernel start launching; nothing in plain stream order. Before any load."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


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
def _activation_grad(x, ACT: tl.constexpr):
    if ACT == 0:
        cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        return cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACT == 1:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    elif ACT == 2:
        return (x > 0).to(tl.float32)
    else:
        sig = tl.sigmoid(x)
        return sig * (1.0 + x * (1.0 - sig))


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
def _expert_activation_backward_kernel(h_ptr, bias_ptr, offsets_ptr, grad_a_ptr, a_ptr, grad_h_ptr, n_rows, width,
                                       num_experts, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, E_PAD: tl.constexpr):
    """From h (pre-bias) and dL/da: a = act(...) (for the w_out gradient) and dL/dh, in one pass. Contiguous rows;
    rows past the last group (dropped) get a zero gradient."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    in_width = 2 * width if GATED else width
    h_row = h_ptr + rows[:, None].to(tl.int64) * in_width
    x = tl.load(h_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(h_row + width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        expert = _row_expert(rows, offsets_ptr, num_experts, E_PAD)
        b_row = bias_ptr + expert[:, None].to(tl.int64) * in_width
        x += tl.load(b_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATED:
            up += tl.load(b_row + width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    last = tl.load(offsets_ptr + num_experts - 1)
    g = tl.load(grad_a_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.where((rows < last)[:, None], g, 0.0)
    act = _activation(x, ACT)
    out_row = rows[:, None].to(tl.int64)
    if GATED:
        tl.store(a_ptr + out_row * width + cols[None, :], (act * up).to(a_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_h_ptr + out_row * in_width + cols[None, :],
                 (g * up * _activation_grad(x, ACT)).to(grad_h_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_h_ptr + out_row * in_width + width + cols[None, :], (g * act).to(grad_h_ptr.dtype.element_ty),
                 mask=mask)
    else:
        tl.store(a_ptr + out_row * width + cols[None, :], act.to(a_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_h_ptr + out_row * in_width + cols[None, :],
                 (g * _activation_grad(x, ACT)).to(grad_h_ptr.dtype.element_ty), mask=mask)


def expert_activation_backward(h, offsets, bias, grad_a, activation: str, gated: bool,
                               block_m: int = 32, block_n: int = 128):
    """Returns (a, grad_h): the forward activation output and the gradient w.r.t. h (zero on dropped rows)."""
    h, grad_a = h.contiguous(), grad_a.contiguous()
    n_rows, width = grad_a.shape
    a, grad_h = h.new_empty(n_rows, width), torch.empty_like(h)
    if n_rows == 0:
        return a, grad_h
    num_experts = offsets.shape[0]
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(width, block_n))
    _expert_activation_backward_kernel[grid](
        h, bias if bias is not None else h, offsets, grad_a, a, grad_h, n_rows, width, num_experts,
        HAS_BIAS=bias is not None, GATED=gated, ACT=ACTIVATION_IDS[activation], BLOCK_M=block_m, BLOCK_N=block_n,
        E_PAD=triton.next_power_of_2(num_experts))
    return a, grad_h


@triton.jit
def _row_of(row_of_ptr, order_ptr, n, a, amask, SEARCH: tl.constexpr, CHUNK: tl.constexpr):
    """Sorted row of each assignment a: read from the inverse permutation, or (SEARCH) found in order itself, which
    for few assignments costs less than the launch that builds the inverse."""
    if SEARCH:
        row = tl.zeros(a.shape, dtype=tl.int64)
        for p0 in range(0, n, CHUNK):
            p = p0 + tl.arange(0, CHUNK)
            o = tl.load(order_ptr + p, mask=p < n, other=-1).to(tl.int32)
            row += tl.sum(tl.where(o[None, :] == a[:, None], p[None, :], 0), axis=1).to(tl.int64)
    else:
        row = tl.load(row_of_ptr + a, mask=amask, other=0)
    return row


@triton.jit
def _invert_kernel(order_ptr, row_of_ptr, n, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(row_of_ptr + tl.load(order_ptr + p, mask=p < n, other=0), p.to(tl.int64), mask=p < n)


def row_of_assignments(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of order (each assignment's sorted row) in one launch."""
    row_of = torch.empty_like(order)
    if order.numel():
        _invert_kernel[(triton.cdiv(order.numel(), 1024),)](order, row_of, order.numel(), BLOCK=1024)
    return row_of


@triton.jit
def _combine_kernel(y_ptr, row_of_ptr, order_ptr, w_ptr, out_ptr, tokens, n, hidden, stride_y, stride_out,
                    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, SEARCH: tl.constexpr,
                    CHUNK: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = tok < tokens
    cmask = cols < hidden
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # unrolled: the k row loads are in flight together
        w = tl.load(w_ptr + tok * TOP_K + j, mask=tmask, other=0.0)
        row = _row_of(row_of_ptr, order_ptr, n, tok * TOP_K + j, tmask, SEARCH, CHUNK)
        keep = tmask & (w != 0.0)  # dropped assignments' rows are never read
        v = tl.load(y_ptr + row[:, None].to(tl.int64) * stride_y + cols[None, :],
                    mask=keep[:, None] & cmask[None, :], other=0.0)
        acc += w[:, None] * v.to(tl.float32)
    tl.store(out_ptr + tok[:, None].to(tl.int64) * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


def combine(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
            block_t: int = 1, block_h: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * expert_out[row of (t, j)]: a gather per token, no atomics, deterministic. The
    default tile, a token's whole row up to COMBINE_COLUMNS per program, read fastest at every shape timed
    (bench/results/gpu-combine-tiles.md)."""
    tokens, top_k = weights.shape
    hidden = expert_out.shape[1]
    block_h = block_h or min(COMBINE_COLUMNS, triton.next_power_of_2(hidden))
    out = expert_out.new_empty(tokens, hidden)
    if tokens == 0:
        return out
    n = order.numel()
    search = n <= SEARCH_ROWS
    row_of = order if search else row_of_assignments(order)
    weights = weights.float().contiguous()
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(hidden, block_h))
    _combine_kernel[grid](expert_out, row_of, order, weights, out, tokens, n, hidden, expert_out.stride(0),
                          out.stride(0), TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, SEARCH=search,
                          CHUNK=min(128, triton.next_power_of_2(n)), num_warps=num_warps)
    return out


@triton.jit
def _combine_backward_kernel(grad_out_ptr, y_ptr, row_of_ptr, w_ptr, grad_rows_ptr, grad_w_ptr, tokens,
                             hidden: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Per token block: dL/d(row) = w * dL/d(out) scattered to each assignment's row, and dL/dw = <dL/d(out), row>
    (the hidden dim is looped here so the dot product needs no atomics)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < tokens
    for j in range(TOP_K):
        w = tl.load(w_ptr + tok * TOP_K + j, mask=tmask, other=0.0)
        row = tl.load(row_of_ptr + tok * TOP_K + j, mask=tmask, other=0).to(tl.int64)
        keep = tmask & (w != 0.0)
        dot = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):  # constexpr hidden: the interpreter needs it
            cols = h0 + tl.arange(0, BLOCK_H)
            cmask = cols < hidden
            g = tl.load(grad_out_ptr + tok[:, None].to(tl.int64) * hidden + cols[None, :],
                        mask=tmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            y = tl.load(y_ptr + row[:, None] * hidden + cols[None, :], mask=keep[:, None] & cmask[None, :],
                        other=0.0).to(tl.float32)
            dot += tl.sum(g * y, axis=1)
            tl.store(grad_rows_ptr + row[:, None] * hidden + cols[None, :],
                     (g * w[:, None]).to(grad_rows_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])
        tl.store(grad_w_ptr + tok * TOP_K + j, dot, mask=tmask)


def combine_backward(grad_out, expert_out, order, weights, block_t: int = 16, block_h: int = 256):
    """Returns (grad_expert_out, grad_weights); dropped assignments get zero gradients."""
    tokens, top_k = weights.shape
    grad_out, expert_out = grad_out.contiguous(), expert_out.contiguous()
    grad_rows = torch.empty_like(expert_out)
    grad_w = torch.empty(tokens, top_k, dtype=torch.float32, device=weights.device)
    if tokens == 0:
        return grad_rows, grad_w.to(weights.dtype)
    row_of = row_of_assignments(order)
    _combine_backward_kernel[(triton.cdiv(tokens, block_t),)](
        grad_out, expert_out, row_of, weights.float().contiguous(), grad_rows, grad_w, tokens, expert_out.shape[1],
        TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h)
    return grad_rows, grad_w.to(weights.dtype)


@triton.jit
def _zero_rows_past_groups_kernel(t_ptr, offsets_ptr, n_rows, width, row_stride, num_experts, BLOCK_R: tl.constexpr,
                                  BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    past = (rows >= tl.load(offsets_ptr + num_experts - 1)) & (rows < n_rows)
    for c0 in range(0, width, BLOCK_C):  # every store masked off where no row is past the groups: no traffic
        cols = c0 + tl.arange(0, BLOCK_C)
        tl.store(t_ptr + rows[:, None].to(tl.int64) * row_stride + cols[None, :],
                 tl.zeros((BLOCK_R, BLOCK_C), dtype=t_ptr.dtype.element_ty),
                 mask=past[:, None] & (cols < width)[None, :])


def zero_rows_past_groups(t: torch.Tensor, offsets: torch.Tensor, block_r: int = 64,
                          block_c: int = 256) -> torch.Tensor:
    """Zero t's rows at or past offsets[-1] (dropped assignments) in place, reading the end on the device: only
    those rows are written, where a masked fill would read and write every row. t: rows of unit column stride."""
    if t.shape[0] and offsets.numel():
        _zero_rows_past_groups_kernel[(triton.cdiv(t.shape[0], block_r),)](
            t, offsets, t.shape[0], t.shape[1], t.stride(0), offsets.numel(), BLOCK_R=block_r, BLOCK_C=block_c)
    return t


def gather_sum(rows: torch.Tensor, order: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """out[t] = sum_j rows[row of (t, j)]: dispatch's backward as a per-token gather instead of atomic adds."""
    ones = torch.ones(tokens, top_k, dtype=torch.float32, device=rows.device)
    return combine(rows, order, ones)


# ---- grouped first projection with the activation in its epilogue (the expert_activation pass disappears)

# what the grouped GEMMs are tuned by; a scattered store adds into its output, which tuning zeroes between its runs
_TUNING_KEY = ["rows_bucket", "hidden", "width", "num_experts", "GATED", "SCATTER"]


def _ffn_in_configs():
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, w, s in ((128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 4),
                                 (128, 128, 8, 4), (64, 128, 8, 3))]


@triton.jit
def _tile_table(offsets_ptr, num_experts, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per expert (padded to E_PAD): cumulative count of BLOCK_M row tiles (huge past the last expert), first and
    end row, and the number of live M tiles. Rebuilt from offsets on the device, so no host-side schedule is
    needed and launches stay capturable."""
    e_idx = tl.arange(0, E_PAD)
    valid = e_idx < num_experts
    ends = tl.load(offsets_ptr + e_idx, mask=valid, other=0)
    begins = tl.load(offsets_ptr + e_idx - 1, mask=valid & (e_idx > 0), other=0)
    tile_ends = tl.cumsum((ends - begins + BLOCK_M - 1) // BLOCK_M, axis=0)
    total_tiles = tl.max(tl.where(valid, tile_ends, 0), axis=0)
    return tl.where(valid, tile_ends, 2147483647), begins, ends, total_tiles


@triton.jit
def _tile_at(tile, tile_ends, begins, ends, tiles_m, width: tl.constexpr, E_PAD: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile number `tile` of a grouped GEMM over rows in expert order -> (M tile, expert, rows, row mask,
    N tile). M tiles never straddle two experts; GROUP_M neighbouring tiles share weight and row tiles in L2."""
    e_idx = tl.arange(0, E_PAD)
    tiles_n: tl.constexpr = (width + BLOCK_N - 1) // BLOCK_N
    first_m = tile // (GROUP_M * tiles_n) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * tiles_n)) % group_size
    pid_n = (tile % (GROUP_M * tiles_n)) // group_size
    expert = tl.sum((tile_ends <= pid_m).to(tl.int32), axis=0)
    tile_start = tl.sum(tl.where(e_idx == expert - 1, tile_ends, 0), axis=0)
    row_begin = tl.sum(tl.where(e_idx == expert, begins, 0), axis=0)
    row_end = tl.sum(tl.where(e_idx == expert, ends, 0), axis=0)
    rows = row_begin + (pid_m - tile_start) * BLOCK_M + tl.arange(0, BLOCK_M)
    return pid_m, expert, rows, rows < row_end, pid_n


@triton.jit
def _expert_tile(offsets_ptr, n_rows, num_experts, width: tl.constexpr, E_PAD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile: (live, expert, rows, row mask, N tile). The grid is sized for the worst case,
    (cdiv(rows, BLOCK_M) + E) M tiles; programs past the last live tile are not live."""
    tile_ends, begins, ends, total_tiles = _tile_table(offsets_ptr, num_experts, E_PAD, BLOCK_M)
    pid_m, expert, rows, rmask, pid_n = _tile_at(tl.program_id(0), tile_ends, begins, ends,
                                                 tl.cdiv(n_rows, BLOCK_M) + num_experts, width, E_PAD, BLOCK_M,
                                                 BLOCK_N, GROUP_M)
    return pid_m < total_tiles, expert, rows, rmask, pid_n


@triton.jit
def _bias_activation(acc, acc_up, bias_ptr, expert, cols, cmask, width: tl.constexpr, HAS_BIAS: tl.constexpr,
                     GATED: tl.constexpr, ACT: tl.constexpr):
    """The grouped GEMMs' epilogue on a [rows, cols] tile: + the expert's bias, act (ACT -1: none), times up when
    gated (acc: the gate or only projection, acc_up: the up projection)."""
    if HAS_BIAS:
        in_width: tl.constexpr = 2 * width if GATED else width
        b_row = bias_ptr + expert.to(tl.int64) * in_width
        acc += tl.load(b_row + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_row + width + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    out = acc
    if ACT >= 0:
        out = _activation(acc, ACT)
    if GATED:
        out = out * acc_up
    return out


@triton.jit
def _expert_columns(w_ptr, expert, pid_n, hidden: tl.constexpr, width: tl.constexpr, GATED: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """(cols, column mask, the expert's W_in base) of output column tile pid_n of a first projection, whose weights
    are [E, (2) width, hidden] (gated: gate rows, then up rows from row `width`)."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_width: tl.constexpr = 2 * width if GATED else width
    return cols, cols < width, w_ptr + expert.to(tl.int64) * in_width * hidden


@triton.jit
def _store_tile(out, out_ptr, tok_ptr, rw_ptr, rows, rmask, cols, cmask, width: tl.constexpr, SCATTER: tl.constexpr):
    """The grouped GEMMs' store of a [rows, cols] tile: to the same rows, or (SCATTER) the combine folded in: row r
    added, times its router weight rw[r], to output row tok[r] by atomic adds (several experts add to one row)."""
    if SCATTER:
        tok = tl.load(tok_ptr + rows, mask=rmask, other=0)
        out *= tl.load(rw_ptr + rows, mask=rmask, other=0.0)[:, None]
        tl.atomic_add(out_ptr + tok[:, None].to(tl.int64) * width + cols[None, :], out.to(out_ptr.dtype.element_ty),
                      mask=rmask[:, None] & cmask[None, :], sem="relaxed")
    else:
        tl.store(out_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _grouped_ffn_in_kernel(x_ptr, w_ptr, bias_ptr, offsets_ptr, out_ptr, tok_ptr, rw_ptr, n_rows, num_experts,
                           rows_bucket, hidden: tl.constexpr, width: tl.constexpr, HAS_BIAS: tl.constexpr,
                           GATED: tl.constexpr, ACT: tl.constexpr, SCATTER: tl.constexpr, E_PAD: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr):
    """out[r] = act(x[r] W_in[e]^T + b_in[e]) for the rows r of each expert e's group (gated: act(gate) * up).
    Tiles as _expert_tile says."""
    live, expert, rows, rmask, pid_n = _expert_tile(offsets_ptr, n_rows, num_experts, width, E_PAD, BLOCK_M,
                                                    BLOCK_N, GROUP_M)
    if live:
        cols, cmask, w_base = _expert_columns(w_ptr, expert, pid_n, hidden, width, GATED, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < hidden
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * hidden + ks[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_base + cols[None, :].to(tl.int64) * hidden + ks[:, None],
                        mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            if GATED:
                bu = tl.load(w_base + (width + cols[None, :]).to(tl.int64) * hidden + ks[:, None],
                             mask=kmask[:, None] & cmask[None, :], other=0.0)
                acc_up = tl.dot(a, bu, acc_up)
        out = _bias_activation(acc, acc_up, bias_ptr, expert, cols, cmask, width, HAS_BIAS, GATED, ACT)
        _store_tile(out, out_ptr, tok_ptr, rw_ptr, rows, rmask, cols, cmask, width, SCATTER)


_grouped_ffn_in_tuned = triton.autotune(configs=_ffn_in_configs(),
                                        key=_TUNING_KEY, reset_to_zero=["out_ptr"])(
    _grouped_ffn_in_kernel)


def _ffn_in_decode_configs():
    """Few rows per expert (decode): one narrow M tile per hit expert, narrow N tiles so that the weight read spreads
    over every SM in many programs, long K steps; GROUP_M 1 lets the grid cover only tiles that can hold a row."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in ((16, 16, 256, 2, 4), (16, 16, 128, 2, 6), (16, 32, 256, 4, 4),
                                     (16, 32, 128, 2, 5), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3),
                                     (32, 32, 128, 4, 4), (32, 64, 128, 4, 4), (16, 16, 512, 4, 3),
                                     (16, 32, 512, 4, 3))]


_grouped_ffn_in_decode_tuned = triton.autotune(configs=_ffn_in_decode_configs(),
                                               key=_TUNING_KEY, reset_to_zero=["out_ptr"])(
    _grouped_ffn_in_kernel)


def _ffn_in_tma_configs():
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4),
                                     (128, 64, 64, 4, 4), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3))]


@triton.jit
def _tma_weight_desc(w_ptr, num_experts, hidden: tl.constexpr, width: tl.constexpr, GATED: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """TMA descriptor of the weights [E, (2 x) width, hidden]. Gated: one copy brings the gate and up rows of the
    same BLOCK_N outputs, interleaved (a [E, width, 2, hidden] view), so one m64n256 wgmma computes both (faster
    than a dot each)."""
    if GATED:
        desc = tl.make_tensor_descriptor(w_ptr, shape=[num_experts, width, 2, hidden],
                                         strides=[2 * width * hidden, hidden, width * hidden, 1],
                                         block_shape=[1, BLOCK_N, 2, BLOCK_K])
    else:
        desc = tl.make_tensor_descriptor(w_ptr, shape=[num_experts * width, hidden], strides=[hidden, 1],
                                         block_shape=[BLOCK_N, BLOCK_K])
    return desc


@triton.jit
def _tma_tile(x_desc, w_desc, bias_ptr, out_ptr, tok_ptr, rw_ptr, expert, rows, rmask, pid_n, hidden: tl.constexpr,
              width: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
              SCATTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile from TMA-loaded operands: the k loop, bias + activation, the masked store. A row tile may
    read rows of the next expert's group (and, ungated, weight rows past this expert's width); those only reach
    outputs the masked store skips. SCATTER: row r is added, times rw[r], to output row tok[r] (atomics)."""
    row0 = tl.min(rows, axis=0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < width
    if GATED:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            w = w_desc.load([expert, pid_n * BLOCK_N, 0, k0]).reshape(2 * BLOCK_N, BLOCK_K)
            acc = tl.dot(x_desc.load([row0, k0]), w.T, acc)
        gate, up = tl.split(acc.reshape(BLOCK_M, BLOCK_N, 2))  # columns alternate gate, up: register-local
    else:
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            gate = tl.dot(x_desc.load([row0, k0]), w_desc.load([expert * width + pid_n * BLOCK_N, k0]).T, gate)
        up = gate  # unused
    out = _bias_activation(gate, up, bias_ptr, expert, cols, cmask, width, HAS_BIAS, GATED, ACT)
    _store_tile(out, out_ptr, tok_ptr, rw_ptr, rows, rmask, cols, cmask, width, SCATTER)


@triton.jit
def _grouped_ffn_in_tma_kernel(x_ptr, w_ptr, bias_ptr, offsets_ptr, out_ptr, tok_ptr, rw_ptr, n_rows, num_experts,
                               rows_bucket, hidden: tl.constexpr, width: tl.constexpr, HAS_BIAS: tl.constexpr,
                               GATED: tl.constexpr, ACT: tl.constexpr, SCATTER: tl.constexpr, E_PAD: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               GROUP_M: tl.constexpr):
    """_grouped_ffn_in_kernel with its operands loaded by the tensor memory accelerator (Hopper TMA): whole
    [BLOCK_M, BLOCK_K] row tiles and weight tiles per copy."""
    live, expert, rows, rmask, pid_n = _expert_tile(offsets_ptr, n_rows, num_experts, width, E_PAD, BLOCK_M,
                                                    BLOCK_N, GROUP_M)
    if live:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[n_rows, hidden], strides=[hidden, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = _tma_weight_desc(w_ptr, num_experts, hidden, width, GATED, BLOCK_N, BLOCK_K)
        _tma_tile(x_desc, w_desc, bias_ptr, out_ptr, tok_ptr, rw_ptr, expert, rows, rmask, pid_n, hidden, width,
                  HAS_BIAS, GATED, ACT, SCATTER, BLOCK_M, BLOCK_N, BLOCK_K)


_grouped_ffn_in_tma_tuned = triton.autotune(configs=_ffn_in_tma_configs(),
                                            key=_TUNING_KEY, reset_to_zero=["out_ptr"])(
    _grouped_ffn_in_tma_kernel)


@triton.jit
def _grouped_ffn_in_persistent_kernel(x_ptr, w_ptr, bias_ptr, offsets_ptr, out_ptr, tok_ptr, rw_ptr, n_rows,
                                      num_experts, rows_bucket, hidden: tl.constexpr, width: tl.constexpr,
                                      HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                                      SCATTER: tl.constexpr, E_PAD: tl.constexpr,
                                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                      GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, INTERPRET: tl.constexpr):
    """_grouped_ffn_in_tma_kernel as a persistent kernel: one program per SM walks the live tiles, so the tile
    table is built once per SM and the flattened loop overlaps a tile's epilogue with the next tile's loads.
    (Triton 3.6's warp_specialize leaves this loop unchanged on sm_90: same PTX.)"""
    tile_ends, begins, ends, tiles_m = _tile_table(offsets_ptr, num_experts, E_PAD, BLOCK_M)
    tiles_n: tl.constexpr = (width + BLOCK_N - 1) // BLOCK_N
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[n_rows, hidden], strides=[hidden, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    w_desc = _tma_weight_desc(w_ptr, num_experts, hidden, width, GATED, BLOCK_N, BLOCK_K)
    if INTERPRET:  # the interpreter's ranges take no device scalars (numpy 2); its while loops do
        tile = tl.program_id(0)
        while tile < tiles_m * tiles_n:
            _, expert, rows, rmask, pid_n = _tile_at(tile, tile_ends, begins, ends, tiles_m, width, E_PAD, BLOCK_M,
                                                     BLOCK_N, GROUP_M)
            _tma_tile(x_desc, w_desc, bias_ptr, out_ptr, tok_ptr, rw_ptr, expert, rows, rmask, pid_n, hidden, width,
                      HAS_BIAS, GATED, ACT, SCATTER, BLOCK_M, BLOCK_N, BLOCK_K)
            tile += NUM_SMS
    else:
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS, flatten=True):
            _, expert, rows, rmask, pid_n = _tile_at(tile, tile_ends, begins, ends, tiles_m, width, E_PAD, BLOCK_M,
                                                     BLOCK_N, GROUP_M)
            _tma_tile(x_desc, w_desc, bias_ptr, out_ptr, tok_ptr, rw_ptr, expert, rows, rmask, pid_n, hidden, width,
                      HAS_BIAS, GATED, ACT, SCATTER, BLOCK_M, BLOCK_N, BLOCK_K)


def _ffn_in_persistent_configs():
    # GROUP_M 16 too: it wins at large many-expert batches (Qwen3-MoE)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm}, num_warps=w, num_stages=s)
            for bm, bn, bk, gm, w, s in ((128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 3),
                                         (64, 128, 64, 8, 4, 4), (128, 128, 64, 16, 8, 3), (128, 256, 64, 16, 8, 3))]


_grouped_ffn_in_persistent_tuned = triton.autotune(configs=_ffn_in_persistent_configs(),
                                                   key=_TUNING_KEY, reset_to_zero=["out_ptr"])(
    _grouped_ffn_in_persistent_kernel)


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_supported(x: torch.Tensor, w_in: torch.Tensor) -> bool:
    """TMA needs Hopper or newer and 16-byte aligned row strides; the interpreter emulates it (tests)."""
    aligned = (x.shape[1] * x.element_size()) % 16 == 0
    return aligned and (not x.is_cuda or torch.cuda.get_device_capability(x.device) >= (9, 0))


# The grouped GEMM kernels by name: (fixed-tile kernel, autotuned kernel, persistent, needs TMA).
GROUPED_GEMMS = {"triton": (_grouped_ffn_in_kernel, _grouped_ffn_in_tuned, False, False),
                 "triton_decode": (_grouped_ffn_in_kernel, _grouped_ffn_in_decode_tuned, False, False),
                 "triton_tma": (_grouped_ffn_in_tma_kernel, _grouped_ffn_in_tma_tuned, False, True),
                 "triton_persistent": (_grouped_ffn_in_persistent_kernel, _grouped_ffn_in_persistent_tuned, True,
                                       True)}


def needs_tma(variant: str) -> bool:
    return variant in GROUPED_GEMMS and GROUPED_GEMMS[variant][3]


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def grouped_ffn_in(x: torch.Tensor, offsets: torch.Tensor, w_in: torch.Tensor, b_in, activation: str, gated: bool,
                   config: dict | None = None, variant: str = "triton",
                   scatter: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Fused first projection + bias + activation over rows in expert order; rows past offsets[-1] untouched.
    `variant` names the kernel (GROUPED_GEMMS; the TMA ones need tma_supported). `config` fixes the tiles (tests,
    the interpreter: BLOCK_M/N/K, GROUP_M); otherwise autotuned per shape.
    With activation None it is a plain projection x W^T + b (the second one).
    scatter = (tokens, row_weights, out): the weighted combine folded into the store, returning out after
    out[tokens[r]] += row_weights[r] * row r for r < offsets[-1] (tokens int32 and row_weights float32 per row; out
    [T, width], zeroed by the caller, float32 or x's dtype). Atomic adds: the sums' order, so their rounding, varies
    from run to run. No runtime path takes it: the layer measured slower with it than with the projection then the
    combine kernel (bench/scatter_combine.py)."""
    n_rows, hidden = x.shape
    num_experts, in_width, _ = w_in.shape
    width = in_width // 2 if gated else in_width
    if scatter is not None:
        tokens, row_weights, out = scatter
    else:
        out = x.new_empty(n_rows, width)
        tokens = row_weights = offsets  # unread
    if n_rows == 0:
        return out
    x, w_in = x.contiguous(), w_in.contiguous()
    fixed, tuned, persistent, tma = GROUPED_GEMMS[variant]
    extra = {}
    if persistent:
        extra.update(NUM_SMS=_num_sms(x.device), INTERPRET=not x.is_cuda)

    def grid(meta):
        if persistent:
            return (meta["NUM_SMS"],)
        tiles_m = triton.cdiv(n_rows, meta["BLOCK_M"]) + num_experts
        if meta["GROUP_M"] == 1:  # the tile order does not depend on the M extent: only tiles that can hold a row
            tiles_m = min(tiles_m, n_rows)
        return (tiles_m * triton.cdiv(width, meta["BLOCK_N"]),)

    if tma:
        triton.set_allocator(_tma_scratch)  # descriptors built on the device need a little global scratch
    kernel = fixed if config is not None else tuned
    kernel[grid](x, w_in, b_in if b_in is not None else x, offsets, out, tokens, row_weights, n_rows, num_experts,
                 triton.next_power_of_2(n_rows), hidden=hidden, width=width, HAS_BIAS=b_in is not None, GATED=gated,
                 ACT=ACTIVATION_IDS[activation] if activation else -1, SCATTER=scatter is not None,
                 E_PAD=triton.next_power_of_2(num_experts), **extra, **(config or {}))
    return out
