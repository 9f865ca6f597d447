"""`convert --method split --calib SOURCE`: calibrate, measure, and write report.json / report.png beside the
checkpoint (and print the table)."""
from __future__ import annotations

import io
import json
import logging
import time

import torch

from moecompile.calibration import data as calib_data
from moecompile.calibration.calibrate import calibrate_model
from moecompile.calibration.config import CalibRun
from moecompile.calibration.evaluate import ffn_flops, model_outputs, quality_curve
from moecompile.calibration.tokens import load_tokenizer, token_batches
from moecompile.ir.block import MoEBlock

log = logging.getLogger("moecompile")


def calibration_texts(source: str) -> list[str]:
    """stdlib: single docstring sentences (cheaper per end-to-end step than paragraphs); a FILE: its paragraphs."""
    if source == "stdlib":
        return calib_data.sentences(calib_data.corpus("calib"))
    return calib_data.read_text_file(source)


def _plot(report: dict) -> bytes | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'moecompile[calib]'): no report.png")
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    curve = report["curve"]
    key = "mean_cosine" if curve and "mean_cosine" in curve[0] else "perplexity"
    a.plot([r["ffn_flop_fraction"] for r in curve], [r[key] for r in curve], "o-", label="calibrated split")
    a.set_xlabel("fraction of dense FFN FLOPs")
    a.set_ylabel(key.replace("_", " ") + " vs dense")
    a.grid(True, alpha=0.3)
    a.legend()
    for row in report["layers"]:
        b.plot(row["load"], alpha=0.7, label=row["path"])
    b.set_xlabel("expert")
    b.set_ylabel("fraction of routed assignments (held-out)")
    b.legend(fontsize=6)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


@torch.no_grad()
def _loads(model, batches) -> dict[str, list[float]]:
    counts = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, MoEBlock):
            counts[name] = torch.zeros(m.config.num_experts)

            def hook(mod, args, name=name):
                x = args[0].reshape(-1, args[0].shape[-1])
                if mod.config.top_k > 0:
                    ids = mod.router_logits(x).topk(mod.config.top_k, dim=-1).indices
                    counts[name] += torch.bincount(ids.flatten(), minlength=mod.config.num_experts).float()
            hooks.append(m.register_forward_pre_hook(hook))
    try:
        model_outputs(model, batches)
    finally:
        for h in hooks:
            h.remove()
    return {k: (v / v.sum().clamp_min(1)).tolist() for k, v in counts.items()}


def run_calibration(model, directory, run: CalibRun, progress: bool = True) -> dict[str, bytes]:
    """Calibrate model in place as `run` says; returns the report files to save with the checkpoint."""
    cfg = run.recipe
    tokenize = load_tokenizer(directory, model)
    start = time.perf_counter()
    calib = token_batches(tokenize, calibration_texts(run.source), run.tokens, seed=cfg.seed)
    held = []
    if run.eval_sentences > 0:
        sentences = calib_data.sentences(calib_data.corpus("heldout"))
        held = token_batches(tokenize, sentences, 10**9, seed=cfg.seed + 1)
        held = [b for b in held][: max(1, run.eval_sentences // 32)]
    dense_outs = model_outputs(model, held) if held else []
    rows = calibrate_model(model, calib, cfg, layers=run.layers, progress=progress)
    seconds = time.perf_counter() - start
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    # dense FFN: `experts` expert-equivalents per block
    dense_flops = sum(cfg.experts * (ffn_flops(b.config, 1) - ffn_flops(b.config, 0)) for b in blocks)
    tokens = sum(int(b["attention_mask"].sum()) for b in calib)
    report = {"model": run.model_name, "calibration": {"source": run.source, "tokens": tokens, "seconds": seconds},
              "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
              "layers": [{k: v for k, v in r.items() if k not in ("groups", "shared")} for r in rows]}
    report["curve"] = quality_curve(model, dense_outs, held, cfg, dense_flops, progress) if held else []
    loads = _loads(model, held) if held else {}
    for r in report["layers"]:
        r["flop_fraction"] = ffn_flops(model.get_submodule(r["path"]).config, cfg.routed_k(cfg.top_k)) / (
            dense_flops / max(len(blocks), 1))
        r["load"] = loads.get(r["path"], [])
    print(f"calibrated on {report['calibration']['tokens']} tokens in {seconds:.0f} s")
    for row in report["curve"]:
        q = " ".join(f"{k} {v:.4f}" for k, v in row.items() if k not in ("top_k", "ffn_flop_fraction"))
        print(f"  top_k {row['top_k']:2d}  ffn_flop_fraction {row['ffn_flop_fraction']:.3f}  {q}")
    files = {"report.json": (json.dumps(report, indent=2) + "\n").encode()}
    png = _plot(report) if report["curve"] else None
    if png:
        files["report.png"] = png
    return files
