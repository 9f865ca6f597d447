"""Weight-only FP8 kernels for decode-sized batches: float8_e4m3fn weights with one float32 scale_inv per 128 x 128
block (moecompile/core/fp8_format.py) are read once and dequantised in registers; the activations stay in their
own dtype (not quantised) and the math is float32 (the small-M linear's tensor-core dot: the activations' dtype,
which holds every e4m3 value exactly, scaled in float32 after each K step).

- routed_experts_fp8: kernels/triton_direct.py's direct experts (one program per (assignment, column tile), no
  dispatch, the routing weight applied in the second projection's epilogue) over FP8 expert weights (its kernels'
  SCALED form).
- linear_fp8: y = x W^T + b for a few rows (decode), one program per (row tile, column tile, K split); one row is a
  matrix-vector product, more rows a tensor-core dot over a row tile padded to 16. Splitting K fills the GPU where
  the column tiles alone are too few programs (how many splits: the runtime's choice).

A K step of at most 128 channels (dividing 128) lies in one scale block: its scales are one float32 per output row
of the tile. The matrix-vector forms also step by whole blocks (256, 512 channels: more bytes per load), scaling each
block of the tile by its own; the dot form scales its product once per step, so it steps within a block.
"""
import torch
import triton
import triton.language as tl

from moecompile.kernels import triton_direct
from moecompile.kernels.triton_direct import row_scales, weight_tile

BLOCK = 128  # the weights' scale block edge
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activation dtypes these kernels take


def _matvec_configs():  # K steps of up to 128 channels (one scale per row) or of 256 / 512 (one per row and block)
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((8, 128, 2, 4), (16, 128, 4, 4), (32, 128, 4, 4), (16, 64, 2, 5), (32, 64, 4, 4),
                                 (64, 128, 4, 3), (64, 64, 4, 4), (8, 256, 2, 4), (16, 256, 4, 4), (32, 256, 4, 3),
                                 (8, 512, 4, 3), (16, 512, 4, 3))]


def _dot_configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 3), (64, 64, 4, 5),
                                 (128, 64, 8, 4), (32, 64, 2, 5))]


# the direct kernels' tiles for FP8 weights: K steps of at most 128 (one scale block per step)
_fp8_direct_in_tuned = triton.autotune(configs=_matvec_configs(), key=["hidden", "width", "GATED", "assignments"])(
    triton_direct._direct_ffn_in_kernel)
_fp8_direct_out_tuned = triton.autotune(configs=_matvec_configs(), key=["hidden", "width", "assignments"])(
    triton_direct._direct_ffn_out_kernel)


def _check_config(config: dict | None, dot: bool = False) -> None:
    """A K step lies in one scale block (BLOCK_K divides 128) or covers whole ones (a multiple of 128: not the dot
    form, which scales its product once per step)."""
    for tiles in (config or {}).values():
        k = tiles["BLOCK_K"]
        if BLOCK % k and (dot or k % BLOCK):
            raise ValueError(f"BLOCK_K must divide {BLOCK}{'' if dot else ' or be a multiple of it'}, got {k}")


def routed_experts_fp8(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_in: torch.Tensor,
                       w_in_scale_inv: torch.Tensor, b_in, w_out: torch.Tensor, w_out_scale_inv: torch.Tensor, b_out,
                       activation: str, gated: bool, config: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """[tokens, k, hidden] float32: each assignment's expert FFN output times its routing weight, the expert
    weights float8_e4m3fn w_in [E, (2)F, H], w_out [E, H, F] with scale_inv [E, ceil(rows/128), ceil(cols/128)].
    x [T, H] in DTYPES, weights / ids [T, k]. `config` fixes both kernels' tiles ({"in": {BLOCK_N, BLOCK_K, ...},
    "out": {...}}, BLOCK_K dividing 128 or a multiple of it); otherwise each is autotuned per shape. pdl: as
    triton_direct.launch's."""
    _check_config(config)
    return triton_direct.launch(x, weights, ids, w_in, b_in, w_out, b_out, activation, gated, config,
                                scales=(w_in_scale_inv, w_out_scale_inv),
                                tuned=(_fp8_direct_in_tuned, _fp8_direct_out_tuned), pdl=pdl)


# ---- linear_fp8: a few rows (decode) times FP8 block-scaled weights

MAX_DOT_ROWS = 64  # the largest row tile of the dot form


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, rows, n: tl.constexpr, k: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       K_SPLIT: tl.constexpr):
    """out[rows, cols] = x[rows] W[cols]^T + b[cols], W dequantised from its FP8 blocks; one program per (column
    tile, row tile, K split of K_SPLIT channels, a multiple of 128). With one split it stores the result in out's
    dtype; with several, split s stores its float32 partial sum (no bias) at out[s] ([splits, rows, n]), which
    _sum_splits_kernel adds up. BLOCK_M 1: a matrix-vector product in float32; else a dot in x's dtype per K step,
    scaled and accumulated in float32. `rows` only bounds the row tile (and keys the autotuning)."""
    k_blocks: tl.constexpr = (k + 127) // 128
    PARTIAL: tl.constexpr = K_SPLIT < k
    split = tl.program_id(2)
    k_start = split * K_SPLIT
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    if PARTIAL:
        out_ptr += split.to(tl.int64) * rows * n
    if BLOCK_M == 1:
        row = tl.program_id(1).to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = (ks < k) & (ks < k_start + K_SPLIT)  # a step wider than the split stops at its end
            xk = tl.load(x_ptr + row * k + ks, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * k + ks[None, :], mask=cmask[:, None] & kmask[None, :],
                        other=0.0)
            acc += weight_tile(w, s_ptr, cols, cmask, k_blocks, k0, True, BLOCK_N, BLOCK_K) * xk[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS and not PARTIAL:
            y += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)
    else:
        rs = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rs < rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < k
            xk = tl.load(x_ptr + rs[:, None].to(tl.int64) * k + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                         other=0.0)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * k + ks[:, None], mask=kmask[:, None] & cmask[None, :],
                        other=0.0)
            acc += tl.dot(xk, w.to(xk.dtype)) * row_scales(s_ptr, cols, cmask, k_blocks, k0)[None, :]
        if HAS_BIAS and not PARTIAL:
            acc += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rs[:, None].to(tl.int64) * n + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _sum_splits_kernel(partial_ptr, bias_ptr, out_ptr, size, n, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out = sum over s of partial[s] (+ bias), in split order (the same sum every run), cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(partial_ptr + s * size + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_fp8_linear_matvec_tuned = triton.autotune(configs=_matvec_configs(), key=["n", "k", "rows", "K_SPLIT"])(
    _fp8_linear_kernel)
_fp8_linear_dot_tuned = triton.autotune(configs=_dot_configs(), key=["n", "k", "BLOCK_M", "K_SPLIT"])(
    _fp8_linear_kernel)


def row_tile(rows: int) -> int:
    """BLOCK_M: 1 for one row (the matrix-vector form), else the next power of two from 16 (tl.dot's least) up to
    MAX_DOT_ROWS."""
    return 1 if rows == 1 else min(MAX_DOT_ROWS, max(16, triton.next_power_of_2(rows)))


def linear_fp8(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, bias, config: dict | None = None,
               splits: int = 1) -> torch.Tensor:
    """x [M, K] (a few rows, DTYPES) times float8_e4m3fn w [N, K] with scale_inv [ceil(N/128), ceil(K/128)] -> [M, N]
    in x's dtype, K cut into `splits` runs of whole scale blocks (as many as fit: fewer when K has fewer blocks), each
    its own programs, their float32 partial sums then added in split order. `config` ({BLOCK_N, BLOCK_K}, BLOCK_K
    dividing 128, or for one row a multiple of it) fixes the tiles; otherwise autotuned."""
    _check_config({"": config} if config else None, dot=row_tile(x.shape[0]) > 1)
    rows, k = x.shape
    n = w.shape[0]
    out = x.new_empty(rows, n)
    if rows == 0 or n == 0:
        return out
    x, w, w_scale_inv = x.contiguous(), w.contiguous(), w_scale_inv.float().contiguous()
    k_split = triton.cdiv(triton.cdiv(k, BLOCK), splits) * BLOCK  # whole scale blocks per split
    splits = triton.cdiv(k, k_split)
    partial = x.new_empty(splits, rows, n, dtype=torch.float32) if splits > 1 else out
    block_m = row_tile(rows)
    args = (x, w, w_scale_inv, bias if bias is not None else x, partial, rows)
    meta = dict(n=n, k=k, HAS_BIAS=bias is not None, BLOCK_M=block_m, K_SPLIT=k_split)
    row_tiles = rows if block_m == 1 else triton.cdiv(rows, block_m)
    if config:
        _fp8_linear_kernel[(triton.cdiv(n, config["BLOCK_N"]), row_tiles, splits)](*args, **meta, **config)
    else:
        tuned = _fp8_linear_matvec_tuned if block_m == 1 else _fp8_linear_dot_tuned
        tuned[lambda m: (triton.cdiv(n, m["BLOCK_N"]), row_tiles, splits)](*args, **meta)
    if splits > 1:
        size = rows * n
        _sum_splits_kernel[(triton.cdiv(size, 1024),)](partial, bias if bias is not None else partial, out, size, n,
                                                       SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=1024)
    return out

