"""Hello world for moecompile: train one MoE layer, in the spirit of Tutel's helloworld.

Builds a single `moecompile.MoEBlock` (router -> dispatch -> grouped expert FFN -> combine) from a
`moecompile.MoEConfig`, then runs a few optimizer steps regressing a fixed random batch of inputs onto a fixed
random target with MSE plus the block's load-balancing `aux_loss`. It prints the configuration, each step's
loss and time, and finally the median step time and throughput in tokens/s, so it doubles as a smoke test
(the loss must go down) and a quick benchmark of the MoE ops on the chosen device:

    python -m moecompile.examples.helloworld --batch-size 32 --experts 4 --top-k 2
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

import moecompile
from moecompile.ir.config import ACTIVATIONS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moecompile.examples.helloworld", description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256, help="model (hidden) size H")
    p.add_argument("--ffn", type=int, default=1024, help="hidden neurons per expert")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=0.0,
                   help="> 0 fixed capacity (overflow dropped), 0 dropless, < 0 dropless up to a cap")
    p.add_argument("--activation", choices=ACTIVATIONS, default="gelu")
    p.add_argument("--gated", action="store_true", help="gated experts: act(x W_gate) * (x W_up)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--lr", type=float, default=None,
                   help="default 3e-3 for adam, 30 for sgd (the MSE averages over every element, "
                   "so plain SGD needs a large lr)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="default bfloat16 on cuda, float32 elsewhere")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 3e-3 if args.optimizer == "adam" else 30.0
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(args.seed)

    config = moecompile.MoEConfig(hidden_size=args.hidden, expert_size=args.ffn, num_experts=args.experts,
                                  top_k=args.top_k, capacity_factor=args.capacity_factor,
                                  activation=args.activation, gated=args.gated)
    block = moecompile.MoEBlock(config).to(device=device, dtype=dtype).train()
    params = list(block.parameters())
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(params, lr=args.lr)
    else:
        optimizer = torch.optim.SGD(params, lr=args.lr)

    x = torch.randn(args.batch_size, args.seq_len, args.hidden, device=device, dtype=dtype)
    target = torch.randn(args.batch_size, args.seq_len, args.hidden, device=device, dtype=dtype)
    tokens = args.batch_size * args.seq_len
    is_cuda = device.type == "cuda"

    info = {
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if is_cuda else ""),
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens": tokens,
        "hidden": args.hidden,
        "ffn": args.ffn,
        "experts": args.experts,
        "top_k": args.top_k,
        "capacity_factor": args.capacity_factor,
        "activation": config.activation,
        "gated": config.gated,
        "optimizer": f"{args.optimizer} (lr {args.lr:g})",
        "steps": args.steps,
        "parameters": sum(p.numel() for p in params),
    }
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}} : {value}")
    print(block)

    times = []
    for step in range(1, args.steps + 1):
        if is_cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        out = block(x)
        mse = F.mse_loss(out.float(), target.float())
        aux = block.aux_loss if block.aux_loss is not None else torch.zeros((), device=device)
        loss = mse + aux
        loss.backward()
        optimizer.step()
        if is_cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        print(f"step {step:4d}  loss {loss.item():.6f}  (mse {mse.item():.6f}, aux {aux.item():.6f})  "
              f"time {elapsed * 1e3:9.3f} ms", flush=True)

    median = statistics.median(times)
    print(f"median step time: {median * 1e3:.3f} ms")
    print(f"throughput: {tokens / median:,.0f} tokens/s")
    if not math.isfinite(loss.item()):
        print("warning: loss is not finite")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
