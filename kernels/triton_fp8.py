"""FP8 (float8_e4m3fn) grouped GEMMs for the experts, two scalings:

- block (DeepSeek-V3 / HF FineGrainedFP8 convention, the checkpoint's): weights in 128×128 blocks with one float32
  scale_inv each, activations per token per 128 channels (x ≈ x_fp8 * scale_inv). Each K step of 128 multiplies its
  partial product by the two scales (DeepGEMM's "promotion"), so accumulation stays float32. Pointer loads.
- rowwise: activations with one scale per row, weights one per output channel (converted from the blocks,
  moecompile/core/fp8_format.py's rowwise_from_blocks), so the K loop only accumulates and the scales come after it:
  no wgmma wait per K step. Persistent kernel with TMA loads (Hopper).

first projection: act(x W_in^T + b) quantised again per token per 128 channels in the epilogue -> fp8 + scales
(rowwise: then requantised per row); second projection: a W_out^T + b in the output dtype. Runs under
TRITON_INTERPRET=1 too (operands cast to float32 there: the interpreter has no fp8 dot).
"""
import torch
import triton
import triton.language as tl

from moecompile.core import settings
from moecompile.kernels.triton_moe import (
    ACTIVATION_IDS,
    _activation,
    _bias_activation,
    _expert_tile,
    _num_sms,
    _row_expert,
    _tile_at,
    _tile_table,
    _tma_scratch,
    _tma_weight_desc,
)

FP8_MAX = 448.0
GROUP = 128
_INTERPRET = settings.triton_interpret()  # the interpreter has no fp8 dot and mis-rounds some casts


@triton.jit
def _fp8_grid(x, EMULATE: tl.constexpr):
    """Round to the e4m3 grid before the cast when interpreting: Triton's interpreter mis-rounds casts that carry
    into the next power of two (124.3 -> 64); hardware casts round to nearest and need nothing."""
    if EMULATE:
        mag = tl.maximum(tl.abs(x), 1e-30)
        step = tl.exp2(tl.maximum(tl.floor(tl.log2(mag)), -6.0) - 3.0)
        x = tl.floor(x / step + 0.5) * step
    return x


@triton.jit
def _quantize_rows_kernel(h_ptr, bias_ptr, offsets_ptr, q_ptr, s_ptr, n_rows, num_experts, width: tl.constexpr,
                          HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                          GROUP: tl.constexpr, E_PAD: tl.constexpr, EMULATE: tl.constexpr):
    """Per row per GROUP channels: q = out / scale in e4m3 and scale = amax / 448, of out = h (ACT -1, ungated) or
    act(h + bias of the row's expert), gated act(gate) * up (h: [rows, gate | up])."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    in_width: tl.constexpr = 2 * width if GATED else width
    h_row = h_ptr + rows[:, None].to(tl.int64) * in_width
    x = tl.load(h_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(h_row + width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_row = bias_ptr + _row_expert(rows, offsets_ptr, num_experts, E_PAD)[:, None].to(tl.int64) * in_width
        x += tl.load(b_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATED:
            up += tl.load(b_row + width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = x
    if ACT >= 0:
        out = _activation(x, ACT)
    if GATED:
        out = out * up
    scale = tl.maximum(tl.max(tl.abs(out), axis=1), 1e-12) / 448.0
    tl.store(q_ptr + rows[:, None].to(tl.int64) * width + cols[None, :],
             _fp8_grid(out / scale[:, None], EMULATE).to(q_ptr.dtype.element_ty), mask=mask)
    groups: tl.constexpr = (width + GROUP - 1) // GROUP
    tl.store(s_ptr + rows.to(tl.int64) * groups + tl.program_id(1), scale, mask=rows < n_rows)


def quantize_rows(x: torch.Tensor, group: int = GROUP, block_m: int = 32):
    """Per token per `group` channels: (x_fp8, scale_inv [N, ceil(H/group)] float32)."""
    return activation_quantize(x, None, None, None, False, group, block_m)


def activation_quantize(h: torch.Tensor, offsets, bias, activation: str | None, gated: bool, group: int = GROUP,
                        block_m: int = 32):
    """act(h + b_in[expert of the row]) (gated: act(gate) * up) quantised per row per `group` channels:
    (q [N, width] e4m3, scale_inv [N, width/group]), the input of a block-scaled second projection.
    h: the first projection's output [N, (2 x) width], rows in expert order (offsets: cumulative group ends)."""
    n_rows, in_width = h.shape
    width = in_width // 2 if gated else in_width
    q = torch.empty(n_rows, width, dtype=torch.float8_e4m3fn, device=h.device)
    s = torch.empty(n_rows, triton.cdiv(width, group), dtype=torch.float32, device=h.device)
    num_experts = offsets.shape[0] if bias is not None else 1
    if n_rows:
        _quantize_rows_kernel[(triton.cdiv(n_rows, block_m), triton.cdiv(width, group))](
            h.contiguous(), bias if bias is not None else h, offsets if bias is not None else h, q, s, n_rows,
            num_experts, width=width, HAS_BIAS=bias is not None, GATED=gated,
            ACT=ACTIVATION_IDS[activation] if activation else -1, BLOCK_M=block_m, GROUP=group,
            E_PAD=triton.next_power_of_2(num_experts), EMULATE=_INTERPRET)
    return q, s


@triton.jit
def _fp8_epilogue(acc, acc_up, bias_ptr, out_ptr, out_scale_ptr, expert, rows, rmask, pid_n, width: tl.constexpr,
                  HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, QUANT_OUT: tl.constexpr,
                  EMULATE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bias + activation, then the store: in the output dtype, or (QUANT_OUT) quantised again per row of the tile
    (one 128-channel group) for the next GEMM."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < width
    out = _bias_activation(acc, acc_up, bias_ptr, expert, cols, cmask, width, HAS_BIAS, GATED, ACT)
    out_rows = rows[:, None].to(tl.int64) * width + cols[None, :]
    if QUANT_OUT:
        tiles_n: tl.constexpr = (width + BLOCK_N - 1) // BLOCK_N
        scale = tl.maximum(tl.max(tl.abs(out), axis=1), 1e-12) / 448.0
        tl.store(out_ptr + out_rows, _fp8_grid(out / scale[:, None], EMULATE).to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])
        tl.store(out_scale_ptr + rows.to(tl.int64) * tiles_n + pid_n, scale, mask=rmask)
    else:
        tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def _fp8_configs():
    return [triton.Config({"BLOCK_M": bm, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, w, s in ((128, 8, 3), (64, 4, 4), (128, 4, 4), (64, 8, 3))]


@triton.jit
def _grouped_fp8_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, offsets_ptr, out_ptr, out_scale_ptr,
                        n_rows, num_experts, rows_bucket, K: tl.constexpr, width: tl.constexpr,
                        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, QUANT_OUT: tl.constexpr,
                        CAST_FP32: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                        GROUP_M: tl.constexpr):
    BLOCK_N: tl.constexpr = 128
    BLOCK_K: tl.constexpr = 128
    live, expert, rows, rmask, pid_n = _expert_tile(offsets_ptr, n_rows, num_experts, width, E_PAD, BLOCK_M,
                                                    BLOCK_N, GROUP_M)
    tiles_n: tl.constexpr = (width + BLOCK_N - 1) // BLOCK_N
    if live:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < width
        in_width: tl.constexpr = 2 * width if GATED else width
        k_blocks: tl.constexpr = K // BLOCK_K
        n_blocks: tl.constexpr = in_width // BLOCK_N
        w_base = w_ptr + expert.to(tl.int64) * in_width * K
        ws_base = w_scale_ptr + expert.to(tl.int64) * n_blocks * k_blocks
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(k_blocks):
            ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=rmask[:, None], other=0.0)
            a_s = tl.load(a_scale_ptr + rows.to(tl.int64) * k_blocks + kb, mask=rmask, other=0.0)
            b = tl.load(w_base + cols[None, :].to(tl.int64) * K + ks[:, None], mask=cmask[None, :], other=0.0)
            b_s = tl.load(ws_base + pid_n * k_blocks + kb)
            if CAST_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s)
            if GATED:
                bu = tl.load(w_base + (width + cols[None, :]).to(tl.int64) * K + ks[:, None], mask=cmask[None, :],
                             other=0.0)
                bu_s = tl.load(ws_base + (tiles_n + pid_n) * k_blocks + kb)
                if CAST_FP32:
                    bu = bu.to(tl.float32)
                acc_up += tl.dot(a, bu) * (a_s[:, None] * bu_s)
        _fp8_epilogue(acc, acc_up, bias_ptr, out_ptr, out_scale_ptr, expert, rows, rmask, pid_n, width, HAS_BIAS,
                      GATED, ACT, QUANT_OUT, CAST_FP32, BLOCK_N)


_grouped_fp8_tuned = triton.autotune(configs=_fp8_configs(),
                                     key=["rows_bucket", "K", "width", "num_experts", "GATED", "QUANT_OUT"])(
    _grouped_fp8_kernel)


@triton.jit
def _requantize_rows_kernel(q_ptr, s_ptr, out_ptr, out_s_ptr, n_rows, width: tl.constexpr, BLOCK_M: tl.constexpr,
                            G_PAD: tl.constexpr, EMULATE: tl.constexpr):
    """fp8 rows with a scale per 128 channels -> the same rows with one scale per row (the largest of the row's):
    each group's values times its scale over the row's, rounded again."""
    GROUP_W: tl.constexpr = 128
    groups: tl.constexpr = width // GROUP_W
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    g = tl.arange(0, G_PAD)
    s_rows = s_ptr + rows.to(tl.int64) * groups
    row_scale = tl.max(tl.load(s_rows[:, None] + g[None, :], mask=rmask[:, None] & (g < groups)[None, :],
                               other=0.0), axis=1)
    tl.store(out_s_ptr + rows, row_scale, mask=rmask)
    ratio_base = tl.where(rmask, 1.0 / tl.maximum(row_scale, 1e-30), 0.0)
    cols = tl.arange(0, GROUP_W)
    for gi in range(groups):
        offs = rows[:, None].to(tl.int64) * width + gi * GROUP_W + cols[None, :]
        q = tl.load(q_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
        ratio = tl.load(s_rows + gi, mask=rmask, other=0.0) * ratio_base
        tl.store(out_ptr + offs, _fp8_grid(q * ratio[:, None], EMULATE).to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None])


def requantize_rows(q: torch.Tensor, scale_inv: torch.Tensor, block_m: int = 16):
    """(x_fp8 [N, H], scale_inv [N, H/128]) -> (x_fp8 [N, H], scale_inv [N]): one scale per row."""
    n_rows, width = q.shape
    out = torch.empty_like(q)
    out_s = torch.empty(n_rows, dtype=torch.float32, device=q.device)
    if n_rows:
        _requantize_rows_kernel[(triton.cdiv(n_rows, block_m),)](
            q, scale_inv.contiguous(), out, out_s, n_rows, width=width, BLOCK_M=block_m,
            G_PAD=triton.next_power_of_2(width // GROUP), EMULATE=_INTERPRET)
    return out, out_s


@triton.jit
def _fp8_rowwise_tile(a_desc, w_desc, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, out_scale_ptr, expert, rows,
                      rmask, pid_n, K: tl.constexpr, width: tl.constexpr, HAS_BIAS: tl.constexpr,
                      GATED: tl.constexpr, ACT: tl.constexpr, QUANT_OUT: tl.constexpr, CAST_FP32: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """One output tile from TMA-loaded operands with a scale per row of A and per output channel of W: the K loop
    only accumulates (no per-block promotion, which costs a wgmma wait per K step), the scales come after it.
    Gated: gate and up rows of the same 128 outputs interleaved in one box and one dot (_tma_weight_desc). Rows of
    the tile past this expert's group are computed and not stored."""
    BLOCK_N: tl.constexpr = 128
    BLOCK_K: tl.constexpr = 128
    row0 = tl.min(rows, axis=0)
    in_width: tl.constexpr = 2 * width if GATED else width
    w_scales = w_scale_ptr + expert.to(tl.int64) * in_width
    a_s = tl.load(a_scale_ptr + rows, mask=rmask, other=0.0)
    if GATED:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([row0, k0])
            w = w_desc.load([expert, pid_n * BLOCK_N, 0, k0]).reshape(2 * BLOCK_N, BLOCK_K)
            if CAST_FP32:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w.T, acc)
        j = tl.arange(0, 2 * BLOCK_N)  # column j: output j // 2, of the gate (even) or up (odd) projection
        w_s = tl.load(w_scales + (j % 2) * width + pid_n * BLOCK_N + j // 2)
        gate, up = tl.split((acc * a_s[:, None] * w_s[None, :]).reshape(BLOCK_M, BLOCK_N, 2))
    else:
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([row0, k0])
            w = w_desc.load([expert * width + pid_n * BLOCK_N, k0])
            if CAST_FP32:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            gate = tl.dot(a, w.T, gate)
        gate = gate * a_s[:, None] * tl.load(w_scales + pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
        up = gate  # unused
    _fp8_epilogue(gate, up, bias_ptr, out_ptr, out_scale_ptr, expert, rows, rmask, pid_n, width, HAS_BIAS, GATED, ACT,
                  QUANT_OUT, CAST_FP32, BLOCK_N)


@triton.jit
def _grouped_fp8_rowwise_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, offsets_ptr, out_ptr,
                                out_scale_ptr, n_rows, num_experts, rows_bucket, K: tl.constexpr, width: tl.constexpr,
                                HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                                QUANT_OUT: tl.constexpr, CAST_FP32: tl.constexpr, E_PAD: tl.constexpr,
                                BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    """Grouped FP8 GEMM, A [n_rows, K] with a scale per row, W [E, N, K] with a scale per output channel, as a
    persistent kernel (one program per SM walks the live tiles; triton_moe's bf16 persistent kernel)."""
    BLOCK_N: tl.constexpr = 128
    BLOCK_K: tl.constexpr = 128
    tile_ends, begins, ends, tiles_m = _tile_table(offsets_ptr, num_experts, E_PAD, BLOCK_M)
    tiles_n: tl.constexpr = width // BLOCK_N
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[n_rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = _tma_weight_desc(w_ptr, num_experts, K, width, GATED, BLOCK_N, BLOCK_K)
    if CAST_FP32:  # the interpreter: its ranges take no device scalars, its while loops do
        tile = tl.program_id(0)
        while tile < tiles_m * tiles_n:
            _, expert, rows, rmask, pid_n = _tile_at(tile, tile_ends, begins, ends, tiles_m, width, E_PAD, BLOCK_M,
                                                     BLOCK_N, GROUP_M)
            _fp8_rowwise_tile(a_desc, w_desc, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, out_scale_ptr, expert,
                              rows, rmask, pid_n, K, width, HAS_BIAS, GATED, ACT, QUANT_OUT, CAST_FP32, BLOCK_M)
            tile += NUM_SMS
    else:
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS, flatten=True):
            _, expert, rows, rmask, pid_n = _tile_at(tile, tile_ends, begins, ends, tiles_m, width, E_PAD, BLOCK_M,
                                                     BLOCK_N, GROUP_M)
            _fp8_rowwise_tile(a_desc, w_desc, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, out_scale_ptr, expert,
                              rows, rmask, pid_n, K, width, HAS_BIAS, GATED, ACT, QUANT_OUT, CAST_FP32, BLOCK_M)


def _fp8_rowwise_configs():
    # the candidates: the winners per projection on the device (BLOCK_M 128, 8 warps; 4 warps for the second) and
    # their neighbours
    return [triton.Config({"BLOCK_M": bm, "GROUP_M": gm}, num_warps=w, num_stages=s)
            for bm, gm, w, s in ((128, 8, 8, 4), (128, 8, 8, 3), (128, 16, 8, 4), (128, 8, 4, 4), (64, 8, 4, 3))]


def _prune_rowwise_configs(configs, named_args, **kwargs):
    """Gated first projections accumulate a 128 x 256 tile: with 4 warps it spills registers, not worth timing."""
    if not kwargs.get("GATED", named_args.get("GATED")):
        return configs
    return [c for c in configs if not (c.kwargs["BLOCK_M"] == 128 and c.num_warps == 4)]


_grouped_fp8_rowwise_tuned = triton.autotune(configs=_fp8_rowwise_configs(),
                                             key=["rows_bucket", "K", "width", "num_experts", "GATED", "QUANT_OUT"],
                                             prune_configs_by={"early_config_prune": _prune_rowwise_configs})(
    _grouped_fp8_rowwise_kernel)


def supported(hidden: int, width: int) -> bool:
    return hidden % GROUP == 0 and width % GROUP == 0


# The grouped FP8 GEMM kernels by name: (fixed-tile kernel, autotuned kernel, persistent with TMA loads).
# "triton": block scales (A 1x128, W 128x128) promoted every K step, pointer loads; "rowwise": A per row, W per
# output channel, scales after the K loop, TMA loads.
GROUPED_GEMMS = {"triton": (_grouped_fp8_kernel, _grouped_fp8_tuned, False),
                 "rowwise": (_grouped_fp8_rowwise_kernel, _grouped_fp8_rowwise_tuned, True)}


def _launch(a, a_scale, w, w_scale, bias, offsets, out, out_scale, activation, gated, quant_out, config, variant):
    n_rows, k = a.shape
    num_experts = w.shape[0]
    width = out.shape[1]
    fixed, tuned, persistent = GROUPED_GEMMS[variant]
    extra = dict(NUM_SMS=_num_sms(a.device)) if persistent else {}

    def grid(meta):
        if persistent:
            return (meta["NUM_SMS"],)
        return ((triton.cdiv(n_rows, meta["BLOCK_M"]) + num_experts) * triton.cdiv(width, 128),)

    if persistent:
        triton.set_allocator(_tma_scratch)  # descriptors built on the device need a little global scratch
    kernel = fixed if config is not None or _INTERPRET else tuned
    extra.update(config or ({"BLOCK_M": 16, "GROUP_M": 2} if _INTERPRET else {}))
    kernel[grid](a, a_scale, w, w_scale, bias if bias is not None else a_scale, offsets, out,
                 out_scale if out_scale is not None else a_scale, n_rows, num_experts, triton.next_power_of_2(n_rows),
                 K=k, width=width, HAS_BIAS=bias is not None, GATED=gated,
                 ACT=ACTIVATION_IDS[activation] if activation else -1, QUANT_OUT=quant_out, CAST_FP32=_INTERPRET,
                 E_PAD=triton.next_power_of_2(num_experts), **extra)


def _ffn(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out, activation,
         gated, out_dtype, config, variant):
    n_rows, hidden = x_fp8.shape
    num_experts, in_width, _ = w_in.shape
    width = in_width // 2 if gated else in_width
    y = torch.empty(n_rows, hidden, dtype=out_dtype, device=x_fp8.device)
    if n_rows == 0:
        return y
    a = torch.empty(n_rows, width, dtype=torch.float8_e4m3fn, device=x_fp8.device)
    a_scale = torch.empty(n_rows, width // GROUP, dtype=torch.float32, device=x_fp8.device)
    _launch(x_fp8.contiguous(), x_scale_inv.contiguous(), w_in.contiguous(), w_in_scale_inv.contiguous(), b_in,
            offsets, a, a_scale, activation, gated, True, config, variant)
    if variant == "rowwise":
        a, a_scale = requantize_rows(a, a_scale)
    _launch(a, a_scale, w_out.contiguous(), w_out_scale_inv.contiguous(), b_out, offsets, y, None, None, False,
            False, config, variant)
    return y


def experts_fp8(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                activation: str, gated: bool, out_dtype: torch.dtype, config: dict | None = None):
    """Grouped FP8 FFN over rows in expert order, block-scaled operands (x 1x128, weights 128x128); rows past
    offsets[-1] unspecified. `config` fixes the tiles (BLOCK_M, GROUP_M, num_warps, num_stages), else autotuned."""
    return _ffn(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out, activation,
                gated, out_dtype, config, "triton")


def experts_fp8_rowwise(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                        activation: str, gated: bool, out_dtype: torch.dtype, config: dict | None = None):
    """experts_fp8 with a scale per row of x (x_scale_inv [N]) and per output channel of the weights
    (w_in_scale_inv [E, F], w_out_scale_inv [E, H]). The first projection's activations leave its epilogue in
    1x128 groups (a tile's row is one group) and are requantised per row for the second."""
    return _ffn(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out, activation,
                gated, out_dtype, config, "rowwise")
