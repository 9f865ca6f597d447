"""The six expert GEMMs of a training step, each alone on torch._grouped_mm: the floor of fwd + bwd.

On the device:  python bench/training_gemms.py --out bench/results/gpu-training-gemms.md

One layer's dispatched rows (random router, dropless) and SwiGLU weights, bf16; median ms and TF/s of each GEMM as
runtime/cuda.py runs it (h = x W_in^T, y = a W_out^T forward; dL/da = g W_out, dL/dW_out = g^T a,
dL/dW_in = gh^T x, dL/dx = gh W_in backward), plus dL/dW_in computed as (x^T gh)^T, a layout moecompile does not
use (the transpose would cost a copy of the gradient for weights stored [E, F, H]). sum = the six as run: the time
a training step's expert GEMMs take on torch._grouped_mm with nothing else.
"""
from __future__ import annotations

import options_table
import torch
from options_table import ms

SHAPES = {"gpt2-upcycled": (768, 3072, 16, 2, 16384), "mixtral": (4096, 14336, 8, 2, 4096)}


def run(name, d, f, e, k, tokens, lines):
    w_in, w_out, x, offsets, g = options_table.dispatched_layer(d, f, e, k, tokens)
    n = x.shape[0]

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=x.device, dtype=torch.bfloat16)

    a, grad_y, grad_h = randn(n, f), randn(n, d), randn(n, 2 * f)
    gemms = [  # (label, FLOPs, call, as run)
        ("forward h = x W_in^T", 2 * n * d * 2 * f, lambda: torch._grouped_mm(x, w_in.transpose(-2, -1), offs=offsets),
         True),
        ("forward y = a W_out^T", 2 * n * f * d, lambda: torch._grouped_mm(a, w_out.transpose(-2, -1), offs=offsets),
         True),
        ("dL/da = g W_out", 2 * n * d * f, lambda: torch._grouped_mm(grad_y, w_out, offs=offsets), True),
        ("dL/dW_out = g^T a", 2 * n * d * f, lambda: torch._grouped_mm(grad_y.t(), a, offs=offsets), True),
        ("dL/dW_in = gh^T x", 2 * n * d * 2 * f, lambda: torch._grouped_mm(grad_h.t(), x, offs=offsets), True),
        ("dL/dW_in = (x^T gh)^T", 2 * n * d * 2 * f, lambda: torch._grouped_mm(x.t(), grad_h, offs=offsets), False),
        ("dL/dx = gh W_in", 2 * n * d * 2 * f, lambda: torch._grouped_mm(grad_h, w_in, offs=offsets), True),
    ]
    total = 0.0
    for label, flops, call, as_run in gemms:
        t = ms(call)
        total += t if as_run else 0.0
        lines.append(f"| {name} | {label} | {t:.3f} | {flops / t / 1e9:.0f} |")
    flops = 18 * n * d * f  # three GEMMs per projection, 2 n d f each for the second, twice that for the first
    lines.append(f"| {name} | sum (the six as run) | {total:.3f} | {flops / total / 1e9:.0f} |")


def main(argv=None):
    return options_table.main(__doc__, "training_gemms.py", "Expert GEMMs of a training step (moecompile)",
                              "| shape | GEMM | ms | TF/s |", SHAPES, run, argv)


if __name__ == "__main__":
    main()
