"""Which CUDA kernel runs: the environment's overrides (read once, at import) and the tuned per-shape choices of the
expert GEMMs, data in kernels/configs/expert_gemm.json (loaded on first use). Imports no kernel: answers on any
machine.

Expert GEMM kernels, per projection: "triton" / "triton_tma" = a Triton grouped GEMM with bias (+ activation, first
projection) in its epilogue, operands loaded by pointers / by TMA (Hopper); "triton_persistent" = the TMA one as a
persistent kernel (one program per SM, epilogue overlapped with the next tile); "triton_decode" = the pointer kernel
with tiles for few rows per expert (narrow M and N, long K: the hit experts' weights read once by many programs);
"grouped_mm" = torch._grouped_mm (CUTLASS), after the first projection a one-pass Triton activation; "quack" = QuACK's
CuTe DSL varlen grouped GEMMs (the optional `quack` extra; activation in the first one's epilogue), QUACK_FALLBACK
where it cannot run; "quack_gathered" (first projection only) = quack reading its rows from the token matrix through
the dispatch order where the layer gathers them (ops.experts_gathered: no row copy written), which pays where the copy
costs more than the slower gathered loads. Elsewhere it is quack, and a layer that gathers under another kernel reads
a copy of its rows. "auto" takes the tuned choice.

FP8 expert GEMMs: "rowwise" = per-row activation and per-channel weight scales applied after the K loop (weights
converted from their 128x128 blocks once), faster for batches for a second rounding of weights and activations;
"block" = the checkpoint's block scales promoted every K step, the more exact math and the faster one at decode.
"auto": rowwise for batches where TMA runs (sm_90+) and its weight copies can be kept, block otherwise. Block
batches on sm_90 run CUTLASS's blockwise grouped GEMM where it builds, else the Gluon kernel, else the Triton block
kernel (FP8_BLOCK_KERNEL picks one).
"""
from __future__ import annotations

import functools
import json
from importlib import resources

from moecompile.core import settings

FFN_IN = settings.ffn_in()  # the values each accepts: moecompile/core/settings.py
FFN_OUT = settings.ffn_out()
FOLD_COMBINE = settings.fold_combine()
FP8_GEMM = settings.fp8_gemm()
FP8_BLOCK_KERNEL = settings.fp8_block_kernel()
PROGRAMMATIC_LAUNCH = settings.programmatic_launch()
# Below this many rows per expert a batch is "decode": tiles are mostly empty and other kernels win.
DECODE_ROWS_PER_EXPERT = 64
# Below this many rows per expert an eager (uncompiled) call of the HF experts integration on CUDA runs HF's own
# small-batch implementation: the host cost of launching Triton kernels outweighs what they save on the device.
EAGER_HF_ROWS_PER_EXPERT = 2
EXPERT_GEMM_CONFIG = "expert_gemm.json"  # in moecompile.kernels' configs/
QUACK_GEMM_CONFIG = "quack_gemm.json"
FP8_LINEAR_CONFIG = "fp8_linear.json"
DIRECT_EXPERTS_CONFIG = "direct_experts.json"
QUACK_FALLBACK = "triton_persistent"  # where "quack" is chosen but not installed, not Hopper, or the shape unsupported
QUACK_KERNELS = ("quack", "quack_gathered")


# Decode routing: top-k and dispatch in one launch, except one token over more experts than this, where the one-warp
# top-k kernel and then the dispatch kernel measured faster (bench/route_dispatch.py).
ONE_LAUNCH_ROUTE_MAX_EXPERTS_AT_ONE_TOKEN = 64
DECODE_ATTENTION_BLOCK = 64  # cache positions per step of the decode attention kernel
DECODE_ATTENTION_PROGRAMS_PER_SM = 1  # more split a 4k cache at batch 64 further and measured slower
# A weight converted for an FP8 batch kernel (runtime/fp8.py) is kept only while this share of the GPU's memory stays
# free beside it: the copies of a model that fills the card do not fit too. Where the rowwise math's copies cannot be
# kept, "auto" takes the block math, which reads the weights as stored.
CONVERTED_WEIGHTS_MIN_FREE_SHARE = 0.25


# FP8 linears (option fp8_linears): up to this many rows (decode) the weight-only Triton kernel reads the FP8 weights
# once; more rows (a prefill) dequantise the weights and run the GEMM library in the activations' dtype.
FP8_LINEAR_MAX_ROWS = 64


def programmatic_launch(x) -> bool:
    """Whether moecompile's decode kernels reading the CUDA tensor x launch as programmatic dependents (PDL:
    Hopper on)."""
    return PROGRAMMATIC_LAUNCH != "off" and x.is_cuda and _has_programmatic_launch(x.device.index)


@functools.cache
def _has_programmatic_launch(device_index: int | None) -> bool:
    import torch  # (only for CUDA tensors: this module answers without torch)

    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def inductor_programmatic_launch(one_token: bool) -> bool:
    """Whether inductor's kernels of a compiled graph launch as programmatic dependents (where the GPU has PDL): in
    one-token decode steps (auto), where a step's many small kernels measured faster with them (bench/results/
    gpu-generate.md), or in every graph (on)."""
    return PROGRAMMATIC_LAUNCH == "on" or (PROGRAMMATIC_LAUNCH == "auto" and one_token)


def fp8_linear_in_registers(rows: int) -> bool:
    return rows <= FP8_LINEAR_MAX_ROWS


def fp8_linear_splits(rows: int, n: int, k: int, sms: int) -> int:
    """How many K splits the FP8 linear's Triton kernel runs for x [rows, k] W[n, k]^T on a GPU of `sms` SMs: enough
    programs to fill it, within kernels/configs/fp8_linear.json's bounds (its "about" says how)."""
    data = fp8_linear_table()
    column_tiles = -(-n // data["nominal_block_n"])  # times one row tile: at most FP8_LINEAR_MAX_ROWS rows
    wanted = data["programs_per_sm"]["matvec" if rows == 1 else "dot"] * sms // column_tiles
    affordable = int(data["max_partial_share"] * k / (8 * max(rows, 1)))
    splits = max(1, min(wanted, affordable, -(-k // 128)))
    return 1 << (splits.bit_length() - 1)


def decode_attention_runs(batch: int, kv_heads: int, length: int, sms: int, block: int = DECODE_ATTENTION_BLOCK
                          ) -> int:
    """How many runs of cache positions the decode attention kernel splits each key/value head's positions into:
    enough programs for DECODE_ATTENTION_PROGRAMS_PER_SM per SM, at most one per block of positions."""
    blocks = -(-length // block)
    return max(1, min(blocks, -(-DECODE_ATTENTION_PROGRAMS_PER_SM * sms // max(1, batch * kv_heads))))


def one_launch_route(tokens: int, num_experts: int) -> bool:
    return tokens > 1 or num_experts <= ONE_LAUNCH_ROUTE_MAX_EXPERTS_AT_ONE_TOKEN


def is_batch(rows: int, num_experts: int) -> bool:
    return rows >= DECODE_ROWS_PER_EXPERT * num_experts


def eager_prefers_hf(rows: int, num_experts: int) -> bool:
    return rows < EAGER_HF_ROWS_PER_EXPERT * num_experts


def regime(rows: int, num_experts: int) -> str:
    return "batch" if is_batch(rows, num_experts) else "decode"


def _config_file(name: str) -> dict:
    return json.loads((resources.files("moecompile.kernels") / "configs" / name).read_text())


@functools.cache
def fp8_linear_table() -> dict:
    return _config_file(FP8_LINEAR_CONFIG)


@functools.cache
def direct_experts_table() -> dict:
    return _config_file(DIRECT_EXPERTS_CONFIG)


@functools.cache  # asked at every decode call of the op; callers only read it
def direct_expert_tiles(hidden: int, width: int) -> dict:
    """{"in": ..., "out": ...}: the direct experts' tiles (BLOCK_N, BLOCK_K, num_warps, num_stages) of the first
    projection (K = hidden) and the second (K = width), from kernels/configs/direct_experts.json."""
    data = direct_experts_table()

    def tiles(entries: list, k: int) -> dict:
        entry = next(e for e in entries if e["max_k"] is None or k <= e["max_k"])
        return {key: value for key, value in entry.items() if key != "max_k"}

    return {"in": tiles(data["first"], hidden), "out": tiles(data["second"], width)}


@functools.cache
def expert_gemm_table() -> tuple[dict, dict]:
    """(default {regime: (first, second)}, tuned {(hidden, expert_size, experts, regime): (first, second)})."""
    data = _config_file(EXPERT_GEMM_CONFIG)
    default = {name: tuple(pair) for name, pair in data["default"].items()}
    tuned = {}
    for key, regimes in data["shapes"].items():
        shape = dict(part.split("=") for part in key.split(","))
        for name, pair in regimes.items():
            tuned[(int(shape["hidden"]), int(shape["expert_size"]), int(shape["experts"]), name)] = tuple(pair)
    return default, tuned


def expert_gemm_kernels(rows: int, hidden: int, expert_size: int, num_experts: int,
                        training: bool = False) -> tuple[str, str]:
    """(first, second projection) kernel for this shape: FFN_IN / FFN_OUT when set, else the tuned choice (a batch
    in training: the shape's "train" entry where it has one, measured on whole training steps), else the default of
    the regime."""
    default, tuned = expert_gemm_table()
    shape_regime = regime(rows, num_experts)
    shape = (hidden, expert_size, num_experts)
    pair = tuned.get((*shape, "train")) if training and shape_regime == "batch" else None
    first, second = pair or tuned.get((*shape, shape_regime), default[shape_regime])
    return (first if FFN_IN == "auto" else FFN_IN), (second if FFN_OUT == "auto" else FFN_OUT)


def quack_key(projection: str, k: int, n: int, gathered: bool = False) -> str:
    """The quack_gemm.json key of one expert GEMM: projection "first" / "second" (or a training backward GEMM,
    quack_backward_sizes), its K and N, gathered A rows."""
    return f"{projection},k={k},n={n}" + (",gathered" if gathered else "")


def quack_backward_sizes(hidden: int, expert_size: int, expert_in_features: int) -> dict[str, tuple[int, int]]:
    """The (k, n) of each QuACK GEMM of the experts' backward, by the name kernels/quack_gemm.backward gives it: data
    = grad_y W_out with the activation's derivative, input = grad_h W_in; the weight gradients' K is each group's
    rows, so their k and n are the gradient's rows and columns."""
    return {"data": (hidden, expert_size), "weight_out": (hidden, expert_size),
            "weight_in": (hidden, expert_in_features), "input": (expert_in_features, hidden)}


GATHERED_BACKWARD = ("data", "weight_out")  # the backward GEMMs that read the combine's gradient when it is folded in


def quack_backward_configs(hidden: int, expert_size: int, expert_in_features: int,
                           combined: bool = False) -> dict[str, dict | None]:
    """quack_config of each backward GEMM (quack_backward_sizes), by name; combined: the GEMMs of
    quack_gemm.combined_backward, GATHERED_BACKWARD's reading gathered rows."""
    return {name: quack_config(name, k, n, combined and name in GATHERED_BACKWARD)
            for name, (k, n) in quack_backward_sizes(hidden, expert_size, expert_in_features).items()}


def folds_combine(hidden: int, expert_size: int, expert_in_features: int) -> bool:
    """Whether training folds the combine's backward into the experts' QuACK backward (quack_gemm.combined_backward):
    on, or auto where both GATHERED_BACKWARD GEMMs have a tuned configuration for this shape, because on QuACK's
    default configurations gathering the rows costs more than the [N, H] row gradient it saves."""
    if FOLD_COMBINE != "auto":
        return FOLD_COMBINE == "on"
    sizes = quack_backward_sizes(hidden, expert_size, expert_in_features)
    return all(quack_config(name, *sizes[name], gathered=True) is not None for name in GATHERED_BACKWARD)


@functools.cache
def _quack_table() -> dict:
    return _config_file(QUACK_GEMM_CONFIG)["configs"]


def quack_config(projection: str, k: int, n: int, gathered: bool = False) -> dict | None:
    """The tuned QuACK tile configuration (GemmConfig's fields) of this GEMM, or None for QuACK's default."""
    return _quack_table().get(quack_key(projection, k, n, gathered))
