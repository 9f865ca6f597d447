"""GPU kernels for the moecompile ops: Triton top-k routing and counting-sort dispatch, the expert GEMMs as Triton
grouped GEMMs (TMA loads, bias + activation in the epilogue) or torch._grouped_mm (CUTLASS on sm90), whichever
measured faster for the shape, and the Triton weighted combine. No host synchronisation: CUDA-graph capturable.

Rows of `experts`' output at or past offsets[-1] (dropped assignments) are left unspecified here; combine never
reads them. Shapes grouped_mm cannot take (non-bf16, unaligned, pre-Hopper, empty) go to the reference kernels.
"""
import logging
import os
import weakref

import torch
from triton.compiler.errors import CompilationError

from moecompile.ir import fp8_format as fp8_math
from moecompile.kernels import reference, triton_fp8, triton_moe, triton_routing

# Expert GEMM kernels per projection: "triton_tma" / "triton" = a Triton grouped GEMM with bias (+ activation, first
# projection) in its epilogue, operands loaded by TMA (Hopper) or by pointers; "triton_persistent" = the TMA one as a
# persistent kernel (one program per SM, epilogue overlapped with the next tile); "grouped_mm" = torch._grouped_mm
# (CUTLASS), after the first projection a one-pass Triton activation. "auto" takes the measured choice below.
FFN_IN = os.environ.get("MOECOMPILE_FFN_IN", "auto")
FFN_OUT = os.environ.get("MOECOMPILE_FFN_OUT", "auto")
# (hidden, expert_size, experts, regime) -> (first, second projection): the fastest pair on an H200 in
# bench/results/gpu-moe-layer.md, or per projection in gpu-expert-gemms.md / gpu-expert-gemms-more.md (OLMoE,
# Qwen2-MoE) (regime "decode": under 64 rows per expert). The persistent pair won or tied every batch shape
# measured (six), so it is also the default for unmeasured batch shapes; unmeasured decode shapes use grouped_mm.
MEASURED = {(768, 3072, 16, "batch"): ("triton_persistent", "triton_persistent"),
            (4096, 14336, 8, "batch"): ("triton_persistent", "triton_persistent"),
            (4096, 14336, 8, "decode"): ("triton_tma", "triton_tma"),
            (2048, 768, 128, "batch"): ("triton_persistent", "triton_persistent"),
            (7168, 2048, 256, "batch"): ("triton_persistent", "triton_persistent"),
            (2048, 1024, 64, "batch"): ("triton_persistent", "triton_persistent"),
            (2048, 1408, 60, "batch"): ("triton_persistent", "triton_persistent")}
UNMEASURED = {"batch": ("triton_persistent", "triton_persistent"), "decode": ("grouped_mm", "grouped_mm")}
DECODE_ROWS_PER_EXPERT = 64


def _variants(rows: int, hidden: int, expert_size: int, num_experts: int) -> tuple[str, str]:
    regime = "decode" if rows < DECODE_ROWS_PER_EXPERT * num_experts else "batch"
    first, second = MEASURED.get((hidden, expert_size, num_experts, regime), UNMEASURED[regime])
    return (first if FFN_IN == "auto" else FFN_IN), (second if FFN_OUT == "auto" else FFN_OUT)


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


def _routable(router_logits: torch.Tensor) -> bool:
    return router_logits.is_cuda and router_logits.shape[-1] <= triton_routing.MAX_EXPERTS


def route(router_logits, top_k: int, capacity_factor: float, renormalize: bool):
    if not _routable(router_logits):
        return reference.route(router_logits, top_k, capacity_factor, renormalize)
    weights, ids = triton_routing.topk(router_logits, top_k, renormalize)
    return reference.drop_over_capacity(weights, ids, capacity_factor, router_logits.shape[-1])


def route_grouped(router_logits, top_k: int, capacity_factor: float, renormalize: bool, scoring: str,
                  correction_bias, n_group: int, topk_group: int, scaling_factor: float):
    if n_group > 1 or not _routable(router_logits):  # group-limited selection: the reference kernel
        return reference.route_grouped(router_logits, top_k, capacity_factor, renormalize, scoring, correction_bias,
                                       n_group, topk_group, scaling_factor)
    weights, ids = triton_routing.topk(router_logits, top_k, renormalize, scoring, correction_bias, scaling_factor)
    return reference.drop_over_capacity(weights, ids, capacity_factor, router_logits.shape[-1])


def dispatch(hidden, expert_ids, num_experts: int):
    if not hidden.is_cuda:
        return reference.dispatch(hidden, expert_ids, num_experts)
    return triton_routing.dispatch(hidden, expert_ids, num_experts)


def route_dispatch(hidden, router_weight, router_bias, top_k: int, capacity_factor: float, renormalize: bool,
                   scoring: str, correction_bias, n_group: int, topk_group: int, scaling_factor: float,
                   logits_fp32: bool):
    logits = reference.router_logits(hidden, router_weight, router_bias, logits_fp32)
    weights, ids = route_grouped(logits, top_k, capacity_factor, renormalize, scoring, correction_bias, n_group,
                                 topk_group, scaling_factor)
    return (weights, ids, *dispatch(hidden, ids, router_weight.shape[0]))


def _projection_kernels(x, w_in, w_out) -> tuple[str, str]:
    first, second = _variants(x.shape[0], x.shape[1], w_out.shape[2], w_out.shape[0])
    if not triton_moe.tma_supported(x, w_in):  # unaligned rows: the pointer-load kernel
        first, second = ("triton" if v.startswith("triton") else v for v in (first, second))
    return first, second


def _second_projection(a, offsets, w_out, b_out, kernel: str):
    if kernel.startswith("triton"):
        return triton_moe.grouped_ffn_in(a, offsets, w_out, b_out, None, False, variant=kernel)
    y = _grouped(a, w_out.transpose(-2, -1), offsets)
    if b_out is not None:
        _add_expert_bias(y, offsets, b_out)
    return y


def _grouped_mm_first_projection(x, offsets, w_in, b_in, activation: str, gated: bool):
    """(a, h): h = x W_in^T on torch._grouped_mm, then a = act(h + b_in) in one Triton pass."""
    h = _grouped(x, w_in.transpose(-2, -1), offsets)
    return triton_moe.expert_activation(h, offsets, b_in, activation, gated), h


def experts(x, offsets, w_in, b_in, w_out, b_out, activation: str, gated: bool):
    if not grouped_mm_supported(x, w_in, w_out):
        return reference.experts(x, offsets, w_in, b_in, w_out, b_out, activation, gated)
    first, second = _projection_kernels(x, w_in, w_out)
    if first.startswith("triton"):
        a = triton_moe.grouped_ffn_in(x, offsets, w_in, b_in, activation, gated, variant=first)
    else:
        a, _ = _grouped_mm_first_projection(x, offsets, w_in, b_in, activation, gated)
    return _second_projection(a, offsets, w_out, b_out, second)


def experts_train(x, offsets, w_in, b_in, w_out, b_out, activation: str, gated: bool):
    """(experts(...), h): the first projection on torch._grouped_mm, its output h kept for experts_backward; the
    activation in one Triton pass; the second projection as experts() runs it."""
    if not grouped_mm_supported(x, w_in, w_out):
        return reference.experts_train(x, offsets, w_in, b_in, w_out, b_out, activation, gated)
    a, h = _grouped_mm_first_projection(x, offsets, w_in, b_in, activation, gated)
    return _second_projection(a, offsets, w_out, b_out, _projection_kernels(x, w_in, w_out)[1]), h


def _add_expert_bias(y: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor) -> None:
    """y[r] += bias[expert of row r], in place (rows past the groups get the last expert's: unspecified anyway)."""
    y += bias.index_select(0, _row_expert(offsets, y.shape[0]).clamp_max(bias.shape[0] - 1))


def _segment_sum(values: torch.Tensor, offsets: torch.Tensor, num_experts: int) -> torch.Tensor:
    rows = _row_expert(offsets, values.shape[0])
    sums = values.new_zeros(num_experts + 1, values.shape[1], dtype=torch.float32)
    return sums.index_add_(0, rows, values.float())[:num_experts].to(values.dtype)


def experts_backward(grad_y, x, offsets, w_in, b_in, w_out, activation: str, gated: bool, has_b_out: bool, h=None):
    if not grouped_mm_supported(x, w_in, w_out):
        return reference.experts_backward(grad_y, x, offsets, w_in, b_in, w_out, activation, gated, has_b_out, h=h)
    num_experts, n_rows = w_in.shape[0], x.shape[0]
    if h is None:  # experts() kept nothing: recompute the first projection
        h = _grouped(x, w_in.transpose(-2, -1), offsets)
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


# FP8 expert GEMMs: "rowwise" = per-row activation and per-channel weight scales applied after the K loop (the
# weights converted from their 128x128 blocks once, _rowwise_weights), "block" = the block scales promoted every K
# step. On an H200 rowwise ran the expert FFN 1.31x (Mixtral) / 1.32x (DeepSeek-V3) faster than block at 4096 tokens
# (bench/results/gpu-fp8-gemm.md), for a second rounding of weights and activations (error vs bf16 9.1e-2 instead of
# 6.3e-2 on random layers; per layer on MiniLM up to 4.2e-2 instead of 2.9e-2, tests/test_fp8.py), and slower at
# decode (64 tokens: 0.51 vs 0.43 ms). "auto": rowwise for batches where TMA runs (sm_90+), block otherwise.
FP8_GEMM = os.environ.get("MOECOMPILE_FP8_GEMM", "auto")
# The kernel of block batches on sm_90: "auto" = CUTLASS's blockwise grouped GEMM where it builds (kernels/
# cutlass_fp8.py, needs nvcc and nvidia-cutlass; expert FFN 1.53x / 1.57x bf16 on Mixtral / DeepSeek-V3 against the
# Gluon kernel's 1.30x / 1.38x, bench/results/gpu-fp8-gemm.md), else the Gluon kernel (kernels/gluon_fp8.py: half
# the promotions overlapped with the next wgmma), else the Triton block kernel, which also runs everything else.
FP8_BLOCK_KERNEL = os.environ.get("MOECOMPILE_FP8_BLOCK_KERNEL", "auto")  # auto | cutlass | gluon | triton
_GLUON_UNUSABLE: list[Exception] = []  # set when the Gluon kernel failed to build here: the Triton one from then on
_CONVERTED_WEIGHTS: dict[tuple, tuple] = {}


def _converted_weights(w: torch.Tensor, scale_inv: torch.Tensor, convert):
    """convert(w, scale_inv), made on first use and kept while w lives unchanged (one more FP8 copy of the expert
    weights in GPU memory). Not cached while a CUDA graph is being captured: captured kernels do not run, so the
    copy would hold nothing until a replay."""
    try:
        stamp = (w.data_ptr(), w._version, scale_inv.data_ptr(), scale_inv._version)
    except RuntimeError:  # inference tensors keep no version counter (and cannot change outside inference mode)
        stamp = (w.data_ptr(), None, scale_inv.data_ptr(), None)
    key = (id(w), convert)
    hit = _CONVERTED_WEIGHTS.get(key)
    if hit is not None and hit[0]() is w and hit[1] == stamp:
        return hit[2]
    converted = convert(w, scale_inv)
    if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        _CONVERTED_WEIGHTS[key] = (weakref.ref(w, lambda _, key=key: _CONVERTED_WEIGHTS.pop(key, None)), stamp,
                                   converted)
    return converted


def _rowwise_weights(w: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel copy of block-scaled weights (cached, _converted_weights)."""
    return _converted_weights(w, scale_inv, fp8_math.rowwise_from_blocks)


def _interleaved_gate_up(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    from moecompile.kernels import gluon_fp8

    return gluon_fp8.interleave_gate_up(w)


_CUTLASS_UNUSABLE: list[Exception] = []  # set when the CUTLASS library failed to build or load here


def _cutlass_usable(x_fp8, w_out) -> bool:
    from moecompile.kernels import cutlass_fp8

    if _CUTLASS_UNUSABLE or not cutlass_fp8.supported(x_fp8.shape[1], w_out.shape[2], w_out.shape[1]):
        return False
    try:
        cutlass_fp8.library()
    except cutlass_fp8.CutlassUnavailable as error:
        _CUTLASS_UNUSABLE.append(error)
        logging.getLogger("moecompile").warning("the CUTLASS FP8 kernel is not available (%s); block batches run "
                                                "the Gluon or Triton kernel", error)
        return False
    return True


def _experts_fp8_cutlass(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                         activation: str, gated: bool, out_dtype: torch.dtype):
    """Both projections on CUTLASS's block-scaled grouped GEMM; between them one Triton pass: bias, activation and
    the quantisation of the intermediate activation per row per 128 channels."""
    from moecompile.kernels import cutlass_fp8

    h = cutlass_fp8.grouped_gemm(x_fp8, x_scale_inv, offsets, w_in,
                                 _converted_weights(w_in, w_in_scale_inv, cutlass_fp8.weight_scales))
    a, a_scale = triton_fp8.activation_quantize(h, offsets, b_in, activation, gated)
    y = cutlass_fp8.grouped_gemm(a, a_scale, offsets, w_out,
                                 _converted_weights(w_out, w_out_scale_inv, cutlass_fp8.weight_scales))
    if b_out is not None:
        _add_expert_bias(y, offsets, b_out.to(y.dtype))
    return y.to(out_dtype)


def experts_fp8(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                activation: str, gated: bool, out_dtype: torch.dtype):
    args = (x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out, activation,
            gated, out_dtype)
    if not (_fp8_gemm_supported(x_fp8) and triton_fp8.supported(x_fp8.shape[1], w_out.shape[2])
            and activation in triton_moe.ACTIVATION_IDS):
        return reference.experts_fp8(*args)
    batch = x_fp8.shape[0] >= DECODE_ROWS_PER_EXPERT * w_in.shape[0]
    rowwise = FP8_GEMM == "rowwise" or (FP8_GEMM == "auto" and batch and triton_moe.tma_supported(x_fp8, w_in))
    hopper_batch = batch and torch.cuda.get_device_capability(x_fp8.device) == (9, 0)
    if not rowwise and hopper_batch and FP8_BLOCK_KERNEL in ("auto", "cutlass") and _cutlass_usable(x_fp8, w_out):
        return _experts_fp8_cutlass(*args)
    if not rowwise and hopper_batch and FP8_BLOCK_KERNEL in ("auto", "gluon") and not _GLUON_UNUSABLE:
        try:
            from moecompile.kernels import gluon_fp8

            w_in_k = _converted_weights(w_in, w_in_scale_inv, _interleaved_gate_up) if gated else w_in
            return gluon_fp8.experts_fp8(x_fp8, x_scale_inv, offsets, w_in_k, w_in_scale_inv, b_in, w_out,
                                         w_out_scale_inv, b_out, triton_moe.ACTIVATION_IDS[activation], gated,
                                         out_dtype)
        except (ImportError, AttributeError, CompilationError) as error:
            # Gluon is experimental and changes between Triton releases: written for 3.6 (and compiles with 3.9)
            _GLUON_UNUSABLE.append(error)
            logging.getLogger("moecompile").warning(
                "the Gluon FP8 kernel does not build with this Triton (%s: %s); using the Triton block kernel",
                type(error).__name__, str(error).strip().splitlines()[-1] if str(error).strip() else "")
    if not rowwise:
        return triton_fp8.experts_fp8(*args)
    x_rows, x_row_scale = triton_fp8.requantize_rows(x_fp8, x_scale_inv)
    return triton_fp8.experts_fp8_rowwise(x_rows, x_row_scale, offsets, *_rowwise_weights(w_in, w_in_scale_inv), b_in,
                                          *_rowwise_weights(w_out, w_out_scale_inv), b_out, activation, gated,
                                          out_dtype)
