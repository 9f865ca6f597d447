"""FP8 vs bf16: one moecompile MoE layer, same run.

On the device:   python bench/fp8.py --out bench/results/gpu-fp8.md
CPU smoke test:  python bench/fp8.py --tiny            (tiny shapes, reference kernels; checks the script, not speed)

Both layers are moecompile MoEBlocks (SwiGLU, dropless, random router) sharing router and weights: bf16 experts
(moecompile::experts) against FP8 experts (moecompile.ir.fp8.MoEExpertsFP8: quantize_fp8 -> experts_fp8, float8_e4m3fn
weights with 128 x 128 block scales, activations per token per 128 channels). Times are medians of the whole layer
forward (triton.testing.do_bench on CUDA), eagerly and replayed from a CUDA graph, plus the expert op alone on the
same dispatched rows. err: relative Frobenius error of the FP8 layer's output against the bf16 layer's.
Targets: FP8 >= 1.6x faster at >= 4096 tokens on the Mixtral and DeepSeek-V3 shapes; decode (64 tokens)
<= 0.6x of bf16's time. The header names the experts_fp8 kernel that ran: "reference" means no device kernel was
registered and the numbers say nothing about FP8 speed.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
from torch import nn

from moecompile.runtime import graphs

SHAPES = {  # name: (d, f, E, k, tokens)
    "mixtral": (4096, 14336, 8, 2, 4096),
    "deepseek-v3": (7168, 2048, 256, 8, 4096),
    "decode": (4096, 14336, 8, 2, 64),
}
TINY_SHAPES = {"tiny": (128, 256, 4, 2, 64), "tiny-decode": (128, 256, 4, 2, 8)}
CPU_REPS = 5  # CPU timing (smoke test only): median of this many calls
TARGETS = {"mixtral": ("speedup", 1.6), "deepseek-v3": ("speedup", 1.6), "decode": ("time ratio", 0.6)}


def bench_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(CPU_REPS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def kernel_names(device: torch.device) -> dict[str, str]:
    from moecompile.runtime.registry import kernel_for

    return {op: getattr(kernel_for(op, device), "__module__", "?").rsplit(".", 1)[-1]
            for op in ("route", "dispatch", "experts", "combine", "quantize_fp8", "experts_fp8")}


def fp8_gemm_choice() -> str:
    """What runtime/fp8.py runs for FP8 batches (MOECOMPILE_FP8_GEMM / MOECOMPILE_FP8_BLOCK_KERNEL)."""
    from moecompile.runtime import choices

    return f"FP8 GEMM {choices.FP8_GEMM} (block batches on sm_90: {choices.FP8_BLOCK_KERNEL})"


def graph_ms(fn, device: torch.device, ops: tuple[str, ...]) -> float | None:
    """Median time of fn() replayed from a CUDA graph; None off CUDA, or when one of `ops` runs its reference
    kernel (which synchronises with the host: capturing it would fail)."""
    if device.type != "cuda" or any(kernel_names(device)[op] == "reference" for op in ops):
        return None
    try:
        g, _ = graphs.capture(fn)
    except RuntimeError as e:  # e.g. a kernel that synchronises with the host
        print(f"  (no CUDA graph: {str(e).splitlines()[0]})", flush=True)
        return None
    return bench_ms(g.replay, device)


def build(d, f, e, k, device):
    """bf16 and FP8 MoEBlocks with the same router and (bf16-rounded) expert weights, built without a float32 copy."""
    from moecompile import MoEBlock, MoEConfig
    from moecompile.ir.fp8 import MoEExpertsFP8

    config = MoEConfig(hidden_size=d, expert_size=f, num_experts=e, top_k=k, capacity_factor=0.0,
                       activation="silu", gated=True)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * scale)

    with torch.device("meta"):
        bf16, fp8 = MoEBlock(config), MoEBlock(config)
    bf16.router.weight = fp8.router.weight = nn.Parameter(randn(e, d, scale=d ** -0.5))
    bf16.experts.w_in = nn.Parameter(randn(e, 2 * f, d, scale=d ** -0.5))
    bf16.experts.w_out = nn.Parameter(randn(e, d, f, scale=f ** -0.5))
    with torch.no_grad():
        fp8.experts = MoEExpertsFP8.quantize(bf16.experts)
    return bf16.eval(), fp8.eval()


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def weight_bytes(experts: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in experts.parameters())


def run_shape(name, d, f, e, k, tokens, device):
    from moecompile.ir import ops

    bf16, fp8 = build(d, f, e, k, device)
    x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16)
    r = {}
    with torch.no_grad():
        r["err"] = rel(fp8(x), bf16(x))
        r["bf16"], r["fp8"] = bench_ms(lambda: bf16(x), device), bench_ms(lambda: fp8(x), device)
        r["bf16_graph"] = graph_ms(lambda: bf16(x), device, ("experts",))
        r["fp8_graph"] = graph_ms(lambda: fp8(x), device, ("quantize_fp8", "experts_fp8"))
        # the expert op alone, on the rows dispatch produced
        _, ids = ops.route(bf16.router_logits(x), k, 0.0, True)
        rows, _, offsets = ops.dispatch(x, ids, e)
        r["op_bf16"] = bench_ms(lambda: bf16.experts(rows, offsets, "silu", True), device)
        r["op_fp8"] = bench_ms(lambda: fp8.experts(rows, offsets, "silu", True), device)
    r["bytes"] = weight_bytes(fp8.experts) / weight_bytes(bf16.experts)
    best_bf16 = min(t for t in (r["bf16"], r["bf16_graph"]) if t is not None)
    best_fp8 = min(t for t in (r["fp8"], r["fp8_graph"]) if t is not None)
    verdict = ""
    if name in TARGETS:
        kind, bound = TARGETS[name]
        ok = best_bf16 / best_fp8 >= bound if kind == "speedup" else best_fp8 / best_bf16 <= bound
        verdict = f"{'PASS' if ok else 'FAIL'} ({kind} {'>=' if kind == 'speedup' else '<='} {bound})"
    fmt = (lambda t: "n/a" if t is None else f"{t:.3f}")
    line = (f"| {name} | {d}, {f}, {e}, {k}, {tokens} | {fmt(r['bf16'])} | {fmt(r['fp8'])} | "
            f"{fmt(r['bf16_graph'])} | {fmt(r['fp8_graph'])} | {best_bf16 / best_fp8:.2f} | "
            f"{best_fp8 / best_bf16:.2f} | "
            f"{fmt(r['op_bf16'])} | {fmt(r['op_fp8'])} | {r['err']:.1e} | {r['bytes']:.3f} | {verdict} |")
    print(line, flush=True)
    return line


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--shapes", default=None, help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    a = p.parse_args(argv)
    shapes = TINY_SHAPES if a.tiny else SHAPES
    names = a.shapes.split(",") if a.shapes else list(shapes)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False
    kernels = kernel_names(device)
    start = time.time()
    lines = []
    for n in names:
        lines.append(run_shape(n, *shapes[n], device))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the last shape's layers are gone: give their memory back
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    text = [
        "# FP8 vs bf16 MoE layer (moecompile)",
        "",
        f"Device: {device_name}; torch {torch.__version__}, python {platform.python_version()}; kernels: "
        + ", ".join(f"{op} = {m}" for op, m in kernels.items()) + f"; {fp8_gemm_choice()}.",
        f"Command: `python bench/{' '.join(['fp8.py'] + (sys.argv[1:] if argv is None else list(argv)))}` "
        f"({time.time() - start:.0f} s).",
        "One SwiGLU MoE layer forward, dropless, bf16 activations, median ms. eager / graph: the whole layer, "
        "eagerly and replayed from a CUDA graph; speedup = best bf16 / best FP8, time ratio = its inverse; op: the "
        "expert op alone on the dispatched rows (bf16 experts vs quantize_fp8 + experts_fp8); err: FP8 output vs "
        "bf16 output, relative; bytes: FP8 expert weights + scales over bf16 expert weights.",
        "",
        "| shape | d, f, E, k, tokens | bf16 eager | FP8 eager | bf16 graph | FP8 graph | speedup | time ratio | "
        "op bf16 | op FP8 | err | bytes | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *lines,
    ]
    out = "\n".join(text) + "\n"
    print(out)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(out)
    return out


if __name__ == "__main__":
    main()
