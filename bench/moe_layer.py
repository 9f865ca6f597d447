"""GPU benchmark of one MoE layer: moecompile vs Hugging Face transformers and bare grouped GEMMs.

Run on an H200 (device tool):  python bench/moe_layer.py --out bench/results/gpu-moe-layer.md
Peers in the same run: HF MixtralSparseMoeBlock with experts_implementation "grouped_mm" (HF 5's default), the
same under torch.compile (default mode), and bare torch._grouped_mm GEMMs on perfectly balanced routing (the
floor: no routing, permutation, activation or combine). All layers are SwiGLU, bf16, random router weights,
dropless. Times are medians (triton.testing.do_bench); useful TFLOP/s counts 6 * tokens * k * d * f.
Correctness: each layer's output against a float32 reference (plain PyTorch, expert by expert) on the same
bf16-rounded inputs, relative Frobenius error, for capacity factors 0, 1.0 and -1.5.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import triton
import triton.testing

SHAPES = {  # name: (d, f, E, k, tokens)
    "gpt2-upcycled": (768, 3072, 16, 2, 16384),
    "mixtral": (4096, 14336, 8, 2, 4096),
    "qwen3-moe": (2048, 768, 128, 8, 8192),
    "deepseek-v3": (7168, 2048, 256, 8, 4096),
    "decode": (4096, 14336, 8, 2, 64),
}
TRAIN_SHAPES = ("gpt2-upcycled", "mixtral")
TRAIN_ROUNDS = 3


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def build(d, f, e, k):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from moecompile import MoEBlock, MoEConfig

    gen = torch.Generator(device="cuda").manual_seed(0)
    router = torch.randn(e, d, generator=gen, device="cuda") * d ** -0.5
    w_in = (torch.randn(e, 2 * f, d, generator=gen, device="cuda") * d ** -0.5).bfloat16()
    w_out = (torch.randn(e, d, f, generator=gen, device="cuda") * f ** -0.5).bfloat16()
    ours = MoEBlock(MoEConfig(hidden_size=d, expert_size=f, num_experts=e, top_k=k, capacity_factor=0.0,
                              activation="silu", gated=True)).to("cuda", torch.bfloat16).eval()
    cfg = MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k,
                        router_jitter_noise=0.0)
    cfg._experts_implementation = "grouped_mm"
    hf = MixtralSparseMoeBlock(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for block_router, block_in, block_out in ((ours.router.weight, ours.experts.w_in, ours.experts.w_out),
                                                  (hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj)):
            block_router.copy_(router)
            block_in.copy_(w_in)
            block_out.copy_(w_out)
    return ours, hf


def reference_fp32(block, x, capacity_factor):
    """Plain PyTorch float32 forward of an MoEBlock, expert by expert (routing from the reference route kernel)."""
    from moecompile.kernels.reference import route

    c = block.config
    x2 = x.reshape(-1, x.shape[-1]).float()
    weights, ids = route(x2 @ block.router.weight.float().t(), c.top_k, capacity_factor, c.renormalize)
    out = torch.zeros_like(x2)
    for e in range(c.num_experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gate, up = (x2[tok] @ block.experts.w_in[e].float().t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ block.experts.w_out[e].float().t()
        out.index_add_(0, tok, y * weights[tok, slot].unsqueeze(1))
    return out.reshape(x.shape)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bare_grouped_gemms(d, f, e, k, tokens):
    rows = tokens * k
    xs = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16)
    w_in = torch.randn(e, 2 * f, d, device="cuda", dtype=torch.bfloat16)
    w_out = torch.randn(e, d, f, device="cuda", dtype=torch.bfloat16)
    offs = (torch.arange(1, e + 1, device="cuda") * rows // e).to(torch.int32)

    def run():
        torch._grouped_mm(xs, w_in.transpose(-2, -1), offs=offs)
        torch._grouped_mm(a, w_out.transpose(-2, -1), offs=offs)
    return bench(run)


def graph_time(fn, x):
    """Median time of fn(x) replayed from a CUDA graph (moecompile's layer is capturable: no host sync)."""
    from moecompile.runtime import graphs

    graph, _ = graphs.capture(lambda: fn(x))
    return bench(graph.replay)


def copy_bandwidth() -> float:
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench(lambda: dst.copy_(src)) * 1e-3)  # bytes read + written per second


def machine(device: str) -> tuple[float, str]:
    """(copy bandwidth in bytes/s, NaN off CUDA; the card's or the CPU's name) for a results header."""
    if device == "cuda":
        return copy_bandwidth(), torch.cuda.get_device_name()
    return float("nan"), platform.processor() or "cpu"


def sm_count(device: str) -> int:
    """The GPU's SMs, which the runtime's split choices take; 1 off CUDA."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 1


def rate(ms: float, nbytes: int, bandwidth: float) -> str:
    """ms, with the GB/s of reading nbytes in that time and their share of the copy bandwidth where it is known."""
    if bandwidth != bandwidth:
        return f"{ms:.4f}"
    gbs = nbytes / ms / 1e6
    return f"{ms:.4f} ({gbs:.0f} GB/s, {gbs * 1e9 / bandwidth:.0%})"


# our variants: (first projection, second projection) kernels, as runtime/choices.py's FFN_IN / FFN_OUT name them
VARIANTS = {"persistent": ("triton_persistent", "triton_persistent"),
            "persistent + grouped_mm": ("triton_persistent", "grouped_mm"),
            "tma": ("triton_tma", "triton_tma"), "grouped_mm": ("grouped_mm", "grouped_mm"), "auto": ("auto", "auto")}

TIMED = tuple(VARIANTS)  # "auto", timed last, also leaves the runtime's own choice in place


def use_variant(mc, name):
    mc.FFN_IN, mc.FFN_OUT = VARIANTS[name]


def vllm_peer(ours, x, k, lines, name, r):
    """vLLM's fused_moe Triton GEMMs (bench/peers/vllm_fused_moe.py) on the same weights and routing, from CUDA
    graphs: the two GEMMs alone, and the layer with vLLM's align / activation / sum done in torch."""
    from peers import vllm_fused_moe as vllm

    from moecompile.ir import ops

    x2 = x.reshape(-1, x.shape[-1])
    weights, ids = ops.route(x2.float() @ ours.router.weight.float().t(), k, 0.0, True)
    peer = vllm.prepare(x2, ours.experts.w_in, ours.experts.w_out, weights.to(x.dtype), ids)
    gemms, layer = bench(vllm.cuda_graph(peer.gemms)), bench(vllm.cuda_graph(peer.layer))
    err = rel(peer.layer(), reference_fp32(ours, x, 0.0).reshape(x2.shape))
    line = (f"| {name} | {gemms:.3f} | {layer:.3f} | {r['ours_graph']:.3f} | {gemms / r['ours_graph']:.2f} | "
            f"{r['weight_read']:.3f} | {err:.1e} |")
    lines.append(("vllm", line))
    print(line, flush=True)


def print_kernel_profile(label: str, fn, reps: int = 5) -> None:
    """The CUDA kernels of `reps` calls of fn, by total time (divide by reps for one call's share)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    print(f"profile {label}, {reps} calls:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)


def run_shape(name, d, f, e, k, tokens, copy_bw, lines, train, profile=False, vllm=False):
    ours, hf = build(d, f, e, k)
    x = torch.randn(1, tokens, d, device="cuda", dtype=torch.bfloat16)
    r = {"shape": name}
    from moecompile.runtime import choices as mc

    with torch.no_grad():
        errs = []
        for variant in TIMED:
            use_variant(mc, variant)
            for cf in (0.0, 1.0, -1.5):
                errs.append(rel(ours(x, capacity_factor=cf), reference_fp32(ours, x, cf)))
            r[variant] = bench(lambda: ours(x))
            r[f"graph_{variant}"] = graph_time(ours, x)
        r["err"] = max(errs)
        r["err_hf"] = rel(hf(x), reference_fp32(ours, x, 0.0))
        r["ours"] = min(r[v] for v in TIMED)
        r["ours_graph"] = min(r[f"graph_{v}"] for v in TIMED)
        best = min(TIMED, key=lambda v: r[f"graph_{v}"])
        r["hf"] = bench(lambda: hf(x))
        compiled = torch.compile(hf)
        compiled(x)
        r["hf_compile"] = bench(lambda: compiled(x))
        r["bare"] = bare_grouped_gemms(d, f, e, k, tokens)
        from moecompile.ir import ops
        _, ids = ops.route(x.reshape(-1, d).float() @ ours.router.weight.float().t(), k, 0.0, True)
        hit = torch.unique(ids).numel()
        r["weight_read"] = hit * 3 * d * f * 2 / copy_bw * 1e3  # ms to read the hit experts' weights once
        if profile:
            use_variant(mc, best)
            print_kernel_profile(f"{name} ({best})", lambda: ours(x))
    flops = 6 * tokens * k * d * f
    best_ours = min(r["ours"], r["ours_graph"])
    best_peer = min(r["hf"], r["hf_compile"])
    r["tflops"] = flops / (best_ours * 1e-3) / 1e12
    line = (f"| {name} | {d}, {f}, {e}, {k}, {tokens} | " + "".join(f"{r[v]:.3f} | " for v in TIMED) +
            f"{r['ours_graph']:.3f} ({best}) | {r['hf']:.3f} | "
            f"{r['hf_compile']:.3f} | {r['bare']:.3f} | {r['tflops']:.0f} | {best_ours / r['bare']:.2f} | "
            f"{best_peer / best_ours:.2f} | {r['err']:.1e} / {r['err_hf']:.1e} |")
    if name == "decode":
        line += f" weight read {r['weight_read']:.3f} ms: ours/roofline {best_ours / r['weight_read']:.2f}"
    lines.append(line)
    print(line, flush=True)
    if vllm:
        use_variant(mc, best)
        with torch.no_grad():
            vllm_peer(ours, x, k, lines, name, r)
    if train:
        xg = x.clone().requires_grad_()
        grad = torch.randn_like(x)
        ours.train()
        hf.train()
        use_variant(mc, best)

        def step(block):  # as a training step: gradients set to None first (optimizer.zero_grad's default)
            block.zero_grad(set_to_none=True)
            xg.grad = None
            block(xg).backward(grad)
        from moecompile.ir import ops
        keep_h = ops.expert_ffn
        times = {"ours": [], "recompute": [], "hf": []}
        # "recompute": the inference op, whose backward recomputes the first projection. Interleaved rounds: a
        # host-bound step (GPT-2's) drifts with the host between single measurements.
        try:
            for _ in range(TRAIN_ROUNDS):
                for label, expert_ffn, block in (("ours", keep_h, ours), ("recompute", ops.experts, ours),
                                                 ("hf", keep_h, hf)):
                    ops.expert_ffn = expert_ffn
                    times[label].append(bench(lambda: step(block)))
        finally:
            ops.expert_ffn = keep_h
        t_ours, t_recompute, t_hf = (statistics.median(times[v]) for v in ("ours", "recompute", "hf"))
        tl = f"| {name} fwd+bwd | {t_ours:.3f} | {t_recompute:.3f} | {t_hf:.3f} | {t_hf / t_ours:.2f} |"
        lines.append(("train", tl))
        print(tl, flush=True)
    use_variant(mc, "auto")  # later runs (the GPT-2 end to end) get the automatic choice
    ours = hf = None  # frees the device memory before the next shape
    torch.cuda.empty_cache()


def gpt2_end_to_end(lines):
    from transformers import GPT2Config, GPT2LMHeadModel

    import moecompile

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 50257, (32, 512), device="cuda")
    with torch.no_grad():
        dense_logits = model(ids, use_cache=False).logits
        t_dense = bench(lambda: model(ids, use_cache=False))
        moecompile.moeize(model, experts=16, top_k=2, capacity_factor=0.0, method="upcycle", progress=False)
        moe_logits = model(ids, use_cache=False).logits
        from moecompile.runtime import choices as mc

        t_moe = {}
        for variant in VARIANTS:  # eager, so the kernels' launch cost counts too
            use_variant(mc, variant)
            t_moe[variant] = bench(lambda: model(ids, use_cache=False))
    tokens = ids.numel()
    line = "\n".join([f"| GPT-2 124M dense (HF) | {tokens / t_dense * 1e3:,.0f} |"] + [
        f"| GPT-2 upcycled 16 experts top-2 (moecompile, {' + '.join(VARIANTS[v])}) | {tokens / t * 1e3:,.0f} |"
        for v, t in t_moe.items()])
    line += f"\n\nupcycled vs dense logits, relative error (bf16): {rel(moe_logits, dense_logits):.2e}"
    lines.append(("e2e", line))
    print(line, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--no-e2e", action="store_true")
    p.add_argument("--profile", action="store_true", help="print a kernel breakdown for two shapes")
    p.add_argument("--vllm", action="store_true", help="vLLM's fused_moe GEMMs as a peer (bench/peers/"
                   "vllm_fused_moe.py; fetched into .peers/ where there is network, else carried there)")
    a = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    import transformers

    start = time.time()
    copy_bw = copy_bandwidth()
    if a.vllm:
        from peers import vllm_fused_moe

        vllm_fused_moe.fetch()
    lines = []
    for name in a.shapes.split(","):
        run_shape(name, *SHAPES[name], copy_bw, lines, train=name in TRAIN_SHAPES,
                  profile=a.profile and name in ("gpt2-upcycled", "qwen3-moe"), vllm=a.vllm)
    if not a.no_e2e:
        gpt2_end_to_end(lines)
    fwd = [l for l in lines if isinstance(l, str)]
    train = [l[1] for l in lines if isinstance(l, tuple) and l[0] == "train"]
    e2e = [l[1] for l in lines if isinstance(l, tuple) and l[0] == "e2e"]
    vllm_rows = [l[1] for l in lines if isinstance(l, tuple) and l[0] == "vllm"]
    text = [
        "# GPU MoE layer: moecompile vs HF transformers vs bare grouped GEMMs",
        "",
        f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, "
        f"transformers {transformers.__version__}, python {platform.python_version()}; "
        f"measured copy bandwidth {copy_bw / 1e12:.2f} TB/s.",
        f"Command: `python bench/{' '.join(['moe_layer.py'] + sys.argv[1:])}` ({time.time() - start:.0f} s).",
        "Forward of one SwiGLU MoE layer, bf16, dropless, median ms. ours <first> + <second> = moecompile eager "
        "with these kernels for the two expert projections (runtime/choices.py): persistent = the persistent Triton "
        "TMA grouped GEMM (bias + activation in its epilogue; gate and up rows in one TMA box), tma = the "
        "non-persistent one, grouped_mm = torch._grouped_mm (after the first projection a Triton activation "
        "pass), auto = the runtime's default for the shape (runtime/choices.py; triton_decode at decode); "
        "graph = the fastest of them replayed from a CUDA graph; "
        "HF = MixtralSparseMoeBlock, experts_implementation grouped_mm; HF compile = "
        "the same under torch.compile (default mode); bare = the two torch._grouped_mm GEMMs alone on perfectly "
        "balanced routing. TF/s: useful FLOPs (6·T·k·d·f) over ours' best time. err: relative error vs a float32 "
        "reference (max over capacity factors 0, 1.0, -1.5) / HF's error at 0.",
        "",
        "| shape | d, f, E, k, tokens | " + "".join(f"ours {' + '.join(VARIANTS[v])} | " for v in TIMED) +
        "ours graph | HF | HF compile | bare | TF/s | ours / bare | best peer / ours | err ours / HF |",
        "|---|---|" + "---|" * (len(TIMED) + 10),
        *fwd,
    ]
    if train:
        text += ["", "Training step (forward + backward, gradients set to None before each), median ms (median of "
                 f"{TRAIN_ROUNDS} interleaved rounds); ours keeps "
                 "the first projection's output for the backward (experts_train), 'h recomputed' runs the "
                 "inference op, whose backward recomputes it:", "",
                 "| shape | ours | ours, h recomputed | HF grouped_mm | HF / ours |", "|---|---|---|---|---|", *train]
    if vllm_rows:
        text += ["", "vLLM 0.34.0's fused_moe Triton kernel (its tuned H200 configs) on the same weights and routing, "
                 "ms from CUDA graphs: GEMMs = its two kernel launches alone; layer = with the token alignment, "
                 "activation and sum over k in torch (vLLM runs those as its own CUDA ops). ours graph as above; "
                 "weight read = the hit experts' weights at the copy bandwidth.", "",
                 "| shape | vLLM GEMMs | vLLM layer | ours graph | vLLM GEMMs / ours | weight read | err vLLM |",
                 "|---|---|---|---|---|---|---|", *vllm_rows]
    if e2e:
        text += ["", "GPT-2 end to end, forward, batch 32 × 512, bf16, tokens/s:", "", "| model | tokens/s |",
                 "|---|---|", *e2e]
    out = "\n".join(text) + "\n"
    print(out)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(out)


if __name__ == "__main__":
    main()
