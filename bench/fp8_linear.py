"""FP8 linear at decode's few rows: moecompile::linear_fp8's Triton kernel (its K split as the runtime picks it, and
unsplit), the one-row form inductor compiles (pass matvec_fp8_linears), and bf16 cuBLAS, same run.

On the device:   python bench/fp8_linear.py --out bench/results/gpu-fp8-linear.md --commit <hash>
                 python bench/fp8_linear.py --forms --out ...   (one row only: why inductor's FP8 form is slow)
CPU smoke test:  python bench/fp8_linear.py --tiny [--forms]  (tiny shapes, Triton's interpreter; checks the script)

--forms times one-row graphs inductor compiles with the backend's coordinate-descent tuning, on the linears above and
two lm_heads: the weight times its block scales, then the reduction; the block scales applied to the activation
instead (one product per 128 x 128 block's row of x, not per weight); each row's 128-channel block sums times their
scales (one product per block sum: the pass matvec_fp8_linears's form); the FP8 weight with no scales (a rate
probe: its output is wrong), and the bf16 weight (twice the bytes through the same reduction); beside them
moecompile's own Triton linear_fp8 at one row. Which of them streams at the bf16 form's rate says whether the scales
or the FP8 loads cost the bandwidth.

Each variant runs over enough copies of the weight that they do not fit in L2 (a decode step's linears each read
their own weight), one call per copy, replayed from a CUDA graph; the time is the graph's median over the copies.
GB/s counts the weight bytes (FP8 and its scales, or bf16) once per call. The split sweep runs fixed tiles
(BLOCK_N 64, BLOCK_K 128, Triton's default warps): the data behind kernels/configs/fp8_linear.json.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

SHAPES = {  # name: (n, k), the fused q/k/v and the output projection of two decode benches' models
    "mixtral qkv": (6144, 4096), "mixtral o": (4096, 4096),
    "qwen3-30b-a3b qkv": (5120, 2048), "qwen3-30b-a3b o": (2048, 4096),
}
HEADS = {"qwen3-30b-a3b lm_head": (151936, 2048), "mixtral lm_head": (32000, 4096)}  # --forms only
TINY_SHAPES = {"tiny": (200, 300)}
TINY_FORM_SHAPES = {"tiny": (256, 384)}  # whole 128 x 128 blocks, as every shape above
ROWS = (1, 2, 4, 8, 16, 32, 64)
SWEEP = (1, 2, 4, 8, 16, 32)
L2_BYTES = 50 * 2 ** 20  # H100's L2; the copies of a weight span four times it
FIXED = {"BLOCK_N": 64, "BLOCK_K": 128}


def bench_ms(fns: list, device: str) -> float:
    """Median ms of one call, the calls of `fns` (one per weight copy) replayed from one CUDA graph on CUDA."""
    def all_calls():
        return [fn() for fn in fns]

    if device == "cuda":
        import triton.testing

        from moecompile.runtime import graphs

        graph, _ = graphs.capture(all_calls, warmup=2)
        return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / len(fns)
    all_calls()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        all_calls()
        times.append((time.perf_counter() - start) * 1e3 / len(fns))
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def weight_copies(n: int, k: int, device: str, gen: torch.Generator) -> tuple[list, list, int]:
    """(FP8 (weight, scale_inv) copies, the same weights in the activations' dtype, one FP8 copy's bytes): enough
    copies of a random [n, k] weight that they do not fit in L2 on CUDA, one elsewhere."""
    from moecompile.core import fp8_format as fp8

    fp8_bytes = n * k + 4 * fp8.cdiv(n, 128) * fp8.cdiv(k, 128)
    copies = max(1, -(-4 * L2_BYTES // fp8_bytes)) if device == "cuda" else 1
    weights = [torch.randn(n, k, device=device, generator=gen) / k ** 0.5 for _ in range(copies)]
    dtype = activation_dtype(device)
    return [fp8.quantize_blocks(w) for w in weights], [w.to(dtype) for w in weights], fp8_bytes


def activation_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def run_shape(name: str, n: int, k: int, rows_list, sweep, device: str, bandwidth: float, matvec: bool) -> list[str]:
    import moe_layer

    from moecompile.core import fp8_format as fp8
    from moecompile.ir import ops
    from moecompile.kernels import reference, triton_fp8_decode
    from moecompile.runtime import choices

    gen = torch.Generator(device=device).manual_seed(0)
    fp8_weights, bf16_weights, fp8_bytes = weight_copies(n, k, device, gen)
    dtype = activation_dtype(device)
    compiled = torch.compile(lambda x, q, s: ops.linear_fp8(x, q, s, None), backend="moecompile") if matvec else None
    untuned = {} if device == "cuda" else {"BLOCK_N": 32, "BLOCK_K": 64}  # the interpreter cannot autotune
    sms = moe_layer.sm_count(device)
    lines = []
    for rows in rows_list:
        x = torch.randn(rows, k, device=device, generator=gen).to(dtype)
        want = reference.linear_fp8(x, *fp8_weights[0], None)

        def ours(splits, config=None):
            config = {**untuned, **(config or {})} or None
            return [lambda q=q, s=s: triton_fp8_decode.linear_fp8(x, q, s, None, config, splits)
                    for q, s in fp8_weights]

        splits = choices.fp8_linear_splits(rows, n, k, sms)
        err = rel(ours(splits)[0](), want)
        auto_ms = bench_ms(ours(splits), device)
        unsplit_ms = bench_ms(ours(1), device)
        sweep_ms = {s: bench_ms(ours(s, FIXED), device) for s in sweep if s <= fp8.cdiv(k, 128)}
        best = min(sweep_ms, key=sweep_ms.get)
        bf16_ms = bench_ms([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16_weights], device)
        inductor = "—"
        if compiled is not None and rows == 1:
            torch._dynamo.reset()
            err = max(err, rel(compiled(x, *fp8_weights[0]), want))
            inductor = f"{bench_ms([lambda q=q, s=s: compiled(x, q, s) for q, s in fp8_weights], device):.4f}"
        rate = moe_layer.rate
        line = (f"| {name} {n}x{k} | {rows} | {rate(auto_ms, fp8_bytes, bandwidth)} | {splits} | "
                f"{rate(unsplit_ms, fp8_bytes, bandwidth)} | "
                f"{best}: {sweep_ms[best]:.4f} ({' / '.join(f'{s}:{t:.4f}' for s, t in sweep_ms.items())}) | "
                f"{inductor} | {rate(bf16_ms, 2 * n * k, bandwidth)} | {unsplit_ms / auto_ms:.2f} | "
                f"{bf16_ms / auto_ms:.2f} | {err:.1e} |")
        print(line, flush=True)
        lines.append(line)
    return lines


def scaled_activations(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [1, K] W^T with W = q times its 128 x 128 block scales s, each scale applied to the 128 values of x it meets
    in one block's row rather than to the weights (whole blocks only)."""
    n, k = q.shape
    xs = (x.float().view(1, -1, 128) * s[:, :, None]).view(s.shape[0], 1, k)  # [N / 128, 1, K]
    return (q.float().view(s.shape[0], 128, k) * xs).sum(-1).view(1, n).to(x.dtype)


def one_row_forms(name: str, n: int, k: int, device: str, bandwidth: float) -> str:
    """One table row of --forms: each one-row graph under inductor, ms and share of the copy bandwidth."""
    import moe_layer

    from moecompile.core import fp8_format as fp8
    from moecompile.kernels import triton_fp8_decode
    from moecompile.runtime import choices

    gen = torch.Generator(device=device).manual_seed(0)
    fp8_weights, bf16_weights, fp8_bytes = weight_copies(n, k, device, gen)
    x = torch.randn(1, k, device=device, generator=gen).to(activation_dtype(device))
    sms = moe_layer.sm_count(device)
    triton_kernel = functools.partial(triton_fp8_decode.linear_fp8, bias=None, splits=choices.fp8_linear_splits(
        1, n, k, sms), config=None if device == "cuda" else {"BLOCK_N": 32, "BLOCK_K": 64})
    forms = {
        "dequantised": (lambda x, q, s: torch.nn.functional.linear(x.float(), fp8.dequantize_blocks(q, s)).to(x.dtype),
                 fp8_weights, fp8_bytes),
        "scaled activations": (scaled_activations, fp8_weights, fp8_bytes),
        "block sums": (lambda x, q, s: fp8.matvec_blocks(x, q, s).to(x.dtype), fp8_weights, fp8_bytes),
        "no scales": (lambda x, q, s: torch.nn.functional.linear(x.float(), q.float()).to(x.dtype), fp8_weights,
                      fp8_bytes),
        "bf16": (lambda x, w: torch.nn.functional.linear(x, w), [(w,) for w in bf16_weights], 2 * n * k),
    }
    want = torch.nn.functional.linear(x.float(), fp8.dequantize_blocks(*fp8_weights[0]))
    cells, errs = [], []
    forms["linear_fp8 kernel"] = (triton_kernel, fp8_weights, fp8_bytes)  # not compiled: the Triton kernel itself
    for label, (fn, operands, nbytes) in forms.items():
        compiled = fn if fn is triton_kernel else torch.compile(fn, backend="inductor", dynamic=False,
                                                               options={"coordinate_descent_tuning": True})
        got = compiled(x, *operands[0])
        if label not in ("no scales", "bf16"):
            errs.append(f"{label} {rel(got, want):.1e}")
        cells.append(moe_layer.rate(bench_ms([lambda o=o: compiled(x, *o) for o in operands], device), nbytes,
                                    bandwidth))
    line = f"| {name} {n}x{k} | " + " | ".join(cells) + f" | {', '.join(errs)} |"
    print(line, flush=True)
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the markdown table here (after every shape)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    p.add_argument("--shapes", default=None, help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--rows", default=None, help="comma-separated row counts (default: %s)" % ",".join(map(str, ROWS)))
    p.add_argument("--no-matvec", action="store_true", help="skip the inductor-compiled one-row form")
    p.add_argument("--commit", default="?", help="the commit measured, for the header")
    p.add_argument("--forms", action="store_true", help="only the one-row forms under inductor (see above)")
    args = p.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shapes = (TINY_FORM_SHAPES if args.forms else TINY_SHAPES) if args.tiny else \
        ({**SHAPES, **HEADS} if args.forms else SHAPES)
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    rows_list = [int(r) for r in args.rows.split(",")] if args.rows else ((1, 3) if args.tiny else ROWS)
    sweep = (1, 2) if args.tiny else SWEEP
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import moe_layer  # this folder's shared helpers (imported after TRITON_INTERPRET is decided)

    bandwidth, card = moe_layer.machine(device)
    header = [
        "# FP8 linear at decode's few rows", "",
        f"`python bench/fp8_linear.py {' '.join(argv if argv is not None else sys.argv[1:])}` at commit "
        f"{args.commit}, {time.strftime('%Y-%m-%d')}, on {card} (copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s); torch {torch.__version__}. Milliseconds per call, medians; the "
        "percentages are of the copy bandwidth. err: the relative error of ours (and the inductor form) against "
        "dequantise-then-float32.", "",
        "| weight n x k | rows | ours (autotuned tiles, the runtime's splits) ms | splits | unsplit ms | fixed tiles, "
        "best split (all) | inductor one-row form ms | bf16 cuBLAS ms | unsplit / ours | bf16 / ours | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if args.forms:
        header[4:] = [
            "One row, each form compiled by inductor with coordinate-descent tuning (the backend's setting for a "
            "decode step): dequantised = weight times its block scales, then the reduction; scaled "
            "activations = the scales applied to x per block; block sums = each row's 128-channel block sums, then "
            "times their scales (pass matvec_fp8_linears); no scales = the FP8 weight alone (a rate probe, its "
            "output wrong); bf16 = the bf16 weight (twice the bytes); linear_fp8 kernel = moecompile's Triton "
            "kernel at the runtime's K splits, not under inductor. err: against dequantise-then-float32.", "",
            "| weight n x k | dequantised ms | scaled activations ms | block sums ms | no scales ms | bf16 ms | "
            "linear_fp8 kernel ms | err |",
            "|---|---|---|---|---|---|---|---|"]
    lines = []
    for name, (n, k) in shapes.items():
        if args.forms:
            lines.append(one_row_forms(name, n, k, device, bandwidth))
        else:
            lines += run_shape(name, n, k, rows_list, sweep, device, bandwidth, not args.no_matvec)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(header + lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
