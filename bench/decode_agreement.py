"""How close bf16 prefill logits are to a float32 reference, per decode path: is a cosine below 0.999 against HF eager
bf16 (bench/generate.py's cos column) moecompile's error, or bf16's own sensitivity on a random-weight model?

For each model and batch: the last position's prefill logits of HF eager in float32 (the reference), HF eager in bf16
(dynamic cache), HF in bf16 with a static cache (another attention path), moecompile.generate's compiled prefill in
bf16 with and without inductor; cosine of each with the reference and with HF eager bf16, and the share of rows
whose greedy token differs from the reference's.

    python bench/decode_agreement.py --models mixtral-8x7b,qwen3-30b-a3b --batches 1,16 --out $OUT/agreement.md
"""
from __future__ import annotations

import argparse
import copy

import torch
from generate import build, cos  # bench/generate.py: the same random models at real per-layer sizes

from moecompile.generation import Generator


def last_logits_hf(model, ids, static: bool) -> torch.Tensor:
    from transformers import StaticCache

    kwargs = {}
    if static:
        kwargs["past_key_values"] = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 8)
    with torch.no_grad():
        return model(ids, use_cache=static, **kwargs).logits[:, -1].float()


def last_logits_moecompile(model, ids, inductor: bool) -> torch.Tensor:
    gen = Generator(model, ids.shape[0], ids.shape[1] + 8, options={"inductor": inductor})
    gen.prefill(ids)
    return gen.prefill_logits.float()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--layers", type=int, help="layers of every model (default: each model's in bench/generate.py)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out")
    a = p.parse_args(argv)
    lines = ["| model | batch | path | cos vs fp32 | cos vs HF bf16 | greedy rows differing from fp32 |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name in a.models.split(","):
        model = build(name, a.tiny, a.device, torch.bfloat16, a.layers)
        reference_model = copy.deepcopy(model).float()
        for batch in [int(b) for b in a.batches.split(",")]:
            ids = torch.randint(0, model.config.vocab_size, (batch, a.prompt),
                                generator=torch.Generator().manual_seed(batch)).to(a.device)
            fp32 = last_logits_hf(reference_model, ids, static=False)
            hf = last_logits_hf(model, ids, static=False)
            paths = {"HF eager bf16": hf, "HF bf16, static cache": last_logits_hf(model, ids, static=True)}
            for inductor in (False, True):
                try:
                    paths[f"moecompile{'' if inductor else ', no inductor'}"] = \
                        last_logits_moecompile(model, ids, inductor)
                except Exception as exc:  # a failing path is a row, not the end of the run
                    print(f"| {name} | {batch} | moecompile inductor={inductor} | **{type(exc).__name__}**: "
                          f"{str(exc).splitlines()[0][:120]} |", flush=True)
                torch._dynamo.reset()
            for path, logits in paths.items():
                differ = (logits.argmax(-1) != fp32.argmax(-1)).float().mean().item()
                row = f"| {name} | {batch} | {path} | {cos(logits, fp32):.5f} | {cos(logits, hf):.5f} | {differ:.2f} |"
                print(row, flush=True)
                lines.append(row)
        del model, reference_model
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
