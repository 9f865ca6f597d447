"""GPU kernels for the experts and combine ops: torch._grouped_mm for the expert GEMMs (CUTLASS on sm90), Triton
for the fused bias + activation and the weighted combine. No host synchronisation: CUDA-graph capturable.

Rows of `experts`' output at or past offsets[-1] (dropped assignments) are left unspecified here; combine never
reads them. Shapes grouped_mm cannot take (non-bf16, unaligned, pre-Hopper, empty) go to the reference kernels.
"""
import os

import torch

from . import reference, triton_fp8, triton_moe

# First projection: "triton" = one Triton grouped GEMM with bias + activation in its epilogue; "grouped_mm" =
# torch._grouped_mm (CUTLASS) then the Triton activation pass; "auto" picks per shape from the measurements below.
FFN_IN = os.environ.get("MOECOMPILE_FFN_IN", "auto")
# (hidden, expert_size, experts) -> faster first projection on an H200, from bench/results/gpu-moe-layer.md.
# The fused kernel wins where the hidden size is large (long K loop, the activation pass then costs most);
# unmeasured shapes use grouped_mm.
MEASURED_FFN_IN = {(7168, 2048, 256): "triton", (768, 3072, 16): "triton", (4096, 14336, 8): "grouped_mm",
                   (2048, 768, 128): "grouped_mm"}


def _ffn_in_variant(hidden: int, expert_size: int, num_experts: int) -> str:
    if FFN_IN != "auto":
        return FFN_IN
    return MEASURED_FFN_IN.get((hidden, expert_size, num_experts), "grouped_mm")


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and x.shape[0] > 0):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    tensors = (x, *weights)
    return all(t.dtype == torch.bfloat16 for t in tensors) and all(s % 8 == 0 for t in tensors for s in t.shape[-2:])


def _grouped(a, b, offsets):
    return torch._grouped_mm(a, b, offs=offsets)


def _row_expert(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Expert of each sorted row; rows past the last group get len(offsets) (dropped)."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)


def experts(x, offsets, w_in, b_in, w_out, b_out, activation: str, gated: bool):
    if not grouped_mm_supported(x, w_in, w_out):
        return reference.experts(x, offsets, w_in, b_in, w_out, b_out, activation, gated)
    if _ffn_in_variant(x.shape[1], w_out.shape[2], w_out.shape[0]) == "triton":
        a = triton_moe.grouped_ffn_in(x, offsets, w_in, b_in, activation, gated)
    else:
        h = _grouped(x, w_in.transpose(-2, -1), offsets)
        a = triton_moe.expert_activation(h, offsets, b_in, activation, gated)
    y = _grouped(a, w_out.transpose(-2, -1), offsets)
    if b_out is not None:
        rows = _row_expert(offsets, y.shape[0]).clamp_max(w_out.shape[0] - 1)
        y += b_out.index_select(0, rows)
    return y


def _segment_sum(values: torch.Tensor, offsets: torch.Tensor, num_experts: int) -> torch.Tensor:
    rows = _row_expert(offsets, values.shape[0])
    sums = values.new_zeros(num_experts + 1, values.shape[1], dtype=torch.float32)
    return sums.index_add_(0, rows, values.float())[:num_experts].to(values.dtype)


def experts_backward(grad_y, x, offsets, w_in, b_in, w_out, activation: str, gated: bool, has_b_out: bool):
    if not grouped_mm_supported(x, w_in, w_out):
        return reference.experts_backward(grad_y, x, offsets, w_in, b_in, w_out, activation, gated, has_b_out)
    num_experts, n_rows = w_in.shape[0], x.shape[0]
    h = _grouped(x, w_in.transpose(-2, -1), offsets)  # recomputed rather than kept from the forward
    grad_a = _grouped(grad_y, w_out, offsets)
    a, grad_h = triton_moe.expert_activation_backward(h, offsets, b_in, grad_a, activation, gated)
    grad_w_out = _grouped(grad_y.t(), a, offsets)
    grad_w_in = _grouped(grad_h.t(), x, offsets)
    dropped = (torch.arange(n_rows, device=x.device) >= offsets[-1]).unsqueeze(1)
    grad_x = _grouped(grad_h, w_in, offsets).masked_fill_(dropped, 0)
    grad_b_in = _segment_sum(grad_h, offsets, num_experts) if b_in is not None else None
    grad_b_out = _segment_sum(grad_y, offsets, num_experts) if has_b_out else None
    return grad_x, grad_w_in, grad_b_in, grad_w_out, grad_b_out


def combine(expert_out, order, weights):
    return triton_moe.combine(expert_out, order, weights)


def combine_backward(grad_out, expert_out, order, weights):
    return triton_moe.combine_backward(grad_out, expert_out, order, weights)


def dispatch_backward(grad_sorted, order, tokens: int, top_k: int):
    return triton_moe.gather_sum(grad_sorted, order, tokens, top_k)


def _fp8_gemm_supported(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)  # fp8 tensor cores: Ada, Hopper


def quantize_fp8(x, group: int):
    if not (_fp8_gemm_supported(x) and group == triton_fp8.GROUP and x.shape[1] % group == 0):
        return reference.quantize_fp8(x, group)
    return triton_fp8.quantize_rows(x, group)


def experts_fp8(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                activation: str, gated: bool, out_dtype: torch.dtype):
    args = (x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out, activation,
            gated, out_dtype)
    if not (_fp8_gemm_supported(x_fp8) and triton_fp8.supported(x_fp8.shape[1], w_out.shape[2])
            and activation in triton_moe.ACTIVATION_IDS):
        return reference.experts_fp8(*args)
    return triton_fp8.experts_fp8(*args)
