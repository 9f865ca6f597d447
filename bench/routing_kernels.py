"""The routing kernels of a prefill-sized MoE layer, each alone and at each tile: where do the layer's launches
beside its GEMMs go, and which top-k tile and rank block run fastest?

On the device:  python bench/routing_kernels.py --out bench/results/gpu-routing-kernels.md

Random bf16 tokens and router (d columns, E experts, top-k softmax, renormalised, dropless). Microseconds a call,
from 20 calls captured in one CUDA graph (device time: a Python launch of a few-microsecond kernel takes longer than
the kernel), the median of 5 replays, of each step as the runtime runs it ("as run"), and of the top-k kernel at
each token block and warp count, plain and ranked (ranked=True: dispatch's rank kernel folded in), and of dispatch
(rank, running sum, scatter; no row copy) at each rank block. check: the variant's expert ids (top-k) or order and
offsets (dispatch) equal the as-run ones.
"""
from __future__ import annotations

import itertools
import statistics
import time

import options_table
import torch

from moecompile.core.logits import float32_logits
from moecompile.kernels import triton_moe, triton_routing
from moecompile.runtime import graphs

SHAPES = {"qwen3-moe": (2048, 128, 8, 8192), "sonic-7b": (1536, 128, 8, 24576), "sonic-30b": (4096, 128, 8, 32768),
          "deepseek-v3": (7168, 256, 8, 4096)}
TOPK_TILES = list(itertools.product((4, 8, 16, 32, 64), (1, 2, 4, 8)))  # tokens a program, warps
RANK_BLOCKS = (32, 64, 128, 256)
CALLS = 20


def graph_us(fn) -> float:
    graph, _ = graphs.capture(lambda: [fn() for _ in range(CALLS)])
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(times)


def run(name, d, e, k, tokens, lines):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, d, generator=g, device="cuda", dtype=torch.bfloat16)
    router = torch.randn(e, d, generator=g, device="cuda", dtype=torch.bfloat16) * d ** -0.5
    logits = float32_logits(x, router)
    weights, ids = triton_routing.topk(logits, k, True)
    _, order, offsets = triton_routing.dispatch(x, ids, e, copy_rows=False)

    def row(label, fn, check=""):
        lines.append(f"| {name} | {d}, {e}, {k}, {tokens} | {label} | {graph_us(fn):.1f} | {check} |")
        print(lines[-1], flush=True)

    def routing():
        w, i = triton_routing.topk(logits, k, True)
        _, o, off = triton_routing.dispatch(x, i, e, copy_rows=False)
        return triton_routing.gather_indices(o, off, k), triton_moe.row_of_assignments(o)

    row("router GEMM (float32 out), as run", lambda: float32_logits(x, router))
    row("top-k, as run", lambda: triton_routing.topk(logits, k, True))
    row("dispatch without rows (rank, sum, scatter), as run",
        lambda: triton_routing.dispatch(x, ids, e, copy_rows=False))
    row("group starts + each row's token (gather_indices), as run",
        lambda: triton_routing.gather_indices(order, offsets, k))
    row("inverse permutation (the combine's), as run", lambda: triton_moe.row_of_assignments(order))
    row("all of the above but the router GEMM, as run", routing)

    def ranked_dispatch(**tile):
        _, i, ranks = triton_routing.topk(logits, k, True, ranked=True, **tile)
        return triton_routing.dispatch(x, i, e, copy_rows=False, ranks=ranks)

    _, o, off = ranked_dispatch()
    row("ranked top-k, then dispatch without its rank kernel", ranked_dispatch,
        "ok" if torch.equal(o, order) and torch.equal(off, offsets) else "DIFFERS")
    row("top-k, then dispatch, as run",
        lambda: triton_routing.dispatch(x, triton_routing.topk(logits, k, True)[1], e, copy_rows=False))
    for (block_t, warps), ranked in itertools.product(TOPK_TILES, (False, True)):
        label = f"top-k{', ranked' if ranked else ''}, {block_t} tokens, {warps} warps"
        try:
            got = triton_routing.topk(logits, k, True, block_t=block_t, num_warps=warps, ranked=ranked)[1]
        except Exception as err:  # a tile Triton cannot compile (registers, shared memory) is a row, not a crash
            lines.append(f"| {name} | {d}, {e}, {k}, {tokens} | {label} | {type(err).__name__} | |")
            continue
        row(label, lambda b=block_t, w=warps, r=ranked: triton_routing.topk(logits, k, True, block_t=b, num_warps=w,
                                                                           ranked=r),
            "ok" if torch.equal(got, ids) else "DIFFERS")
    for block in RANK_BLOCKS:
        _, o, off = triton_routing.dispatch(x, ids, e, copy_rows=False, rank_block=block)
        row(f"dispatch without rows, rank block {block}",
            lambda b=block: triton_routing.dispatch(x, ids, e, copy_rows=False, rank_block=b),
            "ok" if torch.equal(o, order) and torch.equal(off, offsets) else "DIFFERS")


def main(argv=None):
    return options_table.main(__doc__, "routing_kernels.py", "Routing kernels of a prefill-sized layer (moecompile)",
                              "| shape | d, E, k, tokens | kernel | us | check |", SHAPES, run, argv)


if __name__ == "__main__":
    main()
