"""First expert projection + activation on the dispatched rows of one MoE layer: which kernel (issue 9).

On the device:  python bench/ffn_in.py --out bench/results/gpu-ffn-in.md

Variants, same rows (random router, dropless) and weights, median ms of act(x W_in^T) (SwiGLU):
- grouped_mm:   torch._grouped_mm (CUTLASS) then moecompile's Triton activation pass;
- triton:       moecompile's Triton grouped GEMM with the activation in its epilogue, pointer loads, autotuned;
- triton tma:   the same with tensor-memory-accelerator loads, autotuned, then each of its tile configs.
The winner per shape goes into kernels/cuda.py's MEASURED (with the second projection's choice from bench/moe_layer.py).
"""
from __future__ import annotations

import torch

import options_table

SHAPES = {"gpt2-upcycled": (768, 3072, 16, 2, 16384), "mixtral": (4096, 14336, 8, 2, 4096),
          "qwen3-moe": (2048, 768, 128, 8, 8192), "deepseek-v3": (7168, 2048, 256, 8, 4096)}


def ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def run(name, d, f, e, k, tokens, lines):
    from moecompile import ops
    from moecompile.kernels import triton_moe

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w_in = torch.randn(e, 2 * f, d, generator=g, device=dev, dtype=torch.bfloat16) * d ** -0.5
    router = torch.randn(e, d, generator=g, device=dev, dtype=torch.bfloat16) * d ** -0.5
    x = torch.randn(tokens, d, generator=g, device=dev, dtype=torch.bfloat16)
    _, ids = ops.route(x @ router.t(), k, 0.0, True)
    rows, _, offsets = ops.dispatch(x, ids, e)
    flops = 2 * rows.shape[0] * d * 2 * f

    def grouped_mm():
        h = torch._grouped_mm(rows, w_in.transpose(-2, -1), offs=offsets)
        return triton_moe.expert_activation(h, offsets, None, "silu", True)

    ref = grouped_mm()
    variants = [("grouped_mm + activation pass", grouped_mm),
                ("triton", lambda: triton_moe.grouped_ffn_in(rows, offsets, w_in, None, "silu", True)),
                ("triton tma", lambda: triton_moe.grouped_ffn_in(rows, offsets, w_in, None, "silu", True, tma=True))]
    for cfg in triton_moe._ffn_in_tma_configs():
        c = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        label = "tma BM{BLOCK_M} BN{BLOCK_N} BK{BLOCK_K} w{num_warps} s{num_stages}".format(**c)
        variants.append((label, lambda c=c: triton_moe.grouped_ffn_in(rows, offsets, w_in, None, "silu", True,
                                                                      config=c, tma=True)))
    base = None
    for label, fn in variants:
        try:
            n = int(offsets[-1])
            err = ((fn()[:n].float() - ref[:n].float()).norm() / ref[:n].float().norm()).item()
            t = ms(fn)
            base = base or t
            lines.append(f"| {name} | {label} | {t:.3f} | {flops / t / 1e9:.0f} | {base / t:.2f} | {err:.1e} |")
        except Exception as ex:
            lines.append(f"| {name} | {label} | failed: {str(ex).splitlines()[0][:70]} | | | |")
        print(lines[-1], flush=True)


def main(argv=None):
    return options_table.main(
        __doc__, "ffn_in.py", "First expert projection + SwiGLU: kernel options (moecompile, issue 9)",
        "| shape | variant | ms | TF/s | speedup vs grouped_mm | err vs grouped_mm |", SHAPES, run, argv)


if __name__ == "__main__":
    main()
