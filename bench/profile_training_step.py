"""Where a training step of one MoE layer spends its GPU time: moecompile's MoEBlock (eager, bf16), forward +
backward, under torch.profiler; the CUDA kernels by total time.

    python bench/profile_training_step.py --shape qwen3-moe           # on the device (the quack extra if installed)

Gradients accumulate across the profiled steps (no zero_grad), as a training loop with gradient accumulation does:
the accumulation adds appear in the table beside the step's own kernels.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_layer  # noqa: E402  (beside this script)
from fine_grained import SHAPES  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-moe", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=25, help="kernels listed")
    a = p.parse_args(argv)
    d, f, e, k, tokens = SHAPES[a.shape]
    ours, _ = moe_layer.build(d, f, e, k)
    x = torch.randn(1, tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    ours.train()
    for _ in range(3):  # compiles, autotuning and allocator warm-up outside the profile
        ours(x).backward(grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            ours(x).backward(grad)
        torch.cuda.synchronize()
    print(f"{a.shape} ({d}, {f}, {e}, {k}, {tokens}), {a.steps} steps, {torch.cuda.get_device_name()}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
