"""Weight-only FP8 kernels for decode-sized batches: float8_e4m3fn weights with one float32 scale_inv per 128 x 128
block (moecompile/core/fp8_format.py) are read once and dequantised in registers; the activations stay in their
own dtype (not quantised) and the math is float32 (the small-M linear's tensor-core dot: the activations' dtype,
which holds every e4m3 value exactly, scaled in float32 after each K step).

- routed_experts_fp8: kernels/triton_direct.py's direct experts (one program per (assignment, column tile), no
  dispatch, the routing weight applied in the second projection's epilogue) over FP8 expert weights.
- linear_fp8: y = x W^T + b for a few rows (decode), one program per (row tile, column tile); one row is a
  matrix-vector product, more rows a tensor-core dot over a row tile padded to 16.

The K loop steps by at most 128 channels and 128 is a multiple of the step, so each step lies in one scale block:
its scales are one float32 per output row of the tile.
"""
import torch
import triton
import triton.language as tl

from moecompile.kernels.triton_moe import ACTIVATION_IDS, _bias_activation, _expert_columns

BLOCK = 128  # the weights' scale block edge
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activation dtypes these kernels take


def _matvec_configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((8, 128, 2, 4), (16, 128, 4, 4), (32, 128, 4, 4), (16, 64, 2, 5), (32, 64, 4, 4),
                                 (64, 128, 4, 3), (64, 64, 4, 4))]


def _dot_configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 3), (64, 64, 4, 5),
                                 (128, 64, 8, 4), (32, 64, 2, 5))]


@triton.jit
def _row_scales(s_ptr, rows, rmask, k_blocks: tl.constexpr, k0):
    """[len(rows)] float32: each weight row's scale_inv for the 128-channel block holding channel k0."""
    return tl.load(s_ptr + (rows // 128).to(tl.int64) * k_blocks + k0 // 128, mask=rmask, other=0.0)


@triton.jit
def _fp8_direct_in_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, assignments, top_k, num_experts,
                          hidden: tl.constexpr, width: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                          ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[a, cols] = act(x[a // top_k] W_in[ids[a]][cols]^T + b) (gated: act(gate) * up) with W_in dequantised
    from its FP8 blocks, one program per (assignment a, column tile); `assignments` only keys the autotuning."""
    tiles_n: tl.constexpr = (width + BLOCK_N - 1) // BLOCK_N
    k_blocks: tl.constexpr = (hidden + 127) // 128
    in_width: tl.constexpr = 2 * width if GATED else width
    a = tl.program_id(0) // tiles_n
    pid_n = tl.program_id(0) % tiles_n
    expert = tl.load(ids_ptr + a)
    if (expert >= 0) & (expert < num_experts):
        x_row = x_ptr + (a // top_k).to(tl.int64) * hidden
        cols, cmask, w_base = _expert_columns(w_ptr, expert, pid_n, hidden, width, GATED, BLOCK_N)
        s_base = s_ptr + expert.to(tl.int64) * ((in_width + 127) // 128) * k_blocks
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_row + ks, mask=ks < hidden, other=0.0).to(tl.float32)[None, :]
            wmask = cmask[:, None] & (ks < hidden)[None, :]
            w = tl.load(w_base + cols[:, None].to(tl.int64) * hidden + ks[None, :], mask=wmask, other=0.0)
            acc += w.to(tl.float32) * _row_scales(s_base, cols, cmask, k_blocks, k0)[:, None] * xk
            if GATED:
                up = width + cols
                wu = tl.load(w_base + up[:, None].to(tl.int64) * hidden + ks[None, :], mask=wmask, other=0.0)
                acc_up += wu.to(tl.float32) * _row_scales(s_base, up, cmask, k_blocks, k0)[:, None] * xk
        out = _bias_activation(tl.sum(acc, axis=1)[None, :], tl.sum(acc_up, axis=1)[None, :], bias_ptr, expert,
                               cols, cmask, width, HAS_BIAS, GATED, ACT)
        tl.store(out_ptr + a.to(tl.int64) * width + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=cmask[None, :])


@triton.jit
def _fp8_direct_out_kernel(a_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, assignments, num_experts,
                           hidden: tl.constexpr, width: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    """out[a, cols] = weights[a] * (act[a] W_out[ids[a]][cols]^T + b_out[ids[a]][cols]) in float32 with W_out
    dequantised from its FP8 blocks, one program per (assignment a, column tile); 0 for a dropped assignment."""
    tiles_n: tl.constexpr = (hidden + BLOCK_N - 1) // BLOCK_N
    k_blocks: tl.constexpr = (width + 127) // 128
    a = tl.program_id(0) // tiles_n
    cols = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    expert = tl.load(ids_ptr + a)
    weight = tl.load(weights_ptr + a).to(tl.float32)
    kept = (expert >= 0) & (expert < num_experts) & (weight != 0.0)
    limit = tl.where(kept, width, 0)  # a dropped assignment reads nothing
    w_base = w_ptr + expert.to(tl.int64) * hidden * width
    s_base = s_ptr + expert.to(tl.int64) * ((hidden + 127) // 128) * k_blocks
    smask = cols < tl.where(kept, hidden, 0)  # a dropped assignment reads no scales
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < limit
        ak = tl.load(a_ptr + a.to(tl.int64) * width + ks, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(w_base + cols[:, None].to(tl.int64) * width + ks[None, :], mask=cmask[:, None] & kmask[None, :],
                    other=0.0)
        acc += w.to(tl.float32) * _row_scales(s_base, cols, smask, k_blocks, k0)[:, None] * ak[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + expert.to(tl.int64) * hidden + cols, mask=cols < tl.where(kept, hidden, 0),
                     other=0.0).to(tl.float32)
    tl.store(out_ptr + a.to(tl.int64) * hidden + cols, tl.where(kept, weight * y, 0.0), mask=cmask)


_fp8_direct_in_tuned = triton.autotune(configs=_matvec_configs(), key=["hidden", "width", "GATED", "assignments"])(
    _fp8_direct_in_kernel)
_fp8_direct_out_tuned = triton.autotune(configs=_matvec_configs(), key=["hidden", "width", "assignments"])(
    _fp8_direct_out_kernel)


def _check_config(config: dict | None) -> None:
    for tiles in (config or {}).values():
        if BLOCK % tiles["BLOCK_K"]:
            raise ValueError(f"BLOCK_K must divide {BLOCK} (one scale block per K step), got {tiles['BLOCK_K']}")


def routed_experts_fp8(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_in: torch.Tensor,
                       w_in_scale_inv: torch.Tensor, b_in, w_out: torch.Tensor, w_out_scale_inv: torch.Tensor, b_out,
                       activation: str, gated: bool, config: dict | None = None) -> torch.Tensor:
    """[tokens, k, hidden] float32: each assignment's expert FFN output times its routing weight, the expert
    weights float8_e4m3fn w_in [E, (2)F, H], w_out [E, H, F] with scale_inv [E, ceil(rows/128), ceil(cols/128)].
    x [T, H] in DTYPES, weights / ids [T, k]. `config` fixes both kernels' tiles ({"in": {BLOCK_N, BLOCK_K},
    "out": {...}}, BLOCK_K dividing 128); otherwise each is autotuned per shape."""
    _check_config(config)
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, in_width, _ = w_in.shape
    width = in_width // 2 if gated else in_width
    assignments = tokens * top_k
    terms = x.new_empty(tokens, top_k, hidden, dtype=torch.float32)
    if assignments == 0:
        return terms
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    w_in, w_out = w_in.contiguous(), w_out.contiguous()
    w_in_scale_inv, w_out_scale_inv = w_in_scale_inv.float().contiguous(), w_out_scale_inv.float().contiguous()
    act = x.new_empty(assignments, width)
    first = dict(hidden=hidden, width=width, HAS_BIAS=b_in is not None, GATED=gated,
                 ACT=ACTIVATION_IDS[activation] if activation else -1)
    second = dict(hidden=hidden, width=width, HAS_BIAS=b_out is not None)
    in_args = (x, ids, w_in, w_in_scale_inv, b_in if b_in is not None else x, act, assignments, top_k, num_experts)
    out_args = (act, ids, weights, w_out, w_out_scale_inv, b_out if b_out is not None else x, terms, assignments,
                num_experts)
    if config is None:
        _fp8_direct_in_tuned[lambda meta: (assignments * triton.cdiv(width, meta["BLOCK_N"]),)](*in_args, **first)
        _fp8_direct_out_tuned[lambda meta: (assignments * triton.cdiv(hidden, meta["BLOCK_N"]),)](*out_args,
                                                                                                   **second)
    else:
        _fp8_direct_in_kernel[(assignments * triton.cdiv(width, config["in"]["BLOCK_N"]),)](
            *in_args, **first, **config["in"])
        _fp8_direct_out_kernel[(assignments * triton.cdiv(hidden, config["out"]["BLOCK_N"]),)](
            *out_args, **second, **config["out"])
    return terms


# ---- linear_fp8: a few rows (decode) times FP8 block-scaled weights

MAX_DOT_ROWS = 64  # the largest row tile of the dot form


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, rows, n: tl.constexpr, k: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[rows, cols] = x[rows] W[cols]^T + b[cols], W dequantised from its FP8 blocks; one program per (column
    tile, row tile). BLOCK_M 1: a matrix-vector product in float32; else a dot in x's dtype per K step, scaled and
    accumulated in float32. `rows` only bounds the row tile (and keys the autotuning)."""
    k_blocks: tl.constexpr = (k + 127) // 128
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    if BLOCK_M == 1:
        row = tl.program_id(1).to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + row * k + ks, mask=ks < k, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * k + ks[None, :], mask=cmask[:, None] & (ks < k)[None, :],
                        other=0.0)
            acc += w.to(tl.float32) * _row_scales(s_ptr, cols, cmask, k_blocks, k0)[:, None] * xk[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)
    else:
        rs = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rs < rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < k
            xk = tl.load(x_ptr + rs[:, None].to(tl.int64) * k + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                         other=0.0)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * k + ks[:, None], mask=kmask[:, None] & cmask[None, :],
                        other=0.0)
            acc += tl.dot(xk, w.to(xk.dtype)) * _row_scales(s_ptr, cols, cmask, k_blocks, k0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rs[:, None].to(tl.int64) * n + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


_fp8_linear_matvec_tuned = triton.autotune(configs=_matvec_configs(), key=["n", "k", "rows"])(_fp8_linear_kernel)
_fp8_linear_dot_tuned = triton.autotune(configs=_dot_configs(), key=["n", "k", "BLOCK_M"])(_fp8_linear_kernel)


def row_tile(rows: int) -> int:
    """BLOCK_M: 1 for one row (the matrix-vector form), else the next power of two from 16 (tl.dot's least) up to
    MAX_DOT_ROWS."""
    return 1 if rows == 1 else min(MAX_DOT_ROWS, max(16, triton.next_power_of_2(rows)))


def linear_fp8(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, bias, config: dict | None = None
               ) -> torch.Tensor:
    """x [M, K] (a few rows, DTYPES) times float8_e4m3fn w [N, K] with scale_inv [ceil(N/128), ceil(K/128)] -> [M, N]
    in x's dtype. `config` ({BLOCK_N, BLOCK_K}, BLOCK_K dividing 128) fixes the tiles; otherwise autotuned."""
    _check_config({"": config} if config else None)
    rows, k = x.shape
    n = w.shape[0]
    out = x.new_empty(rows, n)
    if rows == 0 or n == 0:
        return out
    x, w, w_scale_inv = x.contiguous(), w.contiguous(), w_scale_inv.float().contiguous()
    block_m = row_tile(rows)
    args = (x, w, w_scale_inv, bias if bias is not None else x, out, rows)
    meta = dict(n=n, k=k, HAS_BIAS=bias is not None, BLOCK_M=block_m)
    row_tiles = rows if block_m == 1 else triton.cdiv(rows, block_m)
    if config is not None:
        _fp8_linear_kernel[(triton.cdiv(n, config["BLOCK_N"]), row_tiles)](*args, **meta, **config)
    else:
        tuned = _fp8_linear_matvec_tuned if block_m == 1 else _fp8_linear_dot_tuned
        tuned[lambda m: (triton.cdiv(n, m["BLOCK_N"]), row_tiles)](*args, **meta)
    return out
