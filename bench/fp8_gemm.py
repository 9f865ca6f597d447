"""FP8 expert-GEMM options on the dispatched rows of one MoE layer ("chosen by measurement").

On the device:  python bench/fp8_gemm.py --out bench/results/gpu-fp8-gemm.md

Same rows, same weights, median ms of the expert FFN (both projections + activation + requantisation):
- bf16:          moecompile's bf16 experts kernel (torch._grouped_mm + Triton activation, or the fused Triton GEMM);
- block triton:  Triton block-scaled FP8 grouped GEMMs (weights 128x128, activations 1x128, the scales applied
                 every K step of 128: "promotion"), pointer loads, autotuned, then each tile config;
- rowwise triton: the persistent Triton kernel (TMA loads, one program per SM) on per-row activation and
                 per-output-channel weight scales applied after the K loop (the weights converted from the 128x128
                 blocks, the activations requantised per row): the runtime's path (runtime/fp8.py, autotuned),
                 then each autotuner config with the two projections timed apart (first + second);
- block gluon:   the block math again (kernels/gluon_fp8.py, Hopper): TMA loads, each K step's wgmma into one of
                 two partial accumulators so the scaling of step k - 1 runs while step k's wgmma does; the first
                 projection's bf16 output quantised per 128 channels by a separate pass; then each tile config with
                 the two projections timed apart (first + second);
- block CUTLASS: the block math on CUTLASS's sm90 blockwise-scaled grouped GEMM (kernels/cutlass_fp8.py: 128x128
                 tiles, two consumer warpgroups, float32 promotion every 128 of K), with one Triton pass between the
                 projections (SwiGLU + quantising per 128 channels); then the two GEMMs and that pass apart;
- rowwise CUTLASS: torch._scaled_grouped_mm (CUTLASS, sm90) with per-output-channel weight scales and per-token
                 activation scales, the weights requantised from the 128x128 blocks; bare = the two GEMMs alone.
err: relative Frobenius error of the output against the bf16 kernel's.
"""
from __future__ import annotations

import options_table
import torch
from options_table import ms

SHAPES = {"mixtral": (4096, 14336, 8, 2, 4096), "deepseek-v3": (7168, 2048, 256, 8, 4096)}
TRITON_CONFIGS = [(bm, w, s) for bm in (64, 128) for w in (4, 8) for s in (3, 4)]
# (BLOCK_M, GROUP_M, stages, warps, K steps per unrolled pair): unroll 1 promotes every step after its wgmma (no
# overlap: the baseline the pairs are measured against); 64-row tiles with 4 warps fit two programs per SM
GLUON_CONFIGS = [(128, 8, 4, 8, 2), (128, 8, 4, 8, 1), (128, 8, 3, 8, 2), (128, 16, 4, 8, 2), (64, 8, 4, 4, 2),
                 (64, 8, 3, 4, 2), (64, 16, 4, 4, 2), (64, 8, 4, 4, 1)]


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rowwise_quant(x):
    """Per row: (fp8, float32 scale_inv [rows])."""
    amax = x.float().abs().amax(-1).clamp_min(1e-12)
    scale = amax / 448.0
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def run(name, d, f, e, k, tokens, lines):
    from moecompile.ir.fp8 import dequantize_blocks, quantize_blocks
    from moecompile.kernels import triton_fp8
    from moecompile.runtime import cuda, fp8

    w_in, w_out, rows, offsets, _ = options_table.dispatched_layer(d, f, e, k, tokens)
    n = rows.shape[0]
    flops = 6 * n * d * f
    wi_q, wi_s = quantize_blocks(w_in)
    wo_q, wo_s = quantize_blocks(w_out)

    def tf(t):
        return flops / t / 1e9

    y_bf16 = cuda.experts(rows, offsets, w_in, None, w_out, None, "silu", True)
    t_bf16 = ms(lambda: cuda.experts(rows, offsets, w_in, None, w_out, None, "silu", True))
    lines.append(f"| {name} | bf16 experts | {t_bf16:.3f} | {tf(t_bf16):.0f} | 1.00 | - |")

    def block(config=None):
        xq, xs = triton_fp8.quantize_rows(rows)
        return triton_fp8.experts_fp8(xq, xs, offsets, wi_q, wi_s, None, wo_q, wo_s, None, "silu", True,
                                      torch.bfloat16, config)

    err = rel(block(), y_bf16)
    t = ms(block)
    lines.append(f"| {name} | block triton (autotuned) | {t:.3f} | {tf(t):.0f} | {t_bf16 / t:.2f} | {err:.1e} |")
    for bm, w, s in TRITON_CONFIGS:
        cfg = {"BLOCK_M": bm, "GROUP_M": 8, "num_warps": w, "num_stages": s}
        try:
            t = ms(lambda: block(cfg))
            lines.append(f"| {name} | block triton BM{bm} w{w} s{s} | {t:.3f} | {tf(t):.0f} | {t_bf16 / t:.2f} | |")
        except Exception as ex:  # e.g. out of shared memory
            lines.append(f"| {name} | block triton BM{bm} w{w} s{s} | failed: {str(ex).splitlines()[0][:60]} | | | |")
        print(lines[-1], flush=True)

    # rowwise: what runtime/fp8.py runs for batches on Hopper (quantize_fp8 + experts_fp8; the weights' conversion
    # happens on the first call and is cached)
    def rowwise():
        return fp8.experts_fp8(*fp8.quantize_fp8(rows, 128), offsets, wi_q, wi_s, None, wo_q, wo_s, None, "silu",
                               True, torch.bfloat16)

    err = rel(rowwise(), y_bf16)
    t = ms(rowwise)
    lines.append(f"| {name} | rowwise triton (autotuned) | {t:.3f} | {tf(t):.0f} | {t_bf16 / t:.2f} | {err:.1e} |")
    chosen = "; ".join(f"{'first' if key[4] else 'second'} projection: {cfg}"
                       for key, cfg in triton_fp8._grouped_fp8_rowwise_tuned.cache.items() if key[3] == e)
    lines.append(f"| {name} | autotuner's choice: {chosen} | | | | |")
    print(lines[-2:], flush=True)
    wi_r, wi_rs = fp8._rowwise_weights(wi_q, wi_s)
    wo_r, wo_rs = fp8._rowwise_weights(wo_q, wo_s)
    xq, xs = triton_fp8.requantize_rows(*triton_fp8.quantize_rows(rows))
    a = torch.empty(n, f, dtype=torch.float8_e4m3fn, device=rows.device)
    a_s = torch.empty(n, f // 128, dtype=torch.float32, device=rows.device)
    y = torch.empty(n, d, dtype=torch.bfloat16, device=rows.device)
    first = (xq, xs, wi_r, wi_rs, None, offsets, a, a_s, "silu", True, True)
    triton_fp8._launch(*first, None, "rowwise")
    ar, ars = triton_fp8.requantize_rows(a, a_s)
    second = (ar, ars, wo_r, wo_rs, None, offsets, y, None, None, False, False)
    t_requant = ms(lambda: triton_fp8.requantize_rows(a, a_s))
    lines.append(f"| {name} | rowwise: requantising the activations per row | {t_requant:.3f} | | | |")
    for c in triton_fp8._fp8_rowwise_configs():
        cfg = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
        label = f"BM{c.kwargs['BLOCK_M']} G{c.kwargs['GROUP_M']} w{c.num_warps} s{c.num_stages}"
        try:
            t1 = ms(lambda: triton_fp8._launch(*first, cfg, "rowwise"))
            t2 = ms(lambda: triton_fp8._launch(*second, cfg, "rowwise"))
            lines.append(f"| {name} | rowwise triton {label} | {t1:.3f} + {t2:.3f} | {tf(t1 + t2):.0f} | "
                         f"{t_bf16 / (t1 + t2):.2f} | |")
        except Exception as ex:  # e.g. out of shared memory
            lines.append(f"| {name} | rowwise triton {label} | failed: {str(ex).splitlines()[0][:60]} | | | |")
        print(lines[-1], flush=True)

    # block gluon: the block math with each K step's scaling overlapped with the next wgmma (kernels/gluon_fp8.py)
    from moecompile.kernels import gluon_fp8

    wi_i = gluon_fp8.interleave_gate_up(wi_q)

    def gluon(config=None):
        xq, xs = triton_fp8.quantize_rows(rows)
        return gluon_fp8.experts_fp8(xq, xs, offsets, wi_i, wi_s, None, wo_q, wo_s, None, 3, True, torch.bfloat16,
                                     config)

    err = rel(gluon(), y_bf16)
    t = ms(gluon)
    lines.append(f"| {name} | block gluon (default tiles) | {t:.3f} | {tf(t):.0f} | {t_bf16 / t:.2f} | {err:.1e} |")
    lines.append(f"| {name} | block gluon vs block triton: relative difference {rel(gluon(), block()):.1e} | | | | |")
    print(lines[-2:], flush=True)
    xq, xs = triton_fp8.quantize_rows(rows)
    h = torch.empty(n, f, dtype=torch.bfloat16, device=rows.device)
    gluon_fp8.grouped_gemm(xq, xs, wi_i, wi_s, None, offsets, h, 3, True)
    aq, as_ = triton_fp8.quantize_rows(h)
    t_quant = ms(lambda: triton_fp8.quantize_rows(h))
    lines.append(f"| {name} | block gluon: quantising the activations (bf16 -> 1x128) | {t_quant:.3f} | | | |")
    for bm, gm, st, w, u in GLUON_CONFIGS:
        cfg = dict(block_m=bm, group_m=gm, stages=st, num_warps=w, unroll=u)
        label = f"BM{bm} G{gm} s{st} w{w} unroll {u}"
        try:
            t1 = ms(lambda: gluon_fp8.grouped_gemm(xq, xs, wi_i, wi_s, None, offsets, h, 3, True, **cfg))
            t2 = ms(lambda: gluon_fp8.grouped_gemm(aq, as_, wo_q, wo_s, None, offsets, y, -1, False, **cfg))
            lines.append(f"| {name} | block gluon {label} | {t1:.3f} + {t2:.3f} | {tf(t1 + t2):.0f} | "
                         f"{t_bf16 / (t1 + t2):.2f} | |")
        except Exception as ex:  # e.g. out of shared memory
            lines.append(f"| {name} | block gluon {label} | failed: {str(ex).splitlines()[0][:60]} | | | |")
        print(lines[-1], flush=True)

    # block CUTLASS: the block math on CUTLASS's sm90 blockwise grouped GEMM (kernels/cutlass_fp8.py), the
    # runtime's block path on Hopper where it builds
    from moecompile.kernels import cutlass_fp8

    try:
        lib = fp8.cutlass_library()
    except cutlass_fp8.CutlassUnavailable as ex:
        lines.append(f"| {name} | block CUTLASS | unavailable: {ex} | | | |")
    else:
        wi_t, wo_t = cutlass_fp8.weight_scales(wi_q, wi_s), cutlass_fp8.weight_scales(wo_q, wo_s)

        def cutlass_chain():
            xq, xs = triton_fp8.quantize_rows(rows)
            h = cutlass_fp8.grouped_gemm(xq, xs, offsets, wi_q, wi_t, lib)
            aq, as_ = triton_fp8.activation_quantize(h, offsets, None, "silu", True)
            return cutlass_fp8.grouped_gemm(aq, as_, offsets, wo_q, wo_t, lib)

        err = rel(cutlass_chain(), y_bf16)
        t = ms(cutlass_chain)
        lines.append(f"| {name} | block CUTLASS (quantise, GEMM, SwiGLU + quantise, GEMM) | {t:.3f} | {tf(t):.0f} | "
                     f"{t_bf16 / t:.2f} | {err:.1e} |")
        diff = rel(cutlass_chain(), block())
        lines.append(f"| {name} | block CUTLASS vs block triton: relative difference {diff:.1e} | | | | |")
        xq, xs = triton_fp8.quantize_rows(rows)
        h = cutlass_fp8.grouped_gemm(xq, xs, offsets, wi_q, wi_t, lib)
        aq, as_ = triton_fp8.activation_quantize(h, offsets, None, "silu", True)
        t1 = ms(lambda: cutlass_fp8.grouped_gemm(xq, xs, offsets, wi_q, wi_t, lib))
        t2 = ms(lambda: cutlass_fp8.grouped_gemm(aq, as_, offsets, wo_q, wo_t, lib))
        t_act = ms(lambda: triton_fp8.activation_quantize(h, offsets, None, "silu", True))
        lines.append(f"| {name} | block CUTLASS GEMMs alone (first + second) | {t1:.3f} + {t2:.3f} | "
                     f"{tf(t1 + t2):.0f} | {t_bf16 / (t1 + t2):.2f} | |")
        lines.append(f"| {name} | block CUTLASS: SwiGLU + quantising the activations (bf16 -> 1x128) | {t_act:.3f} "
                     "| | | |")
        print(lines[-4:], flush=True)

    if not hasattr(torch, "_scaled_grouped_mm"):
        lines.append(f"| {name} | rowwise | torch._scaled_grouped_mm missing | | | |")
        return
    # per-output-channel weights, requantised from the block-scaled ones (what a block checkpoint would give)
    wi_r, wi_rs = rowwise_quant(dequantize_blocks(wi_q, wi_s, dtype=torch.float32))
    wo_r, wo_rs = rowwise_quant(dequantize_blocks(wo_q, wo_s, dtype=torch.float32))
    offs = offsets.to(torch.int32)
    for fast in (False, True):
        def gemm1(xq, xs):
            return torch._scaled_grouped_mm(xq, wi_r.transpose(-2, -1), xs, wi_rs, offs=offs,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)

        def gemm2(aq, as_):
            return torch._scaled_grouped_mm(aq, wo_r.transpose(-2, -1), as_, wo_rs, offs=offs,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)

        def chain():
            xq, xs = rowwise_quant(rows)
            h = gemm1(xq, xs)
            a = torch.nn.functional.silu(h[:, :f]) * h[:, f:]
            aq, as_ = rowwise_quant(a)
            return gemm2(aq, as_)

        try:
            err = rel(chain(), y_bf16)
            xq, xs = rowwise_quant(rows)
            h = gemm1(xq, xs)
            aq, as_ = rowwise_quant(torch.nn.functional.silu(h[:, :f]) * h[:, f:])
            t1, t2 = ms(lambda: gemm1(xq, xs)), ms(lambda: gemm2(aq, as_))
            t = ms(chain)
            lines.append(f"| {name} | rowwise CUTLASS scaled_grouped_mm fast_accum={fast}: bare GEMMs | "
                         f"{t1 + t2:.3f} | {tf(t1 + t2):.0f} | {t_bf16 / (t1 + t2):.2f} | {err:.1e} |")
            lines.append(f"| {name} | rowwise, with torch quant/act (unfused) | {t:.3f} | {tf(t):.0f} | "
                         f"{t_bf16 / t:.2f} | |")
        except Exception as ex:
            lines.append(f"| {name} | rowwise fast_accum={fast} | failed: {str(ex).splitlines()[0][:80]} | | | |")
        print(lines[-2:], flush=True)
    # bare bf16 GEMMs on the same rows, for scale
    h = torch._grouped_mm(rows, w_in.transpose(-2, -1), offs=offs)
    a = torch.nn.functional.silu(h[:, :f]) * h[:, f:]
    tb = (ms(lambda: torch._grouped_mm(rows, w_in.transpose(-2, -1), offs=offs))
          + ms(lambda: torch._grouped_mm(a, w_out.transpose(-2, -1), offs=offs)))
    lines.append(f"| {name} | bf16 bare grouped_mm GEMMs | {tb:.3f} | {tf(tb):.0f} | {t_bf16 / tb:.2f} | |")


def main(argv=None):
    return options_table.main(__doc__, "fp8_gemm.py", "FP8 expert GEMM options (moecompile)",
                              "| shape | variant | ms | TF/s | speedup vs bf16 | err vs bf16 |", SHAPES, run, argv)


if __name__ == "__main__":
    main()
