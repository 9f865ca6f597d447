"""FP8 (float8_e4m3fn) block-scaled grouped GEMMs for the experts, DeepSeek-V3 / HF FineGrainedFP8 convention:
weights in 128×128 blocks with one float32 scale_inv each, activations per token per 128 channels
(x ≈ x_fp8 * scale_inv). Each K step of 128 multiplies its partial product by the two scales (DeepGEMM's
"promotion"), so accumulation stays float32.

first projection: act(x W_in^T + b) quantised again per token per 128 channels in the epilogue -> fp8 + scales;
second projection: a W_out^T + b in the output dtype. Runs under TRITON_INTERPRET=1 too (operands cast to
float32 there: the interpreter has no fp8 dot).
"""
import os

import torch
import triton
import triton.language as tl

from .triton_moe import ACTIVATION_IDS, _bias_activation, _expert_tile

FP8_MAX = 448.0
GROUP = 128
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


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
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, n_rows, width: tl.constexpr, BLOCK_M: tl.constexpr,
                          GROUP: tl.constexpr, EMULATE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    tl.store(q_ptr + rows[:, None].to(tl.int64) * width + cols[None, :],
             _fp8_grid(x / scale[:, None], EMULATE).to(q_ptr.dtype.element_ty), mask=mask)
    groups: tl.constexpr = (width + GROUP - 1) // GROUP
    tl.store(s_ptr + rows.to(tl.int64) * groups + tl.program_id(1), scale, mask=rows < n_rows)


def quantize_rows(x: torch.Tensor, group: int = GROUP, block_m: int = 32):
    """Per token per `group` channels: (x_fp8, scale_inv [N, ceil(H/group)] float32)."""
    x = x.contiguous()
    n_rows, width = x.shape
    q = torch.empty(n_rows, width, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(n_rows, triton.cdiv(width, group), dtype=torch.float32, device=x.device)
    if n_rows:
        _quantize_rows_kernel[(triton.cdiv(n_rows, block_m), triton.cdiv(width, group))](
            x, q, s, n_rows, width=width, BLOCK_M=block_m, GROUP=group, EMULATE=_INTERPRET)
    return q, s


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
        out = _bias_activation(acc, acc_up, bias_ptr, expert, cols, cmask, width, HAS_BIAS, GATED, ACT)
        out_rows = rows[:, None].to(tl.int64) * width + cols[None, :]
        if QUANT_OUT:  # one 128-channel group per row of this tile: quantise for the next GEMM
            scale = tl.maximum(tl.max(tl.abs(out), axis=1), 1e-12) / 448.0
            tl.store(out_ptr + out_rows, _fp8_grid(out / scale[:, None], CAST_FP32).to(out_ptr.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])
            tl.store(out_scale_ptr + rows.to(tl.int64) * tiles_n + pid_n, scale, mask=rmask)
        else:
            tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


_grouped_fp8_tuned = triton.autotune(configs=_fp8_configs(),
                                     key=["rows_bucket", "K", "width", "num_experts", "GATED", "QUANT_OUT"])(
    _grouped_fp8_kernel)


def supported(hidden: int, width: int) -> bool:
    return hidden % GROUP == 0 and width % GROUP == 0


def _launch(a, a_scale, w, w_scale, bias, offsets, out, out_scale, activation, gated, quant_out, config):
    n_rows, k = a.shape
    num_experts = w.shape[0]
    width = out.shape[1]

    def grid(meta):
        return ((triton.cdiv(n_rows, meta["BLOCK_M"]) + num_experts) * triton.cdiv(width, 128),)

    kernel = _grouped_fp8_kernel if config is not None or _INTERPRET else _grouped_fp8_tuned
    extra = config or ({"BLOCK_M": 16, "GROUP_M": 2} if _INTERPRET else {})
    kernel[grid](a, a_scale, w, w_scale, bias if bias is not None else a_scale, offsets, out,
                 out_scale if out_scale is not None else a_scale, n_rows, num_experts, triton.next_power_of_2(n_rows),
                 K=k, width=width, HAS_BIAS=bias is not None, GATED=gated,
                 ACT=ACTIVATION_IDS[activation] if activation else -1, QUANT_OUT=quant_out, CAST_FP32=_INTERPRET,
                 E_PAD=triton.next_power_of_2(num_experts), **extra)


def experts_fp8(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                activation: str, gated: bool, out_dtype: torch.dtype, config: dict | None = None):
    """Grouped FP8 FFN over rows in expert order; rows past offsets[-1] unspecified."""
    n_rows, hidden = x_fp8.shape
    num_experts, in_width, _ = w_in.shape
    width = in_width // 2 if gated else in_width
    y = torch.empty(n_rows, hidden, dtype=out_dtype, device=x_fp8.device)
    if n_rows == 0:
        return y
    a = torch.empty(n_rows, width, dtype=torch.float8_e4m3fn, device=x_fp8.device)
    a_scale = torch.empty(n_rows, width // GROUP, dtype=torch.float32, device=x_fp8.device)
    _launch(x_fp8.contiguous(), x_scale_inv.contiguous(), w_in.contiguous(), w_in_scale_inv.contiguous(), b_in,
            offsets, a, a_scale, activation, gated, True, config)
    _launch(a, a_scale, w_out.contiguous(), w_out_scale_inv.contiguous(), b_out, offsets, y, None, None, False,
            False, config)
    return y
