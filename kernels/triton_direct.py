"""Triton expert FFNs over unsorted token assignments, for batches of a few tokens (decode): no sort, no dispatched
copy of the rows, no combine kernel.

    routed_experts(x, weights, ids, ...)[t, j] = weights[t, j] * FFN_{ids[t, j]}(x[t])    (float32)

Two launches, one program per (assignment, column tile) each: the first projection (+ bias, activation) reads the
assignment's expert id and its token's row directly; the second multiplies by the routing weight in its epilogue.
The caller sums the k terms of a token (the compile backend leaves that sum to inductor: one small reduction where
the sorted path has its combine kernel). Each program streams a narrow tile of one expert's weights as a
matrix-vector product; each hit expert's weights are read once when the tokens' experts are distinct (always for
one token). Dropped assignments (id outside 0..E-1 or weight 0) read nothing and give 0. Deterministic: no atomics.
Math in float32; the activation is stored in x's dtype between the projections, as the grouped kernels store it.
The same kernels read FP8 weights (SCALED: float8_e4m3fn with 128 x 128 block scales, dequantised in registers;
kernels/triton_fp8_decode.py).
"""
import torch
import triton
import triton.language as tl

from moecompile.kernels.triton_moe import (
    ACTIVATION_IDS,
    HAS_GRID_DEPENDENCY,
    _bias_activation,
    _expert_columns,
    dependent_launch,
)


def _configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((8, 256, 2, 4), (16, 256, 4, 4), (16, 128, 2, 5), (32, 128, 4, 4), (8, 128, 2, 4),
                                 (4, 256, 2, 4), (8, 512, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3))]


DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # x's dtypes these kernels take (terms: float32)


@triton.jit
def row_scales(s_ptr, rows, rmask, k_blocks: tl.constexpr, k0):
    """[len(rows)] float32: each FP8 weight row's scale_inv for the 128-channel block holding channel k0 (a K step
    lies in one block when 128 is a multiple of it)."""
    return tl.load(s_ptr + (rows // 128).to(tl.int64) * k_blocks + k0 // 128, mask=rmask, other=0.0)


@triton.jit
def weight_tile(w, s_ptr, rows, rmask, k_blocks: tl.constexpr, k0, SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """A loaded weight tile [BLOCK_N, BLOCK_K] in float32: times its rows' block scales when the weights are FP8
    (SCALED). A tile within one 128-channel block (BLOCK_K dividing 128) takes one scale per row; a wider one
    (BLOCK_K a multiple of 128) one per row and block, so that a K step can load more than 128 bytes per row."""
    w = w.to(tl.float32)
    if SCALED:
        if BLOCK_K <= 128:
            w = w * row_scales(s_ptr, rows, rmask, k_blocks, k0)[:, None]
        else:
            SUB: tl.constexpr = BLOCK_K // 128
            blocks = k0 // 128 + tl.arange(0, SUB)
            s = tl.load(s_ptr + (rows // 128).to(tl.int64)[:, None] * k_blocks + blocks[None, :],
                        mask=rmask[:, None] & (blocks < k_blocks)[None, :], other=0.0)
            w = tl.reshape(tl.reshape(w, (BLOCK_N, SUB, 128)) * s[:, :, None], (BLOCK_N, BLOCK_K))
    return w


@triton.jit
def _direct_ffn_in_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, assignments, top_k, num_experts,
                          hidden: tl.constexpr, width: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                          ACT: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PDL: tl.constexpr):
    """out[a, cols] = act(x[a // top_k] W_in[ids[a]][cols]^T + b) (gated: act(gate) * up), one program per
    (assignment a, column tile); SCALED: W_in is FP8 with scale_inv [E, ceil(rows/128), ceil(hidden/128)] at s_ptr.
    `assignments` only keys the autotuning. PDL: launched as a programmatic dependent (dependent_launch)."""
    dependent_launch(PDL)
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
            acc += weight_tile(w, s_base, cols, cmask, k_blocks, k0, SCALED, BLOCK_N, BLOCK_K) * xk
            if GATED:
                up = width + cols
                wu = tl.load(w_base + up[:, None].to(tl.int64) * hidden + ks[None, :], mask=wmask, other=0.0)
                acc_up += weight_tile(wu, s_base, up, cmask, k_blocks, k0, SCALED, BLOCK_N, BLOCK_K) * xk
        out = _bias_activation(tl.sum(acc, axis=1)[None, :], tl.sum(acc_up, axis=1)[None, :], bias_ptr, expert,
                               cols, cmask, width, HAS_BIAS, GATED, ACT)
        tl.store(out_ptr + a.to(tl.int64) * width + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=cmask[None, :])


@triton.jit
def _direct_ffn_out_kernel(a_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, assignments, num_experts,
                           hidden: tl.constexpr, width: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[a, cols] = weights[a] * (act[a] W_out[ids[a]][cols]^T + b_out[ids[a]][cols]) in float32, one program per
    (assignment a, column tile); 0 for a dropped assignment. SCALED: W_out is FP8 with scale_inv
    [E, ceil(hidden/128), ceil(width/128)] at s_ptr. `assignments` only keys the autotuning. PDL: as the first's."""
    dependent_launch(PDL)
    tiles_n: tl.constexpr = (hidden + BLOCK_N - 1) // BLOCK_N
    k_blocks: tl.constexpr = (width + 127) // 128
    a = tl.program_id(0) // tiles_n
    cols = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    expert = tl.load(ids_ptr + a)
    weight = tl.load(weights_ptr + a).to(tl.float32)
    kept = (expert >= 0) & (expert < num_experts) & (weight != 0.0)
    limit = tl.where(kept, width, 0)  # a dropped assignment reads nothing
    kept_cols = cols < tl.where(kept, hidden, 0)
    w_base = w_ptr + expert.to(tl.int64) * hidden * width
    s_base = s_ptr + expert.to(tl.int64) * ((hidden + 127) // 128) * k_blocks
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < limit
        ak = tl.load(a_ptr + a.to(tl.int64) * width + ks, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(w_base + cols[:, None].to(tl.int64) * width + ks[None, :], mask=cmask[:, None] & kmask[None, :],
                    other=0.0)
        acc += weight_tile(w, s_base, cols, kept_cols, k_blocks, k0, SCALED, BLOCK_N, BLOCK_K) * ak[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + expert.to(tl.int64) * hidden + cols, mask=kept_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + a.to(tl.int64) * hidden + cols, tl.where(kept, weight * y, 0.0), mask=cmask)


_direct_ffn_in_tuned = triton.autotune(configs=_configs(), key=["hidden", "width", "GATED", "assignments"])(
    _direct_ffn_in_kernel)
_direct_ffn_out_tuned = triton.autotune(configs=_configs(), key=["hidden", "width", "assignments"])(
    _direct_ffn_out_kernel)
KERNELS = (_direct_ffn_in_tuned, _direct_ffn_out_tuned)  # autotuned: first projection, second


def launch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_in: torch.Tensor, b_in, w_out: torch.Tensor,
           b_out, activation: str, gated: bool, config: dict | None, scales: tuple | None = None,
           tuned: tuple = KERNELS, pdl: bool = False) -> torch.Tensor:
    """Both projections' launches; the [tokens, k, hidden] float32 terms. scales: (w_in's, w_out's) scale_inv of
    FP8 weights, None for weights in x's dtype; tuned: the autotuned kernels (their configs) used without config;
    pdl: both launched as programmatic dependents (sm_90+, Triton with HAS_GRID_DEPENDENCY)."""
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
    s_in, s_out = (x, x) if scales is None else (s.float().contiguous() for s in scales)
    act = x.new_empty(assignments, width)
    pdl = pdl and HAS_GRID_DEPENDENCY  # a Triton without it launches them in stream order
    first = dict(hidden=hidden, width=width, HAS_BIAS=b_in is not None, GATED=gated, SCALED=scales is not None,
                 ACT=ACTIVATION_IDS[activation] if activation else -1, PDL=pdl, launch_pdl=pdl)
    second = dict(hidden=hidden, width=width, HAS_BIAS=b_out is not None, SCALED=scales is not None, PDL=pdl,
                  launch_pdl=pdl)
    in_args = (x, ids, w_in, s_in, b_in if b_in is not None else x, act, assignments, top_k, num_experts)
    out_args = (act, ids, weights, w_out, s_out, b_out if b_out is not None else x, terms, assignments, num_experts)
    if config is None:
        tuned[0][lambda meta: (assignments * triton.cdiv(width, meta["BLOCK_N"]),)](*in_args, **first)
        tuned[1][lambda meta: (assignments * triton.cdiv(hidden, meta["BLOCK_N"]),)](*out_args, **second)
    else:
        _direct_ffn_in_kernel[(assignments * triton.cdiv(width, config["in"]["BLOCK_N"]),)](
            *in_args, **first, **config["in"])
        _direct_ffn_out_kernel[(assignments * triton.cdiv(hidden, config["out"]["BLOCK_N"]),)](
            *out_args, **second, **config["out"])
    return terms


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_in: torch.Tensor, b_in, w_out, b_out,
                   activation: str, gated: bool, config: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """[tokens, k, hidden] float32: each assignment's expert FFN output times its routing weight. x [T, H],
    weights / ids [T, k], w_in [E, (2)F, H], w_out [E, H, F]. `config` fixes both kernels' tiles ({"in":
    {BLOCK_N, BLOCK_K[, num_warps, num_stages]}, "out": {...}}: the runtime's table, tests); otherwise each is
    autotuned per shape. pdl: as launch's."""
    return launch(x, weights, ids, w_in, b_in, w_out, b_out, activation, gated, config, pdl=pdl)
