"""Tile configs of the persistent Triton grouped GEMM at the Qwen3-MoE shape (issues 9, 10): which to autotune over.

On the device:  python bench/persistent_tiles.py 16384   (tokens; output: bench/results/gpu-persistent-tiles.md)

Same dispatched rows (random router, dropless) and weights as bench/expert_gemms.py; median ms of each projection
with each tile config, beside the autotuned choice and the autotuned kernel on perfectly balanced groups (the
difference is what the partial last row tile of each expert costs).
"""
import itertools
import sys

import options_table
import torch
from options_table import ms

from moecompile.kernels import triton_moe

d, f, e, k, tokens = 2048, 768, 128, 8, int(sys.argv[1]) if len(sys.argv) > 1 else 16384
w_in, w_out, rows, offsets, g = options_table.dispatched_layer(d, f, e, k, tokens)
a = torch.randn(rows.shape[0], f, generator=g, device=rows.device, dtype=torch.bfloat16)
n = rows.shape[0]
balanced = torch.arange(1, e + 1, device=rows.device, dtype=offsets.dtype) * (n // e)
counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
print("rows per expert min/mean/max", counts.min().item(), counts.float().mean().item(), counts.max().item())
print("partial tile waste at BM128:", ((counts + 127) // 128 * 128).sum().item() / n - 1)
first = lambda c, o=offsets: triton_moe.grouped_ffn_in(rows, o, w_in, None, "silu", True, c, "triton_persistent")
second = lambda c, o=offsets: triton_moe.grouped_ffn_in(a, o, w_out, None, None, False, c, "triton_persistent")
for name, fn in (("first", first), ("second", second)):
    print(name, "autotuned", f"{ms(lambda: fn(None)):.3f}", "balanced", f"{ms(lambda: fn(None, balanced)):.3f}",
          flush=True)
    block_n = (128, 256) if name == "second" else (64, 128)
    configs = [dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, GROUP_M=gm, num_warps=8, num_stages=s)
               for bn, s, gm in itertools.product(block_n, (3, 4, 5), (4, 8, 16))]
    configs += [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=s)
                for bk, s in ((32, 6), (32, 8), (128, 2))]
    best = []
    for c in configs:
        try:
            t = ms(lambda: fn(c))
        except Exception as ex:  # shared memory: too many stages for the tile
            print(name, c, "failed", str(ex)[:60])
            continue
        best.append((t, c))
        print(name, c, f"{t:.3f}", flush=True)
    best.sort(key=lambda r: r[0])
    print("BEST", name, best[:3])
