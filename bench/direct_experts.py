"""The direct experts of a one-token decode step, each projection's kernel per tile configuration, FP8 and bf16
weights: which tiles stream the FP8 weights at the rate the bf16 ones reach. (A profiled Qwen3-30B-A3B step read
FP8 expert weights at 1.15-1.75 TB/s against bf16's 2.3-2.7: bench/results/gpu-generate.md.)

On the device:   python bench/direct_experts.py --out bench/results/gpu-direct-experts.md --commit <hash>
CPU smoke test:  python bench/direct_experts.py --tiny     (Triton's interpreter; checks the script only)

Each configuration is one of the autotuner's candidates for that weight type (kernels/triton_direct.py for bf16,
kernels/triton_fp8_decode.py for FP8), launched with its tiles, warps and stages for both projections; "autotuned"
is the autotuner's pick, "runtime table" the tiles the runtime launches (kernels/configs/direct_experts.json, chosen
from this table). Every call routes the token to other experts (distinct, drawn at random), so the weights
come from memory, not L2. Kernel times are the profiler's device time per call (eager launches: the launch gaps are
not counted); GB/s counts the hit experts' weights (and scales) once. err: the output against the float32 reference
on the same weights.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}  # hidden, width, experts, k
TINY_SHAPES = {"tiny": (64, 32, 4, 2)}
DRAWS = 16  # token routings per timed pass, each to other experts
TINY_DRAWS = 1


def candidates(fp8: bool, tiny: bool) -> list[dict]:
    """The autotuner's configurations as launch keywords (tiles, warps, stages)."""
    from moecompile.kernels import triton_direct, triton_fp8_decode

    if tiny:  # the interpreter: two small tiles
        return [{"BLOCK_N": 16, "BLOCK_K": 64}, {"BLOCK_N": 32, "BLOCK_K": 128}]
    configs = triton_fp8_decode._matvec_configs() if fp8 else triton_direct._configs()
    return [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in configs]


def label(config: dict | None) -> str:
    if config is None:
        return "autotuned"
    extra = f", {config['num_warps']} warps, {config['num_stages']} stages" if "num_warps" in config else ""
    return f"{config['BLOCK_N']}x{config['BLOCK_K']}{extra}"


def kernel_ms(calls: list, device: str, reps: int = 3) -> dict[str, float]:
    """Device ms per call of each kernel the calls launch (CUDA: the profiler), or {"all": wall ms} on the CPU."""
    for call in calls:  # compile, autotune
        call()
    if device != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return {"all": (time.perf_counter() - start) * 1e3 / len(calls)}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for call in calls:
                call()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / 1e3 / (reps * len(calls)) for e in prof.key_averages()
            if e.device_type.name == "CUDA"}


def run_shape(name: str, hidden: int, width: int, experts: int, k: int, device: str, bandwidth: float,
              tiny: bool) -> list[str]:
    draws = TINY_DRAWS if tiny else DRAWS
    import moe_layer

    from moecompile.core import fp8_format as F
    from moecompile.kernels import reference, triton_direct, triton_fp8_decode
    from moecompile.runtime import choices

    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    w_in = torch.randn(experts, 2 * width, hidden, device=device, generator=gen) * hidden ** -0.5
    w_out = torch.randn(experts, hidden, width, device=device, generator=gen) * width ** -0.5
    fp8_in, fp8_out = F.quantize_blocks(w_in), F.quantize_blocks(w_out)
    w_in, w_out = w_in.to(dtype), w_out.to(dtype)
    x = torch.randn(1, hidden, device=device, generator=gen).to(dtype)
    weights = torch.softmax(torch.randn(draws, k, device=device, generator=gen), -1)
    ids = torch.stack([torch.randperm(experts, device=device, generator=gen)[:k] for _ in range(draws)])
    bytes_per = {"in": {"bf16": 2 * 2 * width * hidden, "fp8": 2 * width * hidden + 4 * fp8_in[1][0].numel()},
                 "out": {"bf16": 2 * hidden * width, "fp8": hidden * width + 4 * fp8_out[1][0].numel()}}  # per expert
    runs = {
        "bf16": (lambda c, i: triton_direct.routed_experts(x, weights[i:i + 1], ids[i:i + 1], w_in, None, w_out, None,
                                                            "silu", True, c),
                 lambda i: reference.routed_experts(x.float(), weights[i:i + 1], ids[i:i + 1], w_in.float(), None,
                                                    w_out.float(), None, "silu", True)),
        "fp8": (lambda c, i: triton_fp8_decode.routed_experts_fp8(x, weights[i:i + 1], ids[i:i + 1], *fp8_in, None,
                                                                  *fp8_out, None, "silu", True, c),
                lambda i: reference.routed_experts_fp8(x, weights[i:i + 1], ids[i:i + 1], *fp8_in, None, *fp8_out,
                                                       None, "silu", True)),
    }
    table = choices.direct_expert_tiles(hidden, width)  # what the runtime launches
    lines = []
    for kind, (ours, want) in runs.items():
        ref = want(0)
        for config in [None, "table", *candidates(kind == "fp8", tiny)]:
            if config is None and device != "cuda":
                continue  # the interpreter cannot autotune
            tiles = table if config == "table" else None if config is None else {"in": config, "out": config}
            got = ours(tiles, 0)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            times = kernel_ms([lambda i=i: ours(tiles, i) for i in range(draws)], device)
            cells = []
            for projection, kernel in (("in", "_direct_ffn_in_kernel"), ("out", "_direct_ffn_out_kernel")):
                ms = sum(t for key, t in times.items() if kernel in key)
                cells.append(moe_layer.rate(ms, k * bytes_per[projection][kind], bandwidth) if ms else "—")
            if device != "cuda":
                cells[0] = f"{times['all']:.3f} (both)"
            if config == "table":
                config_text = f"runtime table ({label(table['in'])} / {label(table['out'])})"
            elif config is None:
                chosen = (triton_fp8_decode._fp8_direct_in_tuned, triton_fp8_decode._fp8_direct_out_tuned) \
                    if kind == "fp8" else triton_direct.KERNELS
                picked = " / ".join(label({**c.best_config.kwargs, "num_warps": c.best_config.num_warps,
                                           "num_stages": c.best_config.num_stages}) for c in chosen)
                config_text = f"autotuned ({picked})"
            else:
                config_text = label(config)
            line = f"| {name} | {kind} | {config_text} | {cells[0]} | {cells[1]} | {err:.1e} |"
            print(line, flush=True)
            lines.append(line)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the markdown table here (after every shape)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (Triton's interpreter)")
    p.add_argument("--shapes", default=None, help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--commit", default="?", help="the commit measured, for the header")
    args = p.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import moe_layer  # this folder's shared helpers (imported after TRITON_INTERPRET is decided)

    bandwidth, card = moe_layer.machine(device)
    header = [
        "# Direct experts at one token: each projection per tile configuration, FP8 and bf16", "",
        f"`python bench/direct_experts.py {' '.join(argv if argv is not None else sys.argv[1:])}` at commit "
        f"{args.commit}, {time.strftime('%Y-%m-%d')}, on {card} (copy bandwidth {bandwidth / 1e12:.2f} TB/s); "
        f"torch {torch.__version__}. Device ms per call (profiler), {DRAWS} routings each to other experts; the "
        "percentages are of the copy bandwidth. Configuration: BLOCK_N x BLOCK_K, warps, stages, the same for both "
        "projections; autotuned: the autotuner's pick (first / second); runtime table: the tiles the runtime launches "
        "(kernels/configs/direct_experts.json).", "",
        "| shape | weights | configuration | first projection ms | second projection ms | err |",
        "|---|---|---|---|---|---|",
    ]
    lines = []
    for name, shape in shapes.items():
        lines += run_shape(name, *shape, device, bandwidth, args.tiny)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(header + lines) + "\n")
    print(f"median err {statistics.median(float(line.rsplit('|', 2)[1]) for line in lines):.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
