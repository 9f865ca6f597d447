"""How far FP8 weights alone move the logits of generate.py's random models, in plain transformers math on any device:
the model as built against the same model with every tensor the FP8 path reads in FP8 (experts and the layers'
linears but the routers, as transformers' FineGrainedFP8 layout) quantised to 128 x 128 blocks and dequantised back,
which are exactly the weights the FP8 kernels multiply by. No moecompile kernel runs, so the gap measured here is the
format's, not an implementation's. Per layer it also reports the share of tokens whose set of routed experts changed:
a flipped choice replaces a whole expert's output, the mechanism by which a small weight error grows with depth.

  python bench/fp8_drift.py --models mixtral-8x7b,qwen3-30b-a3b --out bench/results/fp8-drift-cpu.md
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
from generate import MODELS, build, fp8_parameters, make_config  # bench/generate.py, beside this script

from moecompile.core.fp8_format import dequantize_blocks, quantize_blocks


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def round_trip_fp8(model, chosen: frozenset[str]) -> None:
    """Every parameter in `chosen` replaced in place by its FP8 block quantisation, dequantised (one 2-D slice at a
    time: the float32 working copy of a whole expert tensor would be 4x its size)."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname in chosen:
                for w in (p.data if p.dim() == 3 else p.data[None]):
                    w.copy_(dequantize_blocks(*quantize_blocks(w.float())).to(w.dtype))


def routed_sets(model, top_k: int, into: list) -> list:
    """Hooks appending each router's chosen expert set per token (sorted ids) to `into`; returns the handles."""
    def hook(module, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        into.append(logits.float().topk(top_k, -1).indices.sort(-1).values)
    return [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith(".mlp.gate")]


def drift(name: str, layers: int | None, batch: int, context: int, device: str, dtype: torch.dtype,
          tiny: bool = False) -> str:
    config = make_config(name, tiny=tiny, layers=layers)
    model = build(name, config, device, dtype).eval()
    chosen = fp8_parameters({n: p.shape for n, p in model.named_parameters()}, config)
    ids = torch.randint(0, config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(batch))
    routes: list = []
    routed_sets(model, config.num_experts_per_tok, routes)
    with torch.no_grad():
        before = model(ids.to(device)).logits.float()
        before_routes, routes[:] = list(routes), []
        round_trip_fp8(model, chosen)
        after = model(ids.to(device)).logits.float()
    changed = ", ".join(f"{(x != y).any(-1).float().mean().item():.3f}" for x, y in zip(before_routes, routes))
    return (f"| {name} ({config.num_hidden_layers}) | {batch} x {context} | "
            f"{cosine(before[:, -1], after[:, -1]):.5f} | {cosine(before, after):.5f} | {changed} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, help="layers of every model (default: each model's in generate.py)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--tiny", action="store_true", help="small widths (a smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--commit", help="the commit to name in the header")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    if set(names) - set(MODELS):
        parser.error(f"unknown models {sorted(set(names) - set(MODELS))}")
    dtype = torch.bfloat16
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    lines = ["# FP8 weights' own drift of the logits (generate.py's random models)", "",
             f"Command: `python bench/fp8_drift.py {' '.join(argv if argv is not None else sys.argv[1:])}` (commit "
             f"{args.commit or '?'}); {machine}, torch {torch.__version__}, bf16. cos: logits of the model as built "
             "against the same model with its FP8-path weights quantised and dequantised (last prompt position; "
             "every position); flipped: per layer, the share of tokens whose set of routed experts changed.", "",
             "| model (layers) | batch x context | cos, last position | cos, every position | flipped, by layer |",
             "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name in names:
        start = time.perf_counter()
        lines.append(drift(name, args.layers, args.batch, args.context, args.device, dtype, args.tiny))
        print(lines[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
