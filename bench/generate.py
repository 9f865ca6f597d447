"""Whole-model greedy generation of MoE models at real per-layer sizes: prefill ms, decode ms per step, tokens/s, the
weight-read floor, and a profile of one decode step. Random weights, bf16, one H200.

Modes, all in one run:
  hf-eager           HF generate, default (dynamic) cache, HF's default experts implementation
  hf-experts-mc      the same with model.set_experts_implementation("moecompile") (eager)
  hf-inductor        HF generate, static cache, compile_config(backend="inductor", mode="reduce-overhead", fullgraph)
  hf-moecompile      the same with backend="moecompile"
  moecompile         moecompile.generate: compiled prefill, the whole decode step (layers, logits, token choice)
                     one CUDA graph, replayed with no host synchronisation per token
  hf-custom-generate HF generate with custom_generate=moecompile.generation.custom_generate: HF's preparation, then
                     moecompile.generate's loop (not in the default list; cos is not measured)
  moecompile-unfused the same without the fuse_projections pass (not in the default list: what that pass gives)
  moecompile-sorted  the same without the direct_experts pass: the sorted experts at decode (not in the default list)
  moecompile-repeat-kv the same without the gqa_attention pass: HF's repeated key/value heads (not in the default list)
  moecompile-gemm    the same without decode_matvec: cuBLAS GEMMs for the one-token linears (not in the default list)
Floor: the bytes one decode step must read (every weight except the embedding table, of which one row per sequence;
expert tensors weighted by the expected fraction of experts the batch hits under uniform routing,
1 - (1 - k/E)^batch), at the copy bandwidth measured in the same run. Correctness: cosine of the first compiled step's
logits with HF eager's (for hf-inductor / hf-moecompile the second step: HF runs the prompt eagerly), and the greedy
tokens that agree with HF eager's before the first difference (bf16 near-ties may diverge later).

  python bench/generate.py --out bench/results/gpu-generate.md                      # the H200 run
  python bench/generate.py --tiny --models mixtral-8x7b --batches 1 --new 8         # a quick smoke run
  python bench/generate.py --sample --modes hf-inductor,moecompile                  # sampled: top-k 50, top-p 0.9
With --sample every mode samples (HF's generate from its global generator, moecompile's from its seeded one), so the
agree column counts tokens that match by chance.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time

import torch
import transformers
from compile import instantiate  # bench/compile.py, beside this script: the same random HF models

from moecompile.generation import Generator, Sampling, custom_generate

MODELS = {  # name: (config class, model class, layers, sizes) - per-layer sizes of the published models
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 8, dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936)),
    "mixtral-8x7b": ("MixtralConfig", "MixtralForCausalLM", 4, dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", 4, dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5,
        first_k_dense_replace=0, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280)),
}
TINY = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=1024, q_lora_rank=64, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
MODES = ("hf-eager", "hf-experts-mc", "hf-inductor", "hf-moecompile", "moecompile")
OTHER_MODES = ("hf-custom-generate",)
GENERATOR_OPTIONS = {"moecompile": None, "moecompile-unfused": {"fuse_projections": False},
                     "moecompile-sorted": {"direct_experts": False}, "moecompile-repeat-kv": {"gqa_attention": False},
                     "moecompile-gemm": {"decode_matvec": False}}
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def build(name: str, tiny: bool, device: str, dtype: torch.dtype, layers: int | None = None):
    config_cls, model_cls, default_layers, sizes = MODELS[name]
    layers = layers or default_layers
    config_type = getattr(transformers, config_cls)
    if tiny:
        sizes = {**sizes, **{k: v for k, v in TINY.items() if k in sizes}}
        if "kv_lora_rank" in sizes:  # MLA: a key and value head per query head
            sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    config = config_type(num_hidden_layers=layers, max_position_embeddings=4096, **sizes)
    config.eos_token_id = None
    model = instantiate(model_cls, config, device, dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device copy (read + write)."""
    if device != "cuda":
        return float("nan")
    src = torch.empty(2 ** 31, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def floor_bytes(model, batch: int) -> float:
    config = model.config
    experts = next(getattr(config, k) for k in EXPERT_COUNT_KEYS if getattr(config, k, None))
    hit = 1 - (1 - config.num_experts_per_tok / experts) ** batch
    total = 0.0
    for pname, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if "embed_tokens" in pname:
            total += min(batch, p.shape[0]) * p.shape[1] * p.element_size()
        elif ".experts." in pname and p.dim() >= 2 and p.shape[0] == experts:
            total += size * hit
        else:
            total += size
    return total


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> float:
    """Median seconds of fn()."""
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def agree(a: torch.Tensor, b: torch.Tensor) -> int:
    """Greedy tokens that agree before the first difference (the shortest row)."""
    same = (a == b).all(0).long()
    return int(same.cumprod(0).sum())


def cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def hf_mode(model, mode: str, ids, new: int, device: str, reps: int, reference, sampling: Sampling | None = None):
    """(prefill s, decode s per step, tokens, cosine) of HF generate in one of the hf-* modes."""
    from transformers import CompileConfig, StaticCache

    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    if sampling is not None:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    step = 0
    model.set_experts_implementation("moecompile" if mode == "hf-experts-mc" else "grouped_mm")
    if mode in ("hf-inductor", "hf-moecompile"):
        backend = "inductor" if mode == "hf-inductor" else "moecompile"
        # one static cache for every call: HF sizes a cache of its own by max_new_tokens (a new graph per length)
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new)
        model.generation_config.compile_config = CompileConfig(backend=backend, mode="reduce-overhead",
                                                               fullgraph=True)
        step = 1  # HF runs the prompt eagerly: its first compiled step is the second

        def run(n, **extra):
            cache.reset()
            return model.generate(ids, max_new_tokens=n, past_key_values=cache, **kwargs, **extra)
    else:
        def run(n, **extra):
            return model.generate(ids, max_new_tokens=n, **kwargs, **extra)
    torch._dynamo.reset()
    out = run(new, output_logits=True, return_dict_in_generate=True)  # compile, record the CUDA graphs
    out = run(new, output_logits=True, return_dict_in_generate=True)
    cosine = float("nan") if reference is None else cos(out.logits[step], reference.logits[step])
    prefill = timed(lambda: run(1), device, reps)
    total = timed(lambda: run(new), device, reps)
    model.set_experts_implementation("grouped_mm")
    model.generation_config.compile_config = None
    return prefill, (total - prefill) / (new - 1), out.sequences, cosine, out


def moecompile_mode(model, ids, new: int, device: str, reps: int, reference, profile: bool, options=None,
                    sampling: Sampling | None = None):
    gen = Generator(model, ids.shape[0], ids.shape[1] + new, options=options)
    tokens = gen(ids, new, sampling=sampling)  # compile prefill and step, capture the step
    cosine = float("nan") if reference is None else cos(gen.prefill_logits, reference.logits[0])
    prefill = timed(lambda: gen.prefill(ids, sampling=sampling), device, reps)
    decode = []
    for _ in range(reps):
        gen.prefill(ids, sampling=sampling)
        decode.append(timed(lambda: gen.decode(new - 1), device, 1) / (new - 1))
    report = profile_step(gen, ids, sampling) if profile and device == "cuda" else None
    return prefill, statistics.median(decode), tokens, cosine, report


def custom_generate_mode(model, ids, new: int, device: str, reps: int, sampling: Sampling | None = None):
    """(prefill s, decode s per step, tokens) of HF generate running moecompile's loop through custom_generate."""
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    if sampling is not None:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                      seed=sampling.seed)

    def run(n):
        return model.generate(ids, max_new_tokens=n, custom_generate=custom_generate, **kwargs)

    tokens = run(new)  # compile prefill and step, capture the step
    run(1)
    prefill = timed(lambda: run(1), device, reps)
    total = timed(lambda: run(new), device, reps)
    return prefill, (total - prefill) / (new - 1), tokens


def profile_step(gen: Generator, ids, sampling: Sampling | None = None, steps: int = 4) -> str:
    """Kernel time of the compiled decode step run uncaptured (the same kernels the graph replays), top kernels."""
    from torch.profiler import ProfilerActivity, profile

    gen.prefill(ids, sampling=sampling)
    gen.cuda_graph = False
    try:
        gen.decode(2)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            gen.decode(steps)
            torch.cuda.synchronize()
    finally:
        gen.cuda_graph = True
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total_us = sum(e.self_device_time_total for e in kernels) / steps
    launches = sum(e.count for e in kernels) / steps
    lines = [f"kernel time per step {total_us / 1e3:.3f} ms in {launches:.0f} kernels; top kernels (ms per step):"]
    for e in kernels[:14]:
        lines.append(f"  {e.self_device_time_total / steps / 1e3:.3f}  x{e.count // steps}  {e.key[:100]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    parser.add_argument("--batches", default="1,8,16,64")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="small widths (a smoke run)")
    parser.add_argument("--layers", type=int, help="layers of every model (default: each model's in MODELS)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--sample", action="store_true",
                        help="sample (temperature 1, top-k 50, top-p 0.9) in every mode")
    parser.add_argument("--out")
    parser.add_argument("--commit", help="the commit to name in the header (default: git's HEAD)")
    args = parser.parse_args(argv)
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    modes = args.modes.split(",")
    sampling = Sampling(top_k=50, top_p=0.9, seed=0) if args.sample else None
    unknown = set(modes) - set(MODES) - set(OTHER_MODES) - set(GENERATOR_OPTIONS)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}")
    bandwidth = copy_bandwidth(device)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    header = [f"# Whole-model generation ({'tiny widths, ' if args.tiny else ''}{device})", "",
              f"Command: `python bench/generate.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
              f"(commit {commit or '?'})", "",
              f"Machine: {torch.cuda.get_device_name() if device == 'cuda' else platform.processor()}; torch "
              f"{torch.__version__}, transformers {transformers.__version__}; copy bandwidth "
              f"{bandwidth / 1e12:.2f} TB/s. Prompt {args.prompt} tokens, {args.new} new tokens, "
              f"{'sampled (top-k 50, top-p 0.9)' if sampling else 'greedy'}, "
              f"{str(dtype).replace('torch.', '')}, random weights; medians of {args.reps}.", "",
              "| model | batch | mode | prefill ms | decode ms/step | tokens/s | floor ms | x floor | cos | agree |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(header), flush=True)
    rows, profiles = [], []
    for name in args.models.split(","):
        model = build(name, args.tiny, device, dtype, args.layers)
        for batch in [int(b) for b in args.batches.split(",")]:
            ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt),
                                generator=torch.Generator().manual_seed(batch)).to(device)
            floor = floor_bytes(model, batch) / bandwidth
            reference = None
            for mode in modes:
                try:
                    if mode in GENERATOR_OPTIONS:
                        prefill, decode, tokens, cosine, report = moecompile_mode(
                            model, ids, args.new, device, args.reps, reference, not args.no_profile and batch == 1,
                            GENERATOR_OPTIONS[mode], sampling)
                        if report:
                            profiles.append(f"{name}, batch {batch}, {mode}:\n{report}")
                    elif mode == "hf-custom-generate":
                        prefill, decode, tokens = custom_generate_mode(model, ids, args.new, device, args.reps,
                                                                       sampling)
                        cosine = float("nan")
                    else:
                        prefill, decode, tokens, cosine, out = hf_mode(model, mode, ids, args.new, device, args.reps,
                                                                       reference, sampling)
                        if mode == "hf-eager":
                            reference, cosine = out, 1.0
                    matched = agree(tokens[:, args.prompt:], reference.sequences[:, args.prompt:]) \
                        if reference is not None else -1
                    row = (f"| {name} | {batch} | {mode} | {prefill * 1e3:.2f} | {decode * 1e3:.3f} | "
                           f"{batch / decode:.0f} | {floor * 1e3:.3f} | {decode / floor:.2f} | {cosine:.5f} | "
                           f"{matched}/{args.new} |")
                except Exception as exc:  # a mode that fails is a row of the table, not the end of the run
                    row = f"| {name} | {batch} | {mode} | **{type(exc).__name__}**: {str(exc).splitlines()[0][:150]} |"
                print(row, flush=True)
                rows.append(row)
        del model
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    text = "\n".join(header + rows) + "\n"
    if profiles:
        text += "\n## One decode step, profiled (compiled step run uncaptured)\n\n```\n" + "\n\n".join(profiles) + \
            "\n```\n"
    print(text[len("\n".join(header + rows)):])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
