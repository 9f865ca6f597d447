"""`convert --method split --calib SOURCE`: calibrate, measure, and write report.json / report.png beside the
checkpoint (and print the table)."""
from __future__ import annotations

import io
import json
import logging
import random
import time

import torch

from moecompile.calibration import data as calib_data
from moecompile.calibration.calibrate import calibrate_model
from moecompile.calibration.config import CalibRun
from moecompile.calibration.e2e import Judge
from moecompile.calibration.evaluate import ffn_flops, headline, model_outputs, quality_curve, worst_source
from moecompile.calibration.tokens import load_tokenizer, token_batches
from moecompile.ir.block import MoEBlock

log = logging.getLogger("moecompile")
IN_DOMAIN = "stdlib"  # the evaluation source from the calibration text's own domain (held-out packages)


def calibration_texts(source: str, seed: int = 0, words: list[str] = (), rate: float = 0.0) -> list[str]:
    """Calibration text in the order token_batches takes it until its token budget. stdlib: single sentences of
    the standard library's docstrings, comments and reference (and with `words`, `rate`: the vocabulary-substituted
    copies of data.stdlib_mix), interleaved so every part gets about an equal share; mixed: that and the packaged
    text of other projects (data.other_sentences), interleaved; a FILE: its paragraphs (shuffled), then the mixed
    text, which fills the budget when the file is small."""
    mix = calib_data.stdlib_mix("calib", seed, words, rate)
    if source == "stdlib":
        return mix
    mix = calib_data.interleave([mix, list(calib_data.other_sentences())], seed)
    if source == "mixed":
        return mix
    own = calib_data.read_text_file(source)
    return random.Random(seed).sample(own, len(own)) + mix


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
    key = headline(next(iter(curve[0]["sources"].values())))[0]
    for name in curve[0]["sources"]:
        a.plot([r["ffn_flop_fraction"] for r in curve], [r["sources"][name][key] for r in curve], "o-",
               label=f"{name} (in-domain)" if name == IN_DOMAIN else name)
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
            counts[name] = torch.zeros(m.config.num_experts, device=next(m.parameters()).device)

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


def print_curve(curve: list[dict]) -> None:
    """The quality table: per top_k, each source's headline number and the worst out-of-domain source's."""
    if not curve:
        return
    names = list(curve[0]["sources"])
    key = headline(curve[0]["sources"][names[0]])[0]
    width = max(len(n) for n in names + ["worst other"])
    print(f"  {key} vs dense per held-out source ({IN_DOMAIN}: in-domain; worst other: the worst of the rest)")
    print("  top_k  ffn_flop_fraction  " + "  ".join(f"{n:>{width}}" for n in names + ["worst other"]))
    for row in curve:
        cells = [headline(row["sources"][n])[1] for n in names]
        others = [n for n in names if n != IN_DOMAIN]
        cells.append(worst_source(row, skip=(IN_DOMAIN,))[1] if others else float("nan"))
        print(f"  {row['top_k']:5d}  {row['ffn_flop_fraction']:17.3f}  " + "  ".join(f"{c:>{width}.4f}" for c in cells))


def run_calibration(model, directory, run: CalibRun, progress: bool = True,
                    monitor: dict[str, list[str]] | None = None) -> dict[str, bytes]:
    """Calibrate model in place as `run` says (on run.device; the model comes back to its own device); returns the
    report files to save with the checkpoint. `monitor` (measurement only): more {name: sentences} the end-to-end
    stage is scored on along the way, into the report's `e2e_history`, none of them choosing anything."""
    cfg = run.recipe
    home = next(model.parameters()).device
    device = torch.device(run.device)
    model.to(device)
    tokenize = load_tokenizer(directory, model)
    start = time.perf_counter()
    try:
        texts = calibration_texts(run.source, cfg.seed, tokenize.words(), run.vocab_rate)
        calib = token_batches(tokenize, texts, run.tokens, seed=cfg.seed, shuffle=False, device=device)
        sources = calib_data.eval_sources(run.eval_sentences, seed=cfg.seed + 1) if run.eval_sentences > 0 else {}

        def batches(texts):
            return token_batches(tokenize, texts, 10**9, shuffle=False, device=device)

        held = {name: batches(texts) for name, texts in sources.items()}
        dense_outs = {name: model_outputs(model, b) for name, b in held.items()}
        judge = None
        if cfg.e2e_steps and cfg.e2e_judge_every:
            sets = {"select": calib_data.stdlib_mix("select", cfg.seed)[:run.select_sentences],
                    **(monitor or {})}
            judge = Judge.of(model, {n: batches(t) for n, t in sets.items()}, cfg.e2e_judge_every,
                             "select" if cfg.e2e_keep_best else None)
        rows = calibrate_model(model, calib, cfg, layers=run.layers, progress=progress, judge=judge)
        seconds = time.perf_counter() - start
        blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
        # dense FFN: `experts` expert-equivalents per block
        dense_flops = sum(cfg.experts * (ffn_flops(b.config, 1) - ffn_flops(b.config, 0)) for b in blocks)
        tokens = sum(int(b["attention_mask"].sum()) for b in calib)
        report = {"model": run.model_name,
                  "calibration": {"source": run.source, "tokens": tokens, "seconds": seconds, "device": str(device)},
                  "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
                  "eval_sources": {name: len(texts) for name, texts in sources.items()}, "in_domain": IN_DOMAIN,
                  "e2e_history": judge.history if judge is not None else [],
                  "layers": [{k: v for k, v in r.items() if k not in ("groups", "shared")} for r in rows]}
        report["curve"] = quality_curve(model, dense_outs, held, cfg, dense_flops, progress) if held else []
        loads = _loads(model, held[IN_DOMAIN]) if IN_DOMAIN in held else {}
    finally:
        model.to(home)
    for r in report["layers"]:
        r["flop_fraction"] = ffn_flops(model.get_submodule(r["path"]).config, cfg.routed_k(cfg.top_k)) / (
            dense_flops / max(len(blocks), 1))
        r["load"] = loads.get(r["path"], [])
    print(f"calibrated on {report['calibration']['tokens']} tokens in {seconds:.0f} s")
    print_curve(report["curve"])
    files = {"report.json": (json.dumps(report, indent=2) + "\n").encode()}
    png = _plot(report) if report["curve"] else None
    if png:
        files["report.png"] = png
    return files
