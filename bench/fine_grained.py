"""Fine-grained MoE layers (many small experts, top-8) on one GPU: moecompile's expert GEMM kernels against SonicMoE,
vLLM's fused_moe and a dense cuBLAS GEMM of the same FLOPs, in one run.

    python bench/fine_grained.py --out $OUT/fine-grained.md       # on the device; peers where installed / carried

Every layer is SwiGLU, bf16, dropless, renormalised softmax top-k, the same weights and tokens for all. Rows:
- dense: torch.mm over T*k rows with the layer's two projections (same FLOPs, no routing): the ceiling's stand-in.
- bare grouped_mm: the two torch._grouped_mm GEMMs alone on perfectly balanced groups.
- GEMMs <kernel>: the two expert GEMMs alone on the layer's real routing (rows already in expert order).
- ours <first>+<second>: the whole moecompile layer (MoEBlock: router, top-k, dispatch, GEMMs, combine) with
  those expert GEMM kernels, from a CUDA graph; and eager (as SonicMoE runs).
- ours quack / quack gathered: the layer on QuACK, its first projection on rows copied in expert order / gathering
  them from the token matrix through the dispatch order (MOECOMPILE_FFN_IN=quack_gathered).
- ours fused ops: the layer as a compiled graph runs it (fuse_route_dispatch, gather_expert_rows): route_dispatch
  (router GEMM, top-k ranking its assignments, dispatch without a row copy), experts_gathered, combine, from a
  CUDA graph, the runtime's kernel choice.
- ours gathered interleaved quack (--gathered): route + a rank-only dispatch + QuACK's gathered first projection on
  SonicMoE's interleaved gate / up rows + QuACK's second + moecompile's combine, from a CUDA graph.
- SonicMoE: its MoE module (CuTe DSL through QuACK), eager, inference mode; fwd+bwd in training mode.
- vLLM: its fused_moe Triton kernel (bench/peers/vllm_fused_moe.py; carry .peers/), GEMMs alone and layer.
Training (forward + backward), eager: ours (MoEBlock autograd; the runtime's choice, QuACK forced, torch._grouped_mm
forced) / HF grouped_mm (MixtralSparseMoeBlock) / SonicMoE.
Correctness: relative Frobenius error of each layer against a float32 reference on the same bf16 inputs.
Each shape's rows are printed as soon as they are measured (a run cut short keeps what it finished).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import subprocess
import sys
import time
import traceback

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_layer  # noqa: E402  (this folder's shared helpers: build, reference, bare GEMMs, vLLM peer)

SHAPES = {  # name: (d, f, E, k, tokens), in the order a run cut short should keep them
    "qwen3-moe": (2048, 768, 128, 8, 8192),
    "sonic-7b": (1536, 256, 128, 8, 24576),
    "deepseek-v3": (7168, 2048, 256, 8, 4096),
    "sonic-30b": (4096, 512, 128, 8, 32768),
    "mixtral": (4096, 14336, 8, 2, 4096),
    "gpt2-upcycled": (768, 3072, 16, 2, 16384),
}
GEMM_KERNELS = ("triton_persistent", "grouped_mm", "quack")
# our layer's variants: (first, second projection) kernels as runtime/choices.py's FFN_IN / FFN_OUT name them
OUR_VARIANTS = {"auto": ("auto", "auto"), "quack": ("quack", "quack"), "quack gathered": ("quack_gathered", "quack")}
TRAIN_SHAPES = ("qwen3-moe", "mixtral")  # the training targets
WITH_SONIC = True  # --no-sonic: its autotuning compiles for minutes per shape
WITH_TRAINING = True  # --forward-only: the training rows of TRAIN_SHAPES left out
PROFILE = False  # --profile: a kernel breakdown of our layers and SonicMoE per shape
SONIC_CACHE = None  # --sonic-cache: where SonicMoE's autotuning results are kept between runs
TRAIN_COLUMNS = ("ours", "ours quack", "ours quack, folded", "ours quack, combine apart", "ours grouped_mm",
                 "HF grouped_mm", "SonicMoE")

bench = moe_layer.bench


def graph_bench(fn) -> float:
    from moecompile.runtime import graphs

    graph, _ = graphs.capture(fn)
    return bench(graph.replay)


def attempt(label, fn, notes):
    """fn() or None; a failing peer or variant is noted with its error instead of ending the run. Prints how long
    it took (the first call of a kernel compiles: a device call's time goes there)."""
    start = time.time()
    try:
        return fn()
    except Exception as e:  # a peer that cannot run here is a row of the table, not a crash
        notes.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        traceback.print_exc()
        return None
    finally:
        print(f"  {label}: {time.time() - start:.0f} s", flush=True)


def dense_time(d, f, rows):
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(d, 2 * f, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(f, d, device="cuda", dtype=torch.bfloat16)
    return bench(lambda: (torch.mm(x, w1), torch.mm(a, w2)))


def routing(ours, x2, k):
    from moecompile.ir import ops

    weights, ids = ops.route(x2.float() @ ours.router.weight.float().t(), k, 0.0, True)
    return weights, ids


def gemm_times(ours, x2, ids, notes):
    """The two expert GEMMs alone on the real routing, per kernel (rows already dispatched)."""
    from moecompile.kernels import triton_routing
    from moecompile.runtime import choices, cuda

    rows, _, offsets = triton_routing.dispatch(x2, ids, ours.config.num_experts)
    w_in, w_out = ours.experts.w_in, ours.experts.w_out
    times = {}
    for kernel in GEMM_KERNELS:
        def run(kernel=kernel):
            choices.FFN_IN = choices.FFN_OUT = kernel
            first, second = cuda._projection_kernels(rows, w_in, w_out, "silu", True)
            if (first, second) != (kernel, kernel):
                raise RuntimeError(f"{kernel} not supported here: ran {first} + {second}")
            return graph_bench(lambda: cuda.experts(rows, offsets, w_in, None, w_out, None, "silu", True))
        times[kernel] = attempt(f"GEMMs {kernel}", run, notes)
    choices.FFN_IN = choices.FFN_OUT = "auto"
    return times


def gathered_layer(ours, x2, k):
    """The layer with QuACK's first projection gathering rows (no dispatch copy) from W_in's gate and up rows
    alternating (SonicMoE's layout, converted once here) instead of gate rows first, as a function of nothing."""
    from moecompile.kernels import quack_gemm, triton_moe, triton_routing
    from moecompile.runtime import choices

    w_in, w_out, e = ours.experts.w_in, ours.experts.w_out, ours.config.num_experts
    first = choices.quack_config("first", w_in.shape[2], w_in.shape[1], gathered=True)
    second = choices.quack_config("second", w_out.shape[2], w_out.shape[1])
    w_in = torch.stack(w_in.chunk(2, dim=1), dim=2).flatten(1, 2)

    def layer():
        logits = ours.router_logits(x2)  # as the layer computes them (float32 out of tensor cores)
        weights, ids = triton_routing.topk(logits, k, True)
        _, order, offsets = triton_routing.dispatch(x2, ids, e, copy_rows=False)
        cu, tokens = triton_routing.gather_indices(order, offsets, k)
        a = quack_gemm.first_projection(x2, cu, w_in, None, "silu", True,
                                        gather_rows=tokens, interleaved=True, config=first)
        return triton_moe.combine(quack_gemm.second_projection(a, cu, w_out, None, config=second), order, weights)

    return layer


def fused_ops_layer(ours, x2, k):
    """The layer as a compiled graph runs it (the ops fuse_route_dispatch and gather_expert_rows leave), as a function
    of nothing."""
    from moecompile.ir import ops

    c, ex = ours.config, ours.experts

    def layer():
        weights, _, _, order, offsets = ops.route_dispatch(x2, ours.router.weight, ours.router.bias, k, 0.0,
                                                           c.renormalize, copy_rows=False)
        y = ops.experts_gathered(x2, order, offsets, k, ex.w_in, ex.b_in, ex.w_out, ex.b_out, c.activation, c.gated)
        return ops.combine(y, order, weights)

    return layer


def gathered_quack(ours, x2, k):
    """(ms, output) of gathered_layer."""
    layer = gathered_layer(ours, x2, k)
    out = layer()
    return graph_bench(layer), out


@contextlib.contextmanager
def sonic_tuning():
    """SonicMoE's QuACK autotuning results (QuACK keeps them on disk) read from and written to
    SONIC_CACHE/<device>: a later run on the same card class skips minutes of tuning, and no other caller's results
    (ours, whose weight layout differs under the same key) are served to it."""
    if SONIC_CACHE is None:
        yield
        return
    before = os.environ.get("QUACK_CACHE_DIR")
    os.environ["QUACK_CACHE_DIR"] = os.path.join(SONIC_CACHE, re.sub(r"\W+", "-", torch.cuda.get_device_name()))
    try:
        yield
    finally:
        if before is None:
            del os.environ["QUACK_CACHE_DIR"]
        else:
            os.environ["QUACK_CACHE_DIR"] = before


def sonic_module(ours, d, f, e, k):
    if not WITH_SONIC:
        return None
    from sonicmoe import MoE
    from sonicmoe.enums import ActivationType

    sonic = MoE(e, k, d, f, ActivationType.SWIGLU, add_bias=False, std=0.02).to("cuda", torch.bfloat16)
    with torch.no_grad():  # same weights; SonicMoE's SwiGLU reads gate / up from interleaved rows
        gate, up = ours.experts.w_in.chunk(2, dim=1)
        sonic.c_fc.weight.copy_(torch.stack((gate, up), dim=2).flatten(1, 2))
        sonic.c_proj.weight.copy_(ours.experts.w_out)
        sonic.router.weight.copy_(ours.router.weight)
    return sonic


def run_shape(name, d, f, e, k, tokens, out_lines, train_lines, notes, vllm, gathered, train_only=False):
    from moecompile.runtime import choices

    ours, hf = moe_layer.build(d, f, e, k)
    x = torch.randn(1, tokens, d, device="cuda", dtype=torch.bfloat16)
    x2 = x.reshape(-1, d)
    if train_only:
        sonic = attempt("SonicMoE build", lambda: sonic_module(ours, d, f, e, k), notes)
        train_lines.append(train_row(name, ours, hf, sonic, x, notes))
        print(train_lines[-1], flush=True)
        return
    r = {}
    with torch.no_grad():
        ref = moe_layer.reference_fp32(ours, x, 0.0).reshape(x2.shape)
        weights, ids = routing(ours, x2, k)
        r["dense"] = dense_time(d, f, tokens * k)
        r["bare"] = moe_layer.bare_grouped_gemms(d, f, e, k, tokens)
        r.update({f"gemms {kk}": v for kk, v in gemm_times(ours, x2, ids, notes).items()})
        errs = {}
        for label, (first, second) in OUR_VARIANTS.items():
            choices.FFN_IN, choices.FFN_OUT = first, second
            errs[label] = attempt(f"ours {label}", lambda: moe_layer.rel(ours(x).reshape(x2.shape), ref), notes)
            r[f"ours {label}"] = attempt(f"ours {label} graph", lambda: graph_bench(lambda: ours(x)), notes)
            if PROFILE and label != "auto":  # where the layer's time goes beyond its two GEMMs: eager, every kernel
                attempt(f"profile {label}", lambda: moe_layer.print_kernel_profile(f"{name} ours {label}",
                                                                                  lambda: ours(x)), notes)
        choices.FFN_IN = choices.FFN_OUT = "auto"
        r["ours auto eager"] = attempt("ours auto eager", lambda: bench(lambda: ours(x)), notes)
        fused = fused_ops_layer(ours, x2, k)
        errs["fused ops"] = attempt("ours fused ops", lambda: moe_layer.rel(fused(), ref), notes)
        r["ours fused ops"] = attempt("ours fused ops graph", lambda: graph_bench(fused), notes)
        if PROFILE:
            attempt("profile fused ops", lambda: moe_layer.print_kernel_profile(f"{name} ours fused ops", fused), notes)
        if gathered:
            g = attempt("ours gathered interleaved quack", lambda: gathered_quack(ours, x2, k), notes)
            if g is not None:
                r["ours gathered interleaved quack"], errs["gathered interleaved"] = g[0], moe_layer.rel(g[1], ref)
            if PROFILE:  # QuACK's gated projection on SonicMoE's row layout beside ours (concatenated gate / up)
                attempt("profile gathered interleaved", lambda: moe_layer.print_kernel_profile(
                    f"{name} ours gathered interleaved quack", gathered_layer(ours, x2, k)), notes)
        sonic = attempt("SonicMoE build", lambda: sonic_module(ours, d, f, e, k), notes)
        if sonic is not None:
            sonic.eval()
            with sonic_tuning():
                so = attempt("SonicMoE forward", lambda: sonic(x, is_inference_mode=True)[0], notes)
            if so is not None:
                errs["sonic"] = moe_layer.rel(so.reshape(x2.shape), ref)
                r["sonic"] = attempt("SonicMoE timing", lambda: bench(lambda: sonic(x, is_inference_mode=True)),
                                     notes)
                if PROFILE:  # its kernels beside ours: where a gap between the layers lies
                    with sonic_tuning():
                        attempt("profile SonicMoE", lambda: moe_layer.print_kernel_profile(
                            f"{name} SonicMoE", lambda: sonic(x, is_inference_mode=True)), notes)
        if vllm:
            from peers import vllm_fused_moe as vp

            def vllm_times():
                peer = vp.prepare(x2, ours.experts.w_in, ours.experts.w_out, weights.to(x.dtype), ids)
                errs["vllm"] = moe_layer.rel(peer.layer(), ref)
                return bench(vp.cuda_graph(peer.gemms)), bench(vp.cuda_graph(peer.layer))
            v = attempt("vLLM", vllm_times, notes)
            if v is not None:
                r["vllm gemms"], r["vllm layer"] = v
    flops = 6 * tokens * k * d * f
    ours_best = min(t for t in (r.get("ours auto"), r.get("ours quack"), r.get("ours quack gathered"),
                                r.get("ours fused ops"), r.get("ours gathered interleaved quack")) if t is not None)
    peers = {p: r.get(p) for p in ("sonic", "vllm gemms", "vllm layer")}

    def fmt(v, digits=3):
        return "—" if v is None else f"{v:.{digits}f}"

    def share(v):
        return "—" if v is None else f"{flops / (v * 1e-3) / 1e12:.0f} ({r['dense'] / v * 100:.0f}%)"

    line = (f"| {name} | {d}, {f}, {e}, {k}, {tokens} | {fmt(r['dense'])} | {fmt(r['bare'])} ("
            f"{r['dense'] / r['bare'] * 100:.0f}%) | " +
            " | ".join(f"{fmt(r.get(f'gemms {kk}'))} ({share(r.get(f'gemms {kk}'))})" for kk in GEMM_KERNELS) +
            f" | {fmt(r.get('ours auto'))} | {fmt(r.get('ours quack'))} | {fmt(r.get('ours quack gathered'))} | "
            f"{fmt(r.get('ours fused ops'))} | {fmt(r.get('ours gathered interleaved quack'))} | "
            f"{fmt(r.get('ours auto eager'))}"
            f" | {fmt(peers['sonic'])} | {fmt(peers['vllm gemms'])} | {fmt(peers['vllm layer'])} | "
            f"{share(ours_best)} | " + ", ".join(f"{kk} {v:.1e}" for kk, v in errs.items() if v is not None) + " |")
    out_lines.append(line)
    print(line, flush=True)
    if name in TRAIN_SHAPES and WITH_TRAINING:
        train_lines.append(train_row(name, ours, hf, sonic, x, notes))
        print(train_lines[-1], flush=True)
    ours = hf = sonic = None  # frees the device memory before the next shape
    torch.cuda.empty_cache()


def train_row(name, ours, hf, sonic, x, notes):
    from moecompile.runtime import choices

    xg = x.clone().requires_grad_()
    grad = torch.randn_like(x)

    def step(block, call):
        block.zero_grad(set_to_none=True)
        xg.grad = None
        call(block).backward(grad)

    times, fold = {}, choices.FOLD_COMBINE
    for label, block, call, kernel in (
            ("ours", ours, lambda b: b(xg), "auto"), ("ours quack", ours, lambda b: b(xg), "quack"),
            ("ours quack, folded", ours, lambda b: b(xg), "quack"),
            ("ours quack, combine apart", ours, lambda b: b(xg), "quack"),
            ("ours grouped_mm", ours, lambda b: b(xg), "grouped_mm"),
            ("HF grouped_mm", hf, lambda b: b(xg), "auto"),
            ("SonicMoE", sonic, lambda b: b(xg)[0], "auto")):
        if block is None:
            continue
        block.train()
        choices.FFN_IN = choices.FFN_OUT = kernel
        choices.FOLD_COMBINE = {"ours quack, folded": "on", "ours quack, combine apart": "off"}.get(label, "auto")
        with sonic_tuning() if block is sonic else contextlib.nullcontext():
            times[label] = attempt(f"train {label}", lambda: bench(lambda: step(block, call)), notes)
    choices.FFN_IN = choices.FFN_OUT = "auto"
    choices.FOLD_COMBINE = fold
    return f"| {name} | " + " | ".join("—" if times.get(c) is None else f"{times[c]:.3f}"
                                       for c in TRAIN_COLUMNS) + " |"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--vllm", action="store_true", help="vLLM's fused_moe as a peer (carry .peers/)")
    p.add_argument("--commit", default=None, help="the commit for the header where git is absent")
    p.add_argument("--gathered", action="store_true",
                   help="also our layer with QuACK's gathered first projection on SonicMoE's interleaved gate / up "
                        "rows")
    p.add_argument("--train-only", action="store_true", help="only the training rows (of every --shapes shape)")
    p.add_argument("--forward-only", action="store_true", help="no training rows")
    p.add_argument("--no-sonic", action="store_true", help="without SonicMoE")
    p.add_argument("--profile", action="store_true",
                   help="print a kernel breakdown of our quack, fused-ops (and --gathered) layers and of SonicMoE")
    p.add_argument("--sonic-cache", default=None,
                   help="keep SonicMoE's autotuning results here, apart from other callers' (gpu_check.sh sets it)")
    a = p.parse_args(argv)
    global WITH_SONIC, SONIC_CACHE, PROFILE, WITH_TRAINING
    WITH_SONIC, SONIC_CACHE, PROFILE = not a.no_sonic, a.sonic_cache, a.profile
    WITH_TRAINING = not a.forward_only
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.time()
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    versions = []
    for mod in ("sonicmoe", "quack", "cutlass"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception as e:
            versions.append(f"{mod} absent ({type(e).__name__})")
    header = [
        "# Fine-grained MoE layers: moecompile vs SonicMoE vs vLLM vs dense cuBLAS",
        "",
        f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, "
        f"{', '.join(versions)}, python {platform.python_version()}. Commit {commit}. "
        f"Command: `python bench/{' '.join(['fine_grained.py'] + sys.argv[1:])}`.",
        "Forward, bf16, dropless, median ms (triton do_bench). dense = torch.mm of the same FLOPs; bare = "
        "torch._grouped_mm on balanced groups; GEMMs = the two expert GEMMs alone on the real routing (TF/s and share "
        "of dense in brackets); ours = the whole moecompile layer from a CUDA graph with auto (the tuned Triton "
        "kernels) / quack expert GEMMs (rows copied in expert order) / quack gathered (QuACK's first projection "
        "reading token rows through the dispatch order, no row copy); fused ops = the ops of a compiled graph "
        "(route_dispatch ranking in its top-k, experts_gathered, combine); gathered interleaved = the same with gate / "
        "up rows interleaved as SonicMoE stores them (--gathered); eager = without CUDA graphs; SonicMoE "
        "eager, inference mode; vLLM from CUDA graphs. best = ours' fastest layer time as TF/s (share of dense). "
        "err: relative error vs a float32 reference.",
        "",
        "| shape | d, f, E, k, tokens | dense | bare grouped_mm | " +
        " | ".join(f"GEMMs {kk}" for kk in GEMM_KERNELS) +
        " | ours auto | ours quack | ours quack gathered | ours fused ops | ours gathered interleaved quack | "
        "ours auto eager | "
        "SonicMoE | vLLM GEMMs | vLLM layer | ours best TF/s | err |",
        "|---|---|" + "---|" * (16 + len(GEMM_KERNELS) - 3),
    ]
    out_lines, train_lines, notes = [], [], []

    def write():
        text = header + out_lines
        if train_lines:
            text += ["", "Training step (forward + backward, eager, gradients set to None first), median ms; "
                     "\"folded\" folds the combine's backward into the experts' QuACK backward "
                     "(MOECOMPILE_FOLD_COMBINE=on), \"combine apart\" does not (off: it writes the [N, H] row "
                     "gradient the experts' backward reads), the other columns of ours fold where the runtime's "
                     "default (auto) does:", "",
                     "| shape | " + " | ".join(TRAIN_COLUMNS) + " |", "|---" * (len(TRAIN_COLUMNS) + 1) + "|",
                     *train_lines]
        if notes:
            text += ["", "Notes (what failed to run):", "", *[f"- {n}" for n in notes]]
        text += ["", f"Total {time.time() - start:.0f} s."]
        if a.out:
            with open(a.out, "w") as fh:
                fh.write("\n".join(text) + "\n")
        return text

    for name in a.shapes.split(","):
        shape_start = time.time()
        run_shape(name, *SHAPES[name], out_lines, train_lines, notes, a.vllm, a.gathered, a.train_only)
        print(f"{name}: {time.time() - shape_start:.0f} s", flush=True)
        write()
    print("\n".join(write()))


if __name__ == "__main__":
    main()
