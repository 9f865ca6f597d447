"""Milliseconds per layer-wise distillation step (forward + backward of masked_forward on 1024 tokens, the default
batch) at MiniLM's FFN size split into 16 experts, with the routed experts run densely (every expert on every
token, masked) and sparsely (each expert on its own tokens), for the recipes' routed top_k and shared experts.

    OMP_NUM_THREADS=2 python bench/distill_step_time.py [--steps 20]
"""
import argparse
import time

import torch

from moecompile import MoEBlock, MoEConfig
from moecompile.calibration.masked import masked_forward, routed_dense, routed_sparse

# (label, routed experts, routed top_k, shared experts): the top_k 8 and 4 recipes, and a denser routing
CASES = [("top_k 8 recipe", 10, 2, 6), ("top_k 4 recipe", 14, 2, 2), ("5 of 10 routed", 10, 5, 6)]


def step_ms(block: MoEBlock, x: torch.Tensor, top_k: int, routed, steps: int) -> float:
    for _ in range(3):
        masked_forward(block, x, top_k, routed).square().sum().backward()
    start = time.perf_counter()
    for _ in range(steps):
        block.zero_grad()
        masked_forward(block, x, top_k, routed).square().sum().backward()
    return (time.perf_counter() - start) / steps * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads")
    for label, routed, k, shared in CASES:
        cfg = MoEConfig(hidden_size=384, expert_size=96, num_experts=routed, top_k=k, activation="gelu",
                        bias_in=True, bias_out="shared", router_bias=True, compensation=True,
                        shared_expert_size=96 * shared)
        block = MoEBlock(cfg).float().eval()
        x = torch.randn(1024, 384)
        dense, sparse = (step_ms(block, x, k, fn, a.steps) for fn in (routed_dense, routed_sparse))
        print(f"{label}: dense {dense:.1f} ms, sparse {sparse:.1f} ms per step")


if __name__ == "__main__":
    main()
