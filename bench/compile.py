"""Forward throughput of HF MoE models: HF eager vs HF under torch.compile (inductor) vs the moecompile backend.

Two 4-layer decoder stacks at real per-layer sizes (the model body, no LM head):
  mixtral-like    hidden 4096, experts 8 x 14336, top-2, 32 heads / 8 KV heads
  qwen3-moe-like  hidden 2048, experts 128 x 768, top-8 (renormalised), 32 heads / 4 KV heads, head_dim 128
Tokens are batch x seq_len (seq_len 1024 by default, so that attention stays a small part of a layer). Every
compiled variant is static-shaped (dynamic=False) and compiled once per token count; each output is checked
against HF eager before timing. The variants are then timed in interleaved rounds (clock and thermal drift during
a run reach all of them alike; one after the other, 4096-token ratios moved by +-15% between runs). The table
goes to stdout and to --out.

GPU run (bf16):   python bench/compile.py --models qwen3-moe-like --out bench/results/compile-h200-qwen3.md
CUDA graphs:      python bench/compile.py --models qwen3-moe-like --mode reduce-overhead \
                      --out bench/results/compile-h200-qwen3-cudagraphs.md
CPU smoke test:   python bench/compile.py --tiny --no-hf-inductor --out /tmp/compile-tiny.md
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import moecompile
import moecompile.backend
from moecompile.runtime.registry import kernel_for

REAL = {
    "mixtral-like": ("MixtralConfig", "MixtralModel", dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8)),
    "qwen3-moe-like": ("Qwen3MoeConfig", "Qwen3MoeModel", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128)),
}
TINY = {  # same structure, sizes for a CPU smoke run
    "mixtral-like": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2),
    "qwen3-moe-like": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=16,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}


def build(name: str, layers: int, tiny: bool, device: str, dtype: torch.dtype, seed: int = 0):
    config_cls, model_cls, sizes = REAL[name]
    sizes = {**sizes, **(TINY[name] if tiny else {})}
    config = getattr(transformers, config_cls)(num_hidden_layers=layers, vocab_size=1024,
                                               max_position_embeddings=32768, **sizes)
    return instantiate(model_cls, config, device, dtype, seed)


def instantiate(model_cls: str, config, device: str, dtype: torch.dtype, seed: int = 0):
    """transformers' model_cls from config, random weights made directly on device in dtype, in eval mode; routers
    with unit-variance logits (HF initialises some to zero): a realistic spread of tokens over experts."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, model_cls)(config).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("gate.weight", "router.weight")) and p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return model


def new_step() -> None:
    """Each forward a new CUDA-graph generation (mode reduce-overhead): the variants' graphs never wait on the
    outputs of one another's previous forward. Nothing without CUDA graphs."""
    torch.compiler.cudagraph_mark_step_begin()


def time_interleaved(fns: dict, ids, rounds: int, iters: int, device: str) -> dict[str, list[float]]:
    """Seconds per forward of each variant, timed in rounds that visit the variants in turn (A B C, B C A, ...),
    iters forwards each, so that clock or thermal drift during the run reaches every variant alike."""
    labels, times = list(fns), {label: [] for label in fns}
    with torch.inference_mode():
        for r in range(rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                fn = fns[label]
                new_step()
                fn(ids)  # a warm-up forward after switching variants
                for _ in range(iters):
                    if device == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    new_step()
                    fn(ids)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times[label].append(time.perf_counter() - start)
    return times


def print_profile(fn, ids, label: str, rows: int = 15) -> None:
    """The CUDA kernels of three forwards, most time first (where a variant spends its time)."""
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn(ids)
        torch.cuda.synchronize()
    print(f"profile {label}:\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows),
          file=sys.stderr, flush=True)


def print_tile_choices() -> None:
    """The tiles the autotuned expert GEMMs picked per shape (a different pick is a reason two runs differ)."""
    from moecompile.kernels import triton_moe
    for name, (_, tuned, _, _) in triton_moe.GROUPED_GEMMS.items():
        for key, config in getattr(tuned, "cache", {}).items():
            print(f"autotuned {name} {key}: {config}", file=sys.stderr)


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max, mean) |got - ref| relative to ref's max |value|."""
    diff = (got.float() - ref.float()).abs()
    scale = ref.float().abs().max().clamp_min(1e-12)
    return (diff.max() / scale).item(), (diff.mean() / scale).item()


def run(args) -> list[dict]:
    device = "cpu" if args.tiny else args.device
    dtype = torch.float32 if args.tiny else torch.bfloat16
    rows = []
    for name in args.models:
        model = build(name, args.layers, args.tiny, device, dtype)
        forward = lambda m: (lambda ids: m(input_ids=ids, use_cache=False).last_hidden_state)  # noqa: E731
        for tokens in args.tokens:
            seq = min(args.seq_len, tokens)
            ids = torch.randint(0, 1024, (tokens // seq, seq), device=device,
                                generator=torch.Generator(device).manual_seed(tokens))
            with torch.inference_mode():
                reference = forward(model)(ids)
            variants = [("HF eager", lambda: forward(model))]
            if not args.no_hf_inductor:
                variants.append(("HF + inductor", lambda: forward(torch.compile(model, dynamic=False,
                                                                                 mode=args.mode))))
            variants.append(("moecompile", lambda: forward(moecompile.compile(
                model, dynamic=False, inductor=not args.no_inductor, **({"mode": args.mode} if args.mode else {})))))
            row = {"model": name, "tokens": tokens, "shape": f"{tokens // seq}x{seq}"}
            torch._dynamo.reset()
            moecompile.backend.clear_records()
            fns = {}
            for label, make in variants:  # compile and check every variant, then time them interleaved
                fn = make()
                start = time.perf_counter()
                with torch.inference_mode():
                    for _ in range(1 + args.warmup):  # the first compiles
                        new_step()
                        out = fn(ids)
                    # checked before the next forward: under CUDA graphs that one overwrites this output
                    err = rel_error(out, reference)
                compile_s = time.perf_counter() - start
                if err[1] > args.tolerance:
                    raise SystemExit(f"{name} {tokens} tokens, {label}: output differs from HF eager "
                                     f"(mean rel error {err[1]:.2e} > {args.tolerance:g})")
                fns[label] = fn
                row[label] = {"compile_s": compile_s, "err": err}
                if label == "moecompile":
                    row["moe_blocks"] = sum(r.moe_blocks for r in moecompile.backend.records())
                    if device == "cuda":
                        print_tile_choices()
            compiled = dict(torch._dynamo.utils.counters["stats"])
            times = time_interleaved(fns, ids, args.rounds, args.iters, device)
            if dict(torch._dynamo.utils.counters["stats"]) != compiled:  # switching variants must not recompile
                raise SystemExit(f"{name} {tokens} tokens: a variant recompiled while timing")
            for label, ts in times.items():
                seconds = statistics.median(ts)
                q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [seconds] * 3
                row[label].update(tok_s=tokens / seconds, ms=seconds * 1e3, iqr=(q[2] - q[0]) / seconds)
                print(f"{name:15s} {tokens:6d} tokens  {label:14s} {seconds * 1e3:9.2f} ms  "
                      f"{tokens / seconds:12.0f} tok/s  IQR {100 * row[label]['iqr']:4.1f}%  compile "
                      f"{row[label]['compile_s']:6.1f} s  max/mean rel err {row[label]['err'][0]:.1e}/"
                      f"{row[label]['err'][1]:.1e}", file=sys.stderr)
                if args.profile and device == "cuda":
                    print_profile(fns[label], ids, f"{name} {tokens} tokens, {label}")
            rows.append(row)
            torch._dynamo.reset()
        model = None  # frees the device memory before the next model is built
    return rows


def table(rows: list[dict], args) -> str:
    peers = ["HF eager"] + ([] if args.no_hf_inductor else ["HF + inductor"])
    head = ["model", "tokens (batch x seq)"] + [f"{p} tok/s" for p in peers] + ["moecompile tok/s",
                                                                                "moecompile / best peer",
                                                                                "MoE blocks recognised"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        best = max(r[p]["tok_s"] for p in peers)
        cells = [r["model"], f"{r['tokens']} ({r['shape']})"] + [f"{r[p]['tok_s']:,.0f}" for p in peers]
        cells += [f"{r['moecompile']['tok_s']:,.0f}", f"{r['moecompile']['tok_s'] / best:.2f}x",
                  str(r.get("moe_blocks", "?"))]
        lines.append("| " + " | ".join(cells) + " |")
    device = "cpu" if args.tiny else args.device
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    experts_kernel = kernel_for("experts", device)
    notes = [
        "",
        f"Device {gpu}; torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{'float32, TINY sizes (smoke test, not a measurement)' if args.tiny else 'bfloat16'}; "
        f"{args.layers} layers; median of {args.rounds} x {args.iters} forwards per variant, timed in interleaved "
        f"rounds (A B C, B C A, ...) after {args.warmup} warm-up; interquartile range / median: "
        + ", ".join(f"{r['model']} {r['tokens']} " + " / ".join(f"{100 * r[p]['iqr']:.1f}%" for p in peers
                                                                 + ["moecompile"]) for r in rows)
        + f" ({' / '.join(peers + ['moecompile'])}); inductor mode "
        f"{args.mode or 'default'}{'; moecompile without inductor' if args.no_inductor else ''}.",
        f"moecompile experts kernel on {device}: {experts_kernel.__module__}.{experts_kernel.__name__}.",
        "Output check against HF eager, max / mean relative error: "
        + "; ".join(f"{r['model']} {r['tokens']}: " + ", ".join(
            f"{p} {r[p]['err'][0]:.1e}/{r[p]['err'][1]:.1e}" for p in peers[1:] + ["moecompile"]) for r in rows),
        f"Command: python bench/compile.py {' '.join(sys.argv[1:])}",
    ]
    return "\n".join(lines + notes) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(REAL), default=sorted(REAL))
    p.add_argument("--tokens", nargs="+", type=int, default=None, help="default 4096 16384 (tiny: 64 256)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024, tiny 32)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--mode", default=None, help="inductor mode for both compiled variants, e.g. "
                                                "reduce-overhead (CUDA graphs)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None, help="timed forwards per variant and round")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 6, tiny 1)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest mean relative error vs HF eager (default 2e-2 in bf16, 1e-5 tiny float32)")
    p.add_argument("--tiny", action="store_true", help="CPU, float32, tiny sizes: a smoke test of this script")
    p.add_argument("--no-hf-inductor", action="store_true", help="skip the HF + inductor peer (slow on CPU)")
    p.add_argument("--no-inductor", action="store_true", help="moecompile backend without inductor")
    p.add_argument("--profile", action="store_true", help="print each variant's CUDA kernel breakdown (stderr)")
    p.add_argument("--out", required=True, help="markdown file for the table")
    args = p.parse_args(argv)
    args.tokens = args.tokens or ([64, 256] if args.tiny else [4096, 16384])
    args.seq_len = args.seq_len or (32 if args.tiny else 1024)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.iters = args.iters or (2 if args.tiny else 5)
    args.rounds = args.rounds or (1 if args.tiny else 6)
    args.tolerance = args.tolerance or (1e-5 if args.tiny else 2e-2)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or pass --tiny for a CPU smoke test")
    text = table(run(args), args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
