"""Host time per call of each moecompile op on the GPU, through torch.ops (the custom-op dispatch inductor's code
takes) and its kernel function called directly, at the Qwen3-MoE layer shape (4096 tokens, hidden 2048, 128 experts
of 768, top-8), after a synchronize so the launch queue is empty; then a cProfile of the direct calls. Why: at 4096
tokens the compiled Qwen3-MoE-like model is host-bound in inductor's default mode (bench/results/compile-*.md).

    python bench/op_host_cost.py > bench/results/gpu-op-host-cost.txt
"""
import cProfile
import io
import pstats
import time

import torch

import moecompile  # noqa: F401  registers ops
from moecompile.runtime import cuda as K

T, H, F, E, k = 4096, 2048, 768, 128, 8
dev = "cuda"
torch.manual_seed(0)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
rw = torch.randn(E, H, device=dev, dtype=torch.bfloat16) * H ** -0.5
w_in = torch.randn(E, 2 * F, H, device=dev, dtype=torch.bfloat16) * H ** -0.5
w_out = torch.randn(E, H, F, device=dev, dtype=torch.bfloat16) * F ** -0.5
op = torch.ops.moecompile
rd_args = (x, rw, None, k, 0.0, True, "softmax", None, 1, 1, 1.0, True)
wts, ids, rows, order, offs = op.route_dispatch(*rd_args)
y = op.experts(rows, offs, w_in, None, w_out, None, "silu", True)
out = op.combine(y, order, wts)
torch.cuda.synchronize()

cases = {
    "route_dispatch op": lambda: op.route_dispatch(*rd_args),
    "route_dispatch direct": lambda: K.route_dispatch(*rd_args),
    "experts op": lambda: op.experts(rows, offs, w_in, None, w_out, None, "silu", True),
    "experts direct": lambda: K.experts(rows, offs, w_in, None, w_out, None, "silu", True),
    "combine op": lambda: op.combine(y, order, wts),
    "combine direct": lambda: K.combine(y, order, wts),
    "torch.mm": lambda: torch.mm(x, rw.t()),
    "empty": lambda: torch.empty(16, device=dev),
}
for mode in ("plain", "inference_mode"):
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with ctx:
        for name, fn in cases.items():
            fn()
            torch.cuda.synchronize()
            n = 30
            # synchronized before each call (a full launch queue would block it): the call's own host time
            ts = []
            for _ in range(n):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            ts.sort()
            print(f"{mode:15s} {name:24s} host median {ts[n // 2] * 1e6:8.1f} us  min {ts[0] * 1e6:8.1f} us",
                  flush=True)

with torch.inference_mode():
    for name in ("route_dispatch direct", "experts direct", "combine direct", "experts op"):
        pr = cProfile.Profile()
        torch.cuda.synchronize()
        pr.enable()
        for _ in range(20):
            cases[name]()
            torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        print(f"==== cProfile {name} (20 calls, synced)\n" + "\n".join(s.getvalue().splitlines()[:40]), flush=True)
