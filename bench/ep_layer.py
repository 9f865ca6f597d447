"""Expert-parallel MoE layer: step time against the same layer unsharded, for several overlap degrees (issue 4), and
the per-call switch to data-parallel execution (parallel="dp": expert weights all-gathered, no token all-to-all).

    torchrun --nproc-per-node 2 bench/ep_layer.py --out bench/results/ep-layer-cpu.md            # CPU, gloo
    torchrun --nproc-per-node 8 bench/ep_layer.py --shape mixtral --out bench/results/gpu-ep-layer.md   # GPUs, NCCL

Weak scaling: every rank routes its own `tokens`; "local" is the whole layer (all E experts) on one rank's tokens
with no communication, "EP d" the same layer with its experts sharded over the W ranks, overlap degree d. Times are
medians over --reps of the slowest rank (ms), forward and forward + backward. "counts" is the counts exchange
alone (one small all-to-all + the host sync that gives the split sizes). err: EP output against the local layer
on the same tokens (relative Frobenius); it must be rounding only. "DP" runs the same sharded block with
parallel="dp": each rank all-gathers the E experts' weights (the backward reduce-scatters their gradients) and runs
them on its own tokens; no weight moves between calls.
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moecompile import MoEBlock, MoEConfig
from moecompile import distributed as ep
from moecompile.parallel.all_to_all import exchange_counts

SHAPES = {  # name: (d, f, E, k, tokens per rank)
    "tiny": (64, 128, 8, 2, 512),
    "gpt2-upcycled": (768, 3072, 16, 2, 16384),
    "mixtral": (4096, 14336, 8, 2, 4096),
    "qwen3-moe": (2048, 768, 128, 8, 8192),
}


def timed(fn, reps: int, device) -> float:
    """Median ms of fn over reps, each the slowest rank's (barrier before, sync after)."""
    times = []
    for _ in range(reps + 2):  # two warm-up calls
        dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item() * 1e3)
    return statistics.median(times[2:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None, help="write the results table (markdown) here (rank 0)")
    args = p.parse_args(argv)
    group = ep.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    d, f, e, k, tokens = SHAPES[args.shape]
    torch.manual_seed(0)
    local = MoEBlock(MoEConfig(hidden_size=d, expert_size=f, num_experts=e, top_k=k, capacity_factor=0.0,
                               activation="silu", gated=True)).to(device, dtype).train()
    sharded = ep.distribute(copy.deepcopy(local))
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(1 + rank)).to(device, dtype)
    grad = torch.randn_like(x)

    def fwd(block):
        with torch.no_grad():
            block(x)

    def train(block):
        xg = x.detach().requires_grad_()
        block(xg).backward(grad)

    rows = [("local (all experts, no communication)", timed(lambda: fwd(local), args.reps, device),
             timed(lambda: train(local), args.reps, device), "")]
    with torch.no_grad():
        want = local(x).float()
    for degree in [int(v) for v in args.degrees.split(",")]:
        sharded.overlap_degree = degree
        with torch.no_grad():
            got = sharded(x).float()
        err = torch.tensor([((got - want).norm() / want.norm()).item()], device=device)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        rows.append((f"EP, overlap degree {degree}", timed(lambda: fwd(sharded), args.reps, device),
                     timed(lambda: train(sharded), args.reps, device), f"{err.item():.1e}"))
    sharded.overlap_degree = 1
    with torch.no_grad():
        got = sharded(x, parallel="dp").float()
    err = torch.tensor([((got - want).norm() / want.norm()).item()], device=device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)

    def fwd_dp():
        with torch.no_grad():
            sharded(x, parallel="dp")

    def train_dp():
        sharded(x.detach().requires_grad_(), parallel="dp").backward(grad)

    rows.append(("DP (expert weights all-gathered)", timed(fwd_dp, args.reps, device),
                 timed(train_dp, args.reps, device), f"{err.item():.1e}"))
    offsets = torch.cumsum(torch.full((e,), tokens * k // e, device=device), 0).to(torch.int32)
    counts_ms = timed(lambda: exchange_counts(offsets, tokens * k, world, e // world, 1,
                                                 sharded.group_name), args.reps, device)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine()
        lines = [f"# Expert-parallel MoE layer ({args.shape})", "",
                 f"Device: {world} x {name} ({dist.get_backend(group)}); torch {torch.__version__}, python "
                 f"{platform.python_version()}.",
                 f"Command: `torchrun --nproc-per-node {world} bench/ep_layer.py {' '.join(sys.argv[1:])}`.",
                 f"SwiGLU layer d={d}, f={f}, E={e} ({e // world} per rank), top-{k}, dropless, {tokens} tokens per "
                 f"rank, {str(dtype).replace('torch.', '')}; median ms of the slowest rank over {args.reps} reps.",
                 "", "| layer | forward | forward + backward | err vs local |", "|---|---|---|---|"]
        lines += [f"| {label} | {fw:.3f} | {tr:.3f} | {err} |" for label, fw, tr, err in rows]
        lines += ["", f"Counts exchange alone (all-to-all of {e} counts + host sync): {counts_ms:.3f} ms.", ""]
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
