"""Expert GEMMs on the dispatched rows of one MoE layer, each projection alone: which kernel.

On the device:  python bench/expert_gemms.py --out bench/results/gpu-expert-gemms.md

Same rows (random router, dropless) and weights; median ms. First projection = act(x W_in^T) (SwiGLU), second =
a W_out^T. Variants:
- grouped_mm:         torch._grouped_mm (CUTLASS); for the first projection then moecompile's Triton activation pass;
- triton:             moecompile's Triton grouped GEMM, bias/activation in its epilogue, pointer loads, autotuned;
- triton_tma:         the same with tensor-memory-accelerator loads, autotuned;
- triton_persistent:  the TMA kernel as a persistent kernel (one program per SM), autotuned;
then each tile config of the TMA kernels. The gated first projection loads gate and up rows in one interleaved TMA
box and computes both with one dot. Decode shapes (`-tN`: N single tokens) compare grouped_mm, triton_tma and
triton_decode (narrow tiles for few rows per expert) with each of its tile configs; weights GB/s = the hit experts'
weight bytes over the time (the copy bandwidth is the ceiling).
The winner per shape and projection goes into kernels/configs/expert_gemm.json (checked in the whole layer by
bench/moe_layer.py).
"""
from __future__ import annotations

import options_table
import torch
from options_table import ms

from moecompile.kernels import triton_moe
from moecompile.runtime import choices

SHAPES = {"gpt2-upcycled": (768, 3072, 16, 2, 16384), "mixtral": (4096, 14336, 8, 2, 4096),
          "qwen3-moe": (2048, 768, 128, 8, 8192), "deepseek-v3": (7168, 2048, 256, 8, 4096),
          "olmoe": (2048, 1024, 64, 8, 8192), "qwen2-moe": (2048, 1408, 60, 4, 8192),
          # decode: a batch of single tokens
          "mixtral-t1": (4096, 14336, 8, 2, 1), "mixtral-t16": (4096, 14336, 8, 2, 16),
          "mixtral-t64": (4096, 14336, 8, 2, 64), "qwen3-moe-t1": (2048, 768, 128, 8, 1),
          "qwen3-moe-t16": (2048, 768, 128, 8, 16), "qwen3-moe-t64": (2048, 768, 128, 8, 64),
          "deepseek-v3-t1": (7168, 2048, 256, 8, 1), "deepseek-v3-t16": (7168, 2048, 256, 8, 16)}
TRITON = ("triton", "triton_tma", "triton_persistent")
CONFIGS = {"triton_tma": triton_moe._ffn_in_tma_configs, "triton_persistent": triton_moe._ffn_in_persistent_configs,
           "triton_decode": triton_moe._ffn_in_decode_configs}
DECODE_VARIANTS = ("triton_tma", "triton_decode")  # and each triton_decode config: the decode shapes' candidates


def run(name, d, f, e, k, tokens, lines):
    w_in, w_out, rows, offsets, g = options_table.dispatched_layer(d, f, e, k, tokens)
    a = torch.randn(rows.shape[0], f, generator=g, device=rows.device, dtype=torch.bfloat16)
    n = int(offsets[-1])

    def first_grouped_mm():
        h = torch._grouped_mm(rows, w_in.transpose(-2, -1), offs=offsets)
        return triton_moe.expert_activation(h, offsets, None, "silu", True)

    projections = {
        "first": (2 * n * d * 2 * f, first_grouped_mm,
                  lambda v, c=None: triton_moe.grouped_ffn_in(rows, offsets, w_in, None, "silu", True, c, v)),
        "second": (2 * n * f * d, lambda: torch._grouped_mm(a, w_out.transpose(-2, -1), offs=offsets),
                   lambda v, c=None: triton_moe.grouped_ffn_in(a, offsets, w_out, None, None, False, c, v))}
    decode = not choices.is_batch(n, e)
    hit = int((torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0).sum())
    weight_bytes = {"first": hit * 2 * f * d * 2, "second": hit * d * f * 2}  # bf16 weights of the hit experts
    for projection, (flops, grouped_mm, triton_fn) in projections.items():
        variants = [("grouped_mm", grouped_mm)]
        variants += [(v, lambda v=v: triton_fn(v)) for v in (DECODE_VARIANTS if decode else TRITON)]
        configs = [(v, cfg) for v in (("triton_decode",) if decode else ("triton_tma", "triton_persistent"))
                   for cfg in CONFIGS[v]()]
        for variant, cfg in configs:
            c = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
            label = variant + " BM{BLOCK_M} BN{BLOCK_N} BK{BLOCK_K} w{num_warps} s{num_stages}".format(**c)
            variants.append((label, lambda v=variant, c=c: triton_fn(v, c)))
        ref, base = grouped_mm()[:n].float(), None
        for label, fn in variants:
            try:
                err = ((fn()[:n].float() - ref).norm() / ref.norm()).item()
                t = ms(fn)
                base = base or t
                lines.append(f"| {name} | {projection} | {label} | {t:.3f} | {flops / t / 1e9:.0f} | "
                             f"{weight_bytes[projection] / t / 1e6:.0f} | {base / t:.2f} | {err:.1e} |")
            except Exception as ex:
                lines.append(f"| {name} | {projection} | {label} | failed: {str(ex).splitlines()[0][:70]} | | | | |")
            print(lines[-1], flush=True)


def main(argv=None):
    return options_table.main(
        __doc__, "expert_gemms.py", "Expert GEMMs, each projection: kernel options (moecompile)",
        "| shape | projection | variant | ms | TF/s | weights GB/s | speedup vs grouped_mm | err vs grouped_mm |",
        SHAPES, run, argv)


if __name__ == "__main__":
    main()
