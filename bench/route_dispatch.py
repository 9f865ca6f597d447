"""route_dispatch at decode sizes on CUDA: the one-launch kernel (top-k and dispatch together) against top-k then
dispatch, both after the router GEMM; each as 20 calls captured in a CUDA graph, the mean over 100 replays.
runtime/choices.one_launch_route picks between them from this table.

    python bench/route_dispatch.py > $OUT/route-dispatch.md
"""
from __future__ import annotations

import argparse
import time

import torch

from moecompile.kernels import triton_routing
from moecompile.runtime import choices, graphs
from moecompile.runtime import cuda as C

SHAPES = ((1, 128, 8), (16, 128, 8), (1, 8, 2), (16, 8, 2), (1, 256, 8))  # tokens, experts, top-k


def graph_us(fn, calls: int = 20, replays: int = 100) -> float:
    """Mean time per call of fn, `calls` of them captured in one CUDA graph, over `replays` replays."""
    graph, _ = graphs.capture(lambda: [fn() for _ in range(calls)], warmup=3)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (replays * calls) * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, hidden {args.hidden}, bf16 router, us per call\n")
    print("| tokens | experts | top-k | one launch | top-k, then dispatch | runtime picks |\n|---|---|---|---|---|---|")
    fits, one_launch = triton_routing.route_dispatch_fits, choices.one_launch_route
    for tokens, experts, top_k in SHAPES:
        x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(experts, args.hidden, device="cuda", dtype=torch.bfloat16)

        def call():
            return C.route_dispatch(x, w, None, top_k, 0.0, True, "softmax", None, 1, 1, 1.0, False)

        picks = "one launch" if one_launch(tokens, experts) else "top-k, then dispatch"
        try:
            with torch.no_grad():
                choices.one_launch_route = lambda *a: True
                fused = graph_us(call)
                triton_routing.route_dispatch_fits = lambda *a: False
                separate = graph_us(call)
        finally:
            triton_routing.route_dispatch_fits, choices.one_launch_route = fits, one_launch
        print(f"| {tokens} | {experts} | {top_k} | {fused:.2f} | {separate:.2f} | {picks} |", flush=True)


if __name__ == "__main__":
    main()
