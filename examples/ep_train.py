"""Expert-parallel training: convert a model to MoE, shard its experts over the ranks, train a few steps.

    torchrun --nproc-per-node 2 -m moecompile.examples.ep_train --steps 5
    torchrun --nproc-per-node 8 -m moecompile.examples.ep_train --model gpt2 --experts 16 --batch-size 8

Every rank builds the same model (same seed; --random-init configs, or a local/packaged model), converts its FFNs
with `moecompile.moeize`, and `moecompile.distribute` keeps E/W experts of every block on each rank. Each rank
trains on its own random token batch (causal LM loss + the blocks' aux loss); `all_reduce_gradients` averages the
replicated parameters' gradients and leaves the experts' (already summed over ranks by the all-to-all) out of the
all-reduce. Rank 0 prints the mean loss over ranks and the step time. gloo on CPU, NCCL on GPUs (one per rank).
--save writes an expert-parallel checkpoint (one experts file per rank).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import moecompile
from moecompile import distributed as ep


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node W -m moecompile.examples.ep_train",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-gpt2", help="anything `moecompile convert` takes (default tiny-gpt2, "
                                                        "built from its config with random weights)")
    p.add_argument("--experts", type=int, default=4, help="experts per block (a multiple of the world size)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=0.0)
    p.add_argument("--overlap-degree", type=int, default=1, help="all-to-all chunks pipelined with expert compute")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for peers (then a clear error)")
    p.add_argument("--save", default=None, help="write an expert-parallel checkpoint to this folder at the end")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return train(args)
    except moecompile.MoECompileError as e:
        print(f"ep_train: error: {e}", flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args) -> int:
    from moecompile.conversion import models

    group = ep.init(timeout=args.timeout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    torch.manual_seed(args.seed)  # the same model on every rank
    model = models.load_source(args.model, random_init=True, progress=False).model
    moecompile.moeize(model, experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor,
                      noise=0.1, progress=False)
    moecompile.distribute(model, group, overlap_degree=args.overlap_degree)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own data
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen).to(device)
    if rank == 0:
        local = ep.expert_parameters(model)[0].shape[0]
        print(f"ranks: {world} ({dist.get_backend(group)}), model: {args.model}, experts: {args.experts} "
              f"({local} per rank), top_k: {args.top_k}, tokens per rank: {ids.numel()}, "
              f"overlap degree: {args.overlap_degree}", flush=True)
    times = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        lm_loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss = lm_loss + moecompile.aux_loss(model).to(device)
        loss.backward()
        ep.all_reduce_gradients(model, group)
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        mean /= world
        times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"step {step:4d}  loss {mean.item():.6f}  time {times[-1] * 1e3:9.3f} ms", flush=True)
    if rank == 0:
        print(f"median step time: {statistics.median(times) * 1e3:.3f} ms", flush=True)
    if args.save:
        ep.save(model, args.save, group)
        if rank == 0:
            print(f"saved expert-parallel checkpoint to {args.save}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
