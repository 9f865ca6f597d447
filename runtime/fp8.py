"""The FP8 ops' CUDA entry points: the reference kernels where the device has no FP8 tensor cores or the shape does
not fit; else rowwise or block-scaled GEMMs (runtime/choices.py), block batches on sm_90 through the chain CUTLASS ->
Gluon -> Triton (a kernel that cannot be built here is skipped from then on, with one warning). Weights converted
for a kernel (per-channel scales, CUTLASS's scale layout, Gluon's gate/up order) are cached per weight tensor.
The weight-only ops (routed_experts_fp8, linear_fp8: decode) run kernels/triton_fp8_decode.py, which dequantises
the FP8 weights in registers; linear_fp8 over more rows dequantises the weight and runs the GEMM library.
"""
import functools
import logging
import weakref

import torch
from triton.compiler.errors import CompilationError

from moecompile.core import fp8_format as fp8_math
from moecompile.core import settings
from moecompile.kernels import cutlass_fp8, grouped_mm, reference, triton_fp8, triton_fp8_decode, triton_moe
from moecompile.runtime import choices

_GLUON_UNUSABLE: list[Exception] = []  # set when the Gluon kernel failed to build here: not tried again
_CUTLASS_UNUSABLE: list[Exception] = []  # set when the CUTLASS library failed to build or load here
_CONVERTED_WEIGHTS: dict[tuple, tuple] = {}


def _fp8_gemm_supported(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)  # fp8 tensor cores: Ada, Hopper


def quantize_fp8(x, group: int):
    if not (_fp8_gemm_supported(x) and group == triton_fp8.GROUP and x.shape[1] % group == 0):
        return reference.quantize_fp8(x, group)
    return triton_fp8.quantize_rows(x, group)


def _room_to_keep(device: torch.device) -> bool:
    """Whether a converted weight may be kept now: not while a CUDA graph is being captured (captured kernels do not
    run, so the copy would hold nothing until a replay), else while choices.CONVERTED_WEIGHTS_MIN_FREE_SHARE of the
    device's memory is free, counting what PyTorch's allocator holds unused as free."""
    if device.type != "cuda":
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free >= choices.CONVERTED_WEIGHTS_MIN_FREE_SHARE * total


def _stamp(w: torch.Tensor, scale_inv: torch.Tensor) -> tuple:
    try:
        return w.data_ptr(), w._version, scale_inv.data_ptr(), scale_inv._version
    except RuntimeError:  # inference tensors keep no version counter (and cannot change outside inference mode)
        return w.data_ptr(), None, scale_inv.data_ptr(), None


def _kept(w: torch.Tensor, scale_inv: torch.Tensor, convert):
    """convert(w, scale_inv) as kept by _converted_weights while w is unchanged, else None."""
    hit = _CONVERTED_WEIGHTS.get((id(w), convert))
    return hit[2] if hit is not None and hit[0]() is w and hit[1] == _stamp(w, scale_inv) else None


def _converted_weights(w: torch.Tensor, scale_inv: torch.Tensor, convert):
    """convert(w, scale_inv), made on first use and kept while w lives unchanged (one more FP8 copy of the expert
    weights in GPU memory) where _room_to_keep allows."""
    converted = _kept(w, scale_inv, convert)
    if converted is not None:
        return converted
    converted = convert(w, scale_inv)
    if _room_to_keep(w.device):
        key = (id(w), convert)
        _CONVERTED_WEIGHTS[key] = (weakref.ref(w, lambda _, key=key: _CONVERTED_WEIGHTS.pop(key, None)),
                                   _stamp(w, scale_inv), converted)
    return converted


def _rowwise_affordable(w_in, w_in_scale_inv, w_out, w_out_scale_inv) -> bool:
    """Whether the rowwise math's per-channel weight copies are kept or may be: converting them at every call (or in
    every replay of a captured graph) would cost more than the block math's slower GEMM over the weights as
    stored."""
    kept = all(_kept(w, s, fp8_math.rowwise_from_blocks) is not None
               for w, s in ((w_in, w_in_scale_inv), (w_out, w_out_scale_inv)))
    return kept or _room_to_keep(w_in.device)


def _rowwise_weights(w: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel copy of block-scaled weights (cached, _converted_weights)."""
    return _converted_weights(w, scale_inv, fp8_math.rowwise_from_blocks)


def _interleaved_gate_up(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    from moecompile.kernels import gluon_fp8

    return gluon_fp8.interleave_gate_up(w)


@functools.cache
def cutlass_library():
    """The CUTLASS library, built or loaded on first use as the settings say (MOECOMPILE_CUTLASS_LIB,
    MOECOMPILE_CACHE, CUDA_HOME); raises cutlass_fp8.CutlassUnavailable."""
    return cutlass_fp8.library(settings.cutlass_lib(), settings.cache_dir(), settings.cuda_home())


def _cutlass_usable(x_fp8, w_out) -> bool:
    if _CUTLASS_UNUSABLE or not cutlass_fp8.supported(x_fp8.shape[1], w_out.shape[2], w_out.shape[1]):
        return False
    try:
        cutlass_library()
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
    lib = cutlass_library()
    h = cutlass_fp8.grouped_gemm(x_fp8, x_scale_inv, offsets, w_in,
                                 _converted_weights(w_in, w_in_scale_inv, cutlass_fp8.weight_scales), lib)
    a, a_scale = triton_fp8.activation_quantize(h, offsets, b_in, activation, gated)
    y = cutlass_fp8.grouped_gemm(a, a_scale, offsets, w_out,
                                 _converted_weights(w_out, w_out_scale_inv, cutlass_fp8.weight_scales), lib)
    if b_out is not None:
        grouped_mm.add_expert_bias(y, offsets, b_out.to(y.dtype))
    return y.to(out_dtype)


def experts_fp8(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                activation: str, gated: bool, out_dtype: torch.dtype):
    args = (x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out, activation,
            gated, out_dtype)
    if not (_fp8_gemm_supported(x_fp8) and triton_fp8.supported(x_fp8.shape[1], w_out.shape[2])
            and activation in triton_moe.ACTIVATION_IDS):
        return reference.experts_fp8(*args)
    gemm, block_kernel = choices.FP8_GEMM, choices.FP8_BLOCK_KERNEL
    batch = choices.is_batch(x_fp8.shape[0], w_in.shape[0])
    rowwise = gemm == "rowwise" or (gemm == "auto" and batch and triton_moe.tma_supported(x_fp8, w_in)
                                    and _rowwise_affordable(w_in, w_in_scale_inv, w_out, w_out_scale_inv))
    hopper_batch = batch and torch.cuda.get_device_capability(x_fp8.device) == (9, 0)
    if not rowwise and hopper_batch and block_kernel in ("auto", "cutlass") and _cutlass_usable(x_fp8, w_out):
        return _experts_fp8_cutlass(*args)
    if not rowwise and hopper_batch and block_kernel in ("auto", "gluon") and not _GLUON_UNUSABLE:
        try:
            from moecompile.kernels import gluon_fp8

            w_in_k = _converted_weights(w_in, w_in_scale_inv, _interleaved_gate_up) if gated else w_in
            return gluon_fp8.experts_fp8(x_fp8, x_scale_inv, offsets, w_in_k, w_in_scale_inv, b_in, w_out,
                                         w_out_scale_inv, b_out, triton_moe.ACTIVATION_IDS[activation], gated,
                                         out_dtype)
        except (ImportError, AttributeError, CompilationError) as error:
            # Gluon is experimental and changes between Triton releases: one version's kernel may not build on another
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


def _weight_only(x: torch.Tensor) -> bool:
    """Whether the weight-only Triton kernels take x (they convert float8_e4m3fn in registers: sm_89+)."""
    return _fp8_gemm_supported(x) and x.dtype in triton_fp8_decode.DTYPES


def routed_experts_fp8(x, weights, expert_ids, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                       activation: str, gated: bool):
    args = (x, weights, expert_ids, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out, activation, gated)
    if not (_weight_only(x) and (activation in triton_moe.ACTIVATION_IDS or not activation)):
        return reference.routed_experts_fp8(*args)
    return triton_fp8_decode.routed_experts_fp8(*args, choices.direct_expert_tiles(x.shape[1], w_out.shape[2]),
                                                pdl=choices.programmatic_launch(x))


def linear_fp8(x, weight, weight_scale_inv, bias):
    rows = x.numel() // max(x.shape[-1], 1)
    if not _weight_only(x):
        return reference.linear_fp8(x, weight, weight_scale_inv, bias)
    if not choices.fp8_linear_in_registers(rows):
        w = fp8_math.dequantize_blocks(weight, weight_scale_inv, dtype=x.dtype)
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
    splits = choices.fp8_linear_splits(rows, weight.shape[0], weight.shape[1],
                                       torch.cuda.get_device_properties(x.device).multi_processor_count)
    y = triton_fp8_decode.linear_fp8(x.reshape(rows, x.shape[-1]), weight, weight_scale_inv, bias, splits=splits)
    return y.view(*x.shape[:-1], weight.shape[0])
