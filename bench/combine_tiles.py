"""The combine kernel (kernels/triton_moe.py: each token gathers its k expert-order rows and sums them weighted) at
each tile, at the fine-grained and coarse layer shapes: which tile reads the rows nearest the copy rate?

On the device:  python bench/combine_tiles.py --out bench/results/gpu-combine-tiles.md

Random rows [tokens x k, d] in expert order (bf16) from a random router's top-k and moecompile's dispatch (dropless);
median ms (triton's do_bench) of triton_moe.combine at each tile: BLOCK_T tokens x BLOCK_H columns per program, and
its warps; "as run": the runtime's (runtime/cuda.py's combine). The rate counts the rows read and the output written,
as a share of the run's copy bandwidth. err: against kernels/reference.py's combine in float32.
"""
from __future__ import annotations

import itertools

import moe_layer
import options_table
import torch

from moecompile.kernels import reference, triton_moe, triton_routing
from moecompile.runtime import cuda as runtime

SHAPES = {"qwen3-moe": (2048, 128, 8, 8192), "sonic-7b": (1536, 128, 8, 24576), "sonic-30b": (4096, 128, 8, 32768),
          "deepseek-v3": (7168, 256, 8, 4096), "mixtral": (4096, 8, 2, 4096)}
# BLOCK_T, BLOCK_H, warps; few tokens by wide columns too (a token per program reading its k whole rows, as
# SonicMoE's gather-sum does)
TILES = (list(itertools.product((8, 16, 32), (128, 256, 512, 1024), (4, 8)))
         + list(itertools.product((1, 2, 4), (512, 1024, 2048), (4, 8))))


def run(name, d, e, k, tokens, lines):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, d, generator=g, device="cuda", dtype=torch.bfloat16)
    weights, ids = triton_routing.topk(torch.randn(tokens, e, generator=g, device="cuda"), k, True)
    _, order, _ = triton_routing.dispatch(x, ids, e, copy_rows=False)
    rows = torch.randn(order.shape[0], d, generator=g, device="cuda", dtype=torch.bfloat16)
    want = reference.combine(rows.float(), order, weights)
    nbytes = (rows.numel() + tokens * d) * rows.element_size()
    bandwidth = moe_layer.copy_bandwidth()
    variants = [("as run", lambda: runtime.combine(rows, order, weights))]
    variants += [(f"{t} x {h}, {w} warps", lambda t=t, h=h, w=w: triton_moe.combine(rows, order, weights, t, h, w))
                 for t, h, w in TILES]
    for label, fn in variants:
        out = fn()
        err = ((out.float() - want).norm() / want.norm()).item()
        lines.append(f"| {name} | {d}, {e}, {k}, {tokens} | {label} | "
                     f"{moe_layer.rate(options_table.ms(fn), nbytes, bandwidth)} | {err:.1e} |")
        print(lines[-1], flush=True)


def main(argv=None):
    return options_table.main(__doc__, "combine_tiles.py", "The combine kernel per tile (moecompile)",
                              "| shape | d, E, k, tokens | tile | ms (rate) | err |", SHAPES, run, argv)


if __name__ == "__main__":
    main()
