"""Whole-model generation of MoE models at real per-layer sizes (or every layer, --full): prefill ms, decode ms per
step, tokens/s, the floor of the bytes one step reads (weights and key/value cache), and a profile of one decode step.
Random weights, bf16 (FP8 weights in moecompile-fp8, with --fp8 or --fp8-only).

Modes, all in one run:
  hf-eager           HF generate, default (dynamic) cache, HF's default experts implementation
  hf-experts-mc      the same with model.set_experts_implementation("moecompile") (eager)
  hf-inductor        HF generate, static cache, compile_config(backend="inductor", mode="reduce-overhead", fullgraph)
  hf-moecompile      the same with backend="moecompile"
  moecompile         moecompile.generate: compiled prefill, the whole decode step (layers, logits, token choice)
                     one CUDA graph, replayed with no host synchronisation per token
  moecompile-fp8     the same on the model in transformers' FineGrainedFP8 layout (experts and every linear but
                     lm_head and the routers in FP8, no bf16 copy; moecompile's FP8 ops run it with default options):
                     --fp8 adds it after the other modes, converting their bf16 model in place
                     (finegrained_fp8.to_native_fp8), and compares it with moecompile's first-step logits and step
                     time; --fp8-only runs it alone, the model built straight into FP8 one module at a time (on
                     the meta device, each module materialised, randomly initialised and quantised in turn)
  moecompile-fp8-head the same FP8 model with option fp8_linears, which quantises lm_head too (128 x 128 blocks,
                     once, when the step compiles): the checkpoint layout keeps it bf16, and at batch 1 it is most of
                     the bytes of a Qwen3-30B-A3B step (not in the default list; after moecompile-fp8, on its model)
  hf-custom-generate HF generate with custom_generate=moecompile.generation.custom_generate: HF's preparation, then
                     moecompile.generate's loop (not in the default list; cos is not measured)
  moecompile-unfused the same without the fuse_projections pass (not in the default list: what that pass gives)
  moecompile-sorted  the same without the direct_experts pass: the sorted experts at decode (not in the default list)
  moecompile-direct  the same with direct_experts taking up to one assignment per expert (Mixtral's batches of up to
                     4 tokens, Qwen3-30B-A3B's of up to 16, which its threshold keeps sorted): the data for
                     direct_experts.MAX_ASSIGNMENTS_PER_EXPERT (not in the default list)
  moecompile-repeat-kv the same without the gqa_attention pass: HF's repeated key/value heads (not in the default list)
  moecompile-gemm    the same without decode_matvec: cuBLAS GEMMs for the one-token linears (not in the default list)
  moecompile-split-kv the same with option decode_attention: the step's attention on moecompile's split-KV kernel
                     instead of SDPA (not in the default list)
  moecompile-pdl     the same with MOECOMPILE_PDL=on: every graph's kernels (inductor's, the routing and direct experts)
                     launched as programmatic dependents (Hopper's PDL: a kernel starts launching while the one
                     before it finishes; the default, auto, does so in batch-1 steps); moecompile-no-pdl with off:
                     plain launches; moecompile-fp8-pdl / -fp8-no-pdl the same on the FP8 model (none in the
                     default list)
Floor: the bytes one decode step must read, at the copy bandwidth measured in the same run. Weights: every parameter
except the embedding table, of which one row per sequence; expert tensors weighted by the expected fraction of experts
the batch hits under uniform routing, 1 - (1 - k/E)^batch; FP8 tensors at one byte per element plus a float32 scale
per 128 x 128 block. Cache: the keys and values of every layer over the mean cache length of the timed steps (a
sliding-window layer only its window; DeepSeek-V3's cache is its latent and rope key per token, as transformers stores
it: HF's attention expands it into every head's keys and values at each step, moecompile's absorbed attention reads it
as it is). Correctness: cosine of the
first compiled step's logits with HF eager's (for hf-inductor / hf-moecompile the second step: HF runs the prompt
eagerly), and the greedy tokens that agree with HF eager's before the first difference (bf16 near-ties may diverge
later). A model, batch or mode whose weights and cache do not fit the card is a row "does not fit",
estimated from the config before anything is built (moecompile-fp8: its FP8 weights, no bf16 copy; converting the
bf16 model never holds more than the bf16 modes did, and --fp8-only's build one module's bf16 weights beyond them).

  python bench/generate.py --out bench/results/gpu-generate.md                      # a slice of each model
  python bench/generate.py --full --fp8 --batches 1,16,64 --modes hf-inductor,moecompile  # every layer, FP8 vs bf16
  python bench/generate.py --full --fp8-only --models mixtral-8x7b --batches 1,16    # FP8 where bf16 does not fit
  python bench/generate.py --full --modes moecompile --save-logits L; ... --full --fp8-only --bf16-logits L
                                                     # bf16 and FP8 of one model in two calls, compared (cos, speed-up)
  python bench/generate.py --context 4096 --batches 64 --modes moecompile --attention-probe   # long context
  python bench/generate.py --models all --sample --batches 1,16,64 --new 16 --modes moecompile,hf-moecompile  # sampled
  python bench/generate.py --tiny --models mixtral-8x7b --batches 1 --new 8         # a quick smoke run
With --sample every mode samples (HF's generate from its global generator, moecompile's from its seeded one), so the
agree column counts tokens that match by chance. With --tiny on the CPU the moecompile modes skip inductor (the
backend's passes still run). --attention-probe times one layer's decode attention over the cache (batch: the largest
of --batches, the --context) as the compiled step calls SDPA, with each SDPA backend forced and on moecompile's
split-KV kernel, each replayed from a CUDA graph, in a table of its own.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import warnings
import zlib

import torch
import transformers

import moecompile.backend
from moecompile.generation import Generator, Sampling, custom_generate
from moecompile.integrations.finegrained_fp8 import to_native_fp8

MODELS = {  # name: (config class, model class, layers, sizes) - per-layer sizes of the published models
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 8, dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936)),
    "mixtral-8x7b": ("MixtralConfig", "MixtralForCausalLM", 4, dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", 2, dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5,
        first_k_dense_replace=0, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280)),
    "qwen1.5-moe-a2.7b": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", 8, dict(
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=151936)),
    "olmoe-1b-7b": ("OlmoeConfig", "OlmoeForCausalLM", 8, dict(
        hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=50304)),
    "gpt-oss-20b": ("GptOssConfig", "GptOssForCausalLM", 4, dict(
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128, vocab_size=201088)),
}
FULL = {  # --full: the published depth, and what differs from the slices' layers there
    "qwen3-30b-a3b": (48, {}), "mixtral-8x7b": (32, {}), "deepseek-v3": (61, {"first_k_dense_replace": 3}),
    "qwen1.5-moe-a2.7b": (24, {}), "olmoe-1b-7b": (16, {}), "gpt-oss-20b": (24, {}),
}
TINY = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, shared_expert_intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024, q_lora_rank=64,
            kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
MODES = ("hf-eager", "hf-experts-mc", "hf-inductor", "hf-moecompile", "moecompile")
OTHER_MODES = ("hf-custom-generate",)
FP8_MODE = "moecompile-fp8"
FP8_HEAD_MODE = "moecompile-fp8-head"
FP8_PDL_MODES = ("moecompile-fp8-pdl", "moecompile-fp8-no-pdl")
FP8_MODES = (FP8_MODE, FP8_HEAD_MODE, *FP8_PDL_MODES)  # on the FP8 model: after the bf16 modes, FP8_MODE first
PDL_SETTINGS = {"moecompile-pdl": "on", "moecompile-no-pdl": "off",  # MOECOMPILE_PDL while they compile and run
                FP8_PDL_MODES[0]: "on", FP8_PDL_MODES[1]: "off"}
GENERATOR_OPTIONS = {"moecompile": {}, FP8_MODE: {}, FP8_HEAD_MODE: {"fp8_linears": True},
                     "moecompile-unfused": {"fuse_projections": False},
                     "moecompile-sorted": {"direct_experts": False}, "moecompile-repeat-kv": {"gqa_attention": False},
                     "moecompile-gemm": {"decode_matvec": False}, "moecompile-split-kv": {"decode_attention": True},
                     "moecompile-direct": {}, **{mode: {} for mode in PDL_SETTINGS}}
DIRECT_MODE_ASSIGNMENTS_PER_EXPERT = 1.0  # moecompile-direct's direct_experts.MAX_ASSIGNMENTS_PER_EXPERT
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
ROUTER_SUFFIXES = (".gate.weight", ".router.weight")  # routers: not linears in transformers' FP8 layout
FP8_BLOCK = 128
PROBE_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
PROBE_BLOCKS = (32, 64, 128)  # cache positions per step of moecompile's split-KV kernel in the probe
HEADROOM = 4 * 2 ** 30  # bytes beyond weights and cache a run needs (activations, logits, workspaces)


def make_config(name: str, tiny: bool, layers: int | None = None, full: bool = False, max_positions: int = 4096):
    """The transformers config of a MODELS entry: its slice of layers, `layers`, or (full) every layer."""
    config_cls, _, default_layers, sizes = MODELS[name]
    if full:
        default_layers, extra = FULL[name]
        sizes = {**sizes, **extra}
    if tiny:
        sizes = {**sizes, **{k: v for k, v in TINY.items() if k in sizes}}
        if "kv_lora_rank" in sizes:  # MLA: a key and value head per query head
            sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    return getattr(transformers, config_cls)(num_hidden_layers=layers or default_layers,
                                             max_position_embeddings=max_positions, eos_token_id=None, **sizes)


def build(name: str, config, device: str, dtype: torch.dtype, fp8: bool = False, seed: int = 0):
    """The random model of a MODELS entry, built on the meta device and materialised one module at a time, each
    module's values drawn from its name: the bf16 model and (`fp8`) the one in transformers' FineGrainedFP8 layout,
    each quantised module before the next (no whole bf16 copy), are the same model, whatever the call that builds
    them. HF's initialisation; routers with unit-variance logits (HF initialises some to zero), a realistic spread of
    tokens over experts."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = getattr(transformers, MODELS[name][1])(config).eval()
    finally:
        torch.set_default_dtype(previous)

    def fill(module_name, module):
        torch.manual_seed(seed + zlib.crc32(module_name.encode()))
        module.to_empty(device=device, recurse=False)
        model._init_weights(module)
        with torch.no_grad():
            for pname, p in module.named_parameters(recurse=False):
                if f"{module_name}.{pname}".endswith(ROUTER_SUFFIXES) and p.dim() == 2:
                    p.normal_(0.0, p.shape[1] ** -0.5)

    if fp8:
        to_native_fp8(model, fill)
    for module_name, module in model.named_modules():  # all (bf16), or what stays unquantised (FP8)
        if any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
            fill(module_name, module)
    model.tie_weights()  # a tied head is the embedding filled above
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def parameter_shapes(name: str, config) -> dict[str, torch.Size]:
    """Every parameter's shape, from a model built on the meta device (no memory): sizes before building."""
    with torch.device("meta"):
        model = getattr(transformers, MODELS[name][1])(config)
    return {pname: p.shape for pname, p in model.named_parameters()}


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


def expert_count(config) -> int:
    return next(getattr(config, k) for k in EXPERT_COUNT_KEYS if getattr(config, k, None))


def is_expert(pname: str, shape, experts: int) -> bool:
    return ".experts." in pname and len(shape) >= 2 and shape[0] == experts


def fp8_parameters(shapes: dict, config, linears: bool = True, head: bool = False) -> frozenset[str]:
    """The parameters an FP8 run reads in FP8: the expert weight tensors, and with `linears` every other linear
    weight of the layers except the routers (embedding, norms, biases and lm_head stay bf16), as in transformers'
    FineGrainedFP8 layout; with `head` lm_head too (moecompile-fp8-head)."""
    experts = expert_count(config)
    chosen = set()
    for pname, shape in shapes.items():
        if is_expert(pname, shape, experts) and len(shape) == 3:
            chosen.add(pname)
        elif linears and len(shape) == 2 and ".layers." in pname and pname.endswith(".weight") \
                and not pname.endswith(ROUTER_SUFFIXES):
            chosen.add(pname)
        elif head and pname == "lm_head.weight":
            chosen.add(pname)
    return frozenset(chosen)


def fp8_bytes(shape) -> int:
    """One byte per element and a float32 scale per 128 x 128 block of the last two dimensions."""
    *lead, rows, cols = shape
    return math.prod(shape) + 4 * math.prod(lead) * -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)


def weight_bytes(shapes: dict, config, batch: int, itemsize: int, fp8: frozenset[str] = frozenset()) -> float:
    """The weight bytes one decode step of `batch` sequences reads (see the module docstring)."""
    experts = expert_count(config)
    hit = 1 - (1 - config.num_experts_per_tok / experts) ** batch
    total = 0.0
    for pname, shape in shapes.items():
        size = fp8_bytes(shape) if pname in fp8 else math.prod(shape) * itemsize
        if "embed_tokens" in pname:
            total += min(batch, shape[0]) * shape[1] * itemsize
        elif is_expert(pname, shape, experts):
            total += size * hit
        else:
            total += size
    return total


def resident_bytes(shapes: dict, itemsize: int, fp8: frozenset[str] = frozenset()) -> int:
    """Device memory of the parameters, those in `fp8` stored in FP8 only (transformers' FineGrainedFP8 layout)."""
    return sum(fp8_bytes(s) if p in fp8 else math.prod(s) * itemsize for p, s in shapes.items())


def kv_widths(config, absorbed: bool = False) -> tuple[int, int, int, int]:
    """(query heads, key/value heads, key width, value width) of the cache a layer's step reads; MLA as HF's
    attention reads it (the whole keys and values of every head, expanded from the latents), or `absorbed` as
    moecompile's generation reads it: one latent of kv_lora_rank and the rope key per token."""
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):
        if absorbed:
            return heads, 1, config.kv_lora_rank, config.qk_rope_head_dim
        return heads, heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, config.num_key_value_heads, head_dim, head_dim


def cache_bytes(config, batch: int, length: float, itemsize: int, windows: bool = True) -> float:
    """Key and value bytes of every layer over `length` positions; with `windows`, a sliding-window layer's only
    over its window (what it must read; the static cache moecompile allocates keeps every layer full length). MLA's
    cache holds the latent and the rope key (kv_widths absorbed), in transformers' cache as in moecompile's."""
    _, kv, key, val = kv_widths(config, absorbed=True)
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    positions = sum(min(length, window) if windows and window and t == "sliding_attention" else length
                    for t in types)
    return positions * kv * (key + val) * batch * itemsize


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
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten().to(a.device), dim=0).item()


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
    """(prefill s, decode s per step, tokens, cosine, profile or None, the first step's logits)."""
    gen = Generator(model, ids.shape[0], ids.shape[1] + new, options=options)  # the cache: prompt + new tokens
    tokens = gen(ids, new, sampling=sampling)  # compile prefill and step, capture the step
    logits = gen.prefill_logits.clone()
    cosine = float("nan") if reference is None else cos(logits, reference.logits[0])
    prefill = timed(lambda: gen.prefill(ids, sampling=sampling), device, reps)
    decode = []
    for _ in range(reps):
        gen.prefill(ids, sampling=sampling)
        decode.append(timed(lambda: gen.decode(new - 1), device, 1) / (new - 1))
    report = profile_step(gen, ids, sampling) if profile and device == "cuda" else None
    return prefill, statistics.median(decode), tokens, cosine, report, logits


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
    """Kernel time of the compiled decode step run uncaptured (the same kernels the graph replays), per kernel."""
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
    lines = [f"kernel time per step {total_us / 1e3:.3f} ms in {launches:.0f} kernels; every kernel (ms per step):"]
    for e in kernels:  # all of them: at batch 1 the many small ones are what separates the step from its floor
        lines.append(f"  {e.self_device_time_total / steps / 1e3:.3f}  x{e.count // steps}  {e.key[:100]}")
    return "\n".join(lines + autotuned_tiles())


def autotuned_tiles() -> list[str]:
    """The tiles the decode kernels' autotuners picked in this process, per autotuning key: a kernel slower in the
    step than in bench/direct_experts.py may have picked others. (The runtime's direct experts take the tiles of
    kernels/configs/direct_experts.json; their autotuners run only where something calls them without tiles.)"""
    from moecompile.kernels import triton_direct, triton_fp8_decode

    tuners = {"direct": triton_direct.KERNELS,
              "FP8 direct": (triton_fp8_decode._fp8_direct_in_tuned, triton_fp8_decode._fp8_direct_out_tuned),
              "FP8 linear": (triton_fp8_decode._fp8_linear_matvec_tuned, triton_fp8_decode._fp8_linear_dot_tuned)}
    lines = []
    for label, kernels in tuners.items():
        for tuner in kernels:
            for key, config in tuner.cache.items():
                tiles = "x".join(str(config.kwargs[k]) for k in ("BLOCK_N", "BLOCK_K"))
                lines.append(f"  autotuned {label} {tuner.fn.__name__} {key[:len(tuner.keys)]}: {tiles}, "
                             f"{config.num_warps} warps, {config.num_stages} stages")
    return lines


@contextlib.contextmanager
def pass_thresholds(mode: str):
    """moecompile-direct: direct_experts' threshold raised while the mode compiles its graphs; the PDL modes: their
    MOECOMPILE_PDL while they compile and run."""
    from moecompile.passes import direct_experts
    from moecompile.runtime import choices

    kept = direct_experts.MAX_ASSIGNMENTS_PER_EXPERT, choices.PROGRAMMATIC_LAUNCH
    if mode == "moecompile-direct":
        direct_experts.MAX_ASSIGNMENTS_PER_EXPERT = DIRECT_MODE_ASSIGNMENTS_PER_EXPERT
    choices.PROGRAMMATIC_LAUNCH = PDL_SETTINGS.get(mode, kept[1])
    try:
        yield
    finally:
        direct_experts.MAX_ASSIGNMENTS_PER_EXPERT, choices.PROGRAMMATIC_LAUNCH = kept


def generator_options(mode: str, inductor: bool) -> dict | None:
    options = dict(GENERATOR_OPTIONS[mode])
    if not inductor:
        options["inductor"] = False
    return options or None


def _logits_file(folder: str, name: str, config, batch: int, mode: str) -> str:
    return os.path.join(folder, f"{name}-{config.num_hidden_layers}-layers-batch-{batch}-{mode}.safetensors")


def save_logits(folder: str, name: str, config, batch: int, mode: str, logits: torch.Tensor, decode: float) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({"logits": logits.float().cpu().contiguous()}, _logits_file(folder, name, config, batch, mode),
              metadata={"decode_s": repr(decode)})


def load_logits(folder: str, name: str, config, batch: int, mode: str) -> tuple[torch.Tensor, float] | None:
    """(first-step logits, decode s per step) that save_logits wrote for this model, batch and mode, or None."""
    from safetensors import safe_open

    path = _logits_file(folder, name, config, batch, mode)
    if not os.path.exists(path):
        return None
    with safe_open(path, "pt") as f:
        return f.get_tensor("logits"), float(f.metadata()["decode_s"])


def fp8_rewrites() -> int:
    """Expert ops the insert_fp8 pass made FP8 in the graphs compiled since the records were cleared."""
    return sum(len(report.get("rewritten", ())) for record in moecompile.backend.records()
               for pass_name, report in record.reports if pass_name == "insert_fp8")


def release(device: str) -> None:
    """Free what a mode compiled and cached before the next one."""
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()


def sdpa_reason(message: str) -> str:
    """SDPA's warning without its source location, empty for the 'not used because:' lead-ins."""
    message = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", message).strip()
    return "" if message.endswith("because:") else message.splitlines()[0]


def attention_probe(name: str, config, batch: int, context: int, new: int, device: str, dtype: torch.dtype,
                    bandwidth: float, iters: int) -> list[str]:
    """Table rows: one layer's decode attention (one query token per sequence) over a static cache of context + new
    positions of which context + 1 are filled, as the compiled step calls SDPA (HF repeats the key/value heads under
    a mask; the gqa_attention pass passes them unrepeated with enable_gqa where SDPA's own checks let a fused kernel
    take it) and with each SDPA backend forced; against the floor of reading the filled cache once."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from moecompile.kernels import triton_decode_attention
    from moecompile.passes.gqa_attention import fused_kernel_takes_gqa
    from moecompile.runtime import choices

    heads, kv, key_dim, value_dim = kv_widths(config)
    length, filled, n = context + new, context + 1, heads // kv
    rng = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(batch, h, s, d, generator=rng, device=device, dtype=dtype)
               for h, s, d in ((heads, 1, key_dim), (kv, length, key_dim), (kv, length, value_dim)))
    mask = (torch.arange(length, device=device) < filled).expand(batch, 1, 1, length).contiguous()
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                            enable_gqa=n > 1)

    def repeat(x):  # HF's repeat_kv, which the graph runs at every step
        return x[:, :, None].expand(batch, kv, n, *x.shape[2:]).reshape(batch, heads, *x.shape[2:])

    filled_only = (lambda: (q, k[:, :, :filled], v[:, :, :filled], None, n > 1))
    if n > 1:
        variants = {"repeat_kv + mask": lambda: (q, repeat(k), repeat(v), mask, False),
                    "enable_gqa + mask": lambda: (q, k, v, mask, True),
                    "enable_gqa, filled cache, no mask": filled_only}
        compiled = "enable_gqa + mask" if fused_kernel_takes_gqa(q, k, v, mask, 0.0, False) else "repeat_kv + mask"
    else:
        variants = {"mask": lambda: (q, k, v, mask, False), "filled cache, no mask": filled_only}
        compiled = "mask"
    itemsize = torch.empty((), dtype=dtype).element_size()
    cache_read = batch * kv * filled * (key_dim + value_dim) * itemsize
    rows = []
    for label, inputs in variants.items():
        def attend():
            query, key, value, attn_mask, gqa = inputs()
            return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                                    enable_gqa=gqa)

        query, key, value, attn_mask, gqa = inputs()
        chosen = SDPBackend(torch._fused_sdp_choice(query, key, value, attn_mask, 0.0, False, enable_gqa=gqa)).name
        cell = f"{label}{' (the compiled step)' if label == compiled else ''}"
        for backend in (None, *PROBE_BACKENDS):
            which = f"default: {chosen}" if backend is None else f"forced {backend}"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel([getattr(SDPBackend, backend)]) if backend else contextlib.nullcontext():
                        attend()  # a warm-up call outside the timing (cuDNN builds its plan on the first)
                        seconds = replayed_seconds(attend, device, iters)
                except RuntimeError as exc:
                    reasons = "; ".join(why for w in caught if (why := sdpa_reason(str(w.message))))
                    reasons = reasons or str(exc).splitlines()[0]
                    rows.append(f"| {name} | {batch} x {filled} | {cell} | {which} | not available: "
                                f"{reasons[:240]} |")
                    continue
            rows.append(f"| {name} | {batch} x {filled} | {cell} | {which} | {seconds * 1e3:.3f} | "
                        f"{seconds * bandwidth / cache_read:.2f} | {cache_read / seconds / 1e9:.0f} |")
    # moecompile's split-KV kernel (option decode_attention) on the same cache and mask, per block of positions: the
    # runtime's runs for it, and one run (the data for choices.DECODE_ATTENTION_*)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 1
    for block in PROBE_BLOCKS:
        for splits in sorted({choices.decode_attention_runs(batch, kv, length, sms, block), 1}, reverse=True):
            def ours():
                return triton_decode_attention.decode_attention(q, k, v, mask[:, 0, 0], key_dim ** -0.5, splits,
                                                                block_l=block)

            err = (ours().float() - want).norm() / want.norm()
            seconds = replayed_seconds(ours, device, iters)
            rows.append(f"| {name} | {batch} x {filled} | the cache with its mask | moecompile split-KV kernel, "
                        f"{block} positions a step, runs: {splits}, err {err:.1e} | {seconds * 1e3:.3f} | "
                        f"{seconds * bandwidth / cache_read:.2f} | {cache_read / seconds / 1e9:.0f} |")
    return rows


def replayed_seconds(fn, device: str, iters: int) -> float:
    """Seconds per call of fn: on CUDA `iters` calls recorded as one CUDA graph and replayed (a decode step's
    kernels run that way, so the host's launch cost stays out), elsewhere called eagerly."""
    if device != "cuda":
        return timed(lambda: [fn() for _ in range(iters)], device, 3) / iters
    from moecompile.runtime import graphs

    graph, _ = graphs.capture(lambda: [fn() for _ in range(iters)])
    graph.replay()
    return timed(graph.replay, device, 3) / iters


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3",
                        help=f"comma-separated, or all: {', '.join(MODELS)}")
    parser.add_argument("--batches", default="1,8,16,64")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated; empty: the probe only")
    parser.add_argument("--context", "--prompt", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="small widths (a smoke run)")
    parser.add_argument("--full", action="store_true", help="every layer of the published models")
    parser.add_argument("--layers", type=int, help="layers of every model (default: each model's in MODELS)")
    parser.add_argument("--fp8", action="store_true",
                        help=f"add {FP8_MODE} after the other modes, on their model converted to FP8 in place")
    parser.add_argument("--fp8-only", action="store_true",
                        help=f"run {FP8_MODE} alone, the model built straight into FP8 (no bf16 model)")
    parser.add_argument("--attention-probe", action="store_true",
                        help="time one layer's decode attention over the cache with each SDPA backend")
    parser.add_argument("--memory-gb", type=float, help="device memory to plan for (default: the device's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--save-logits", metavar="DIR",
                        help="write each moecompile / FP8 row's first-step logits and step time to DIR (safetensors)")
    parser.add_argument("--bf16-logits", metavar="DIR",
                        help="compare the FP8 rows with the bf16 rows that --save-logits wrote to DIR in another call "
                             "(the same model: build() draws each module's values from its name)")
    parser.add_argument("--sample", action="store_true",
                        help="sample (temperature 1, top-k 50, top-p 0.9) in every mode")
    parser.add_argument("--out")
    parser.add_argument("--commit", help="the commit to name in the header (default: git's HEAD)")
    args = parser.parse_args(argv)
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    itemsize = torch.empty((), dtype=dtype).element_size()
    names = list(MODELS) if args.models == "all" else args.models.split(",")
    modes = [m for m in args.modes.split(",") if m]
    if args.fp8_only:
        modes = [FP8_MODE]
    elif args.fp8 or set(FP8_MODES) & set(modes):  # last: converting to FP8 consumes the bf16 model
        modes = [m for m in modes if m not in FP8_MODES] + ["moecompile"] * (args.fp8 and "moecompile" not in modes) \
            + [m for m in FP8_MODES if m in modes or (args.fp8 and m == FP8_MODE)]
    batches = [int(b) for b in args.batches.split(",")]
    sampling = Sampling(top_k=50, top_p=0.9, seed=0) if args.sample else None
    unknown = set(modes) - set(MODES) - set(OTHER_MODES) - set(GENERATOR_OPTIONS)
    if unknown or set(names) - set(MODELS):
        parser.error(f"unknown modes or models {sorted(unknown | (set(names) - set(MODELS)))}")
    inductor = not (args.tiny and device == "cpu")  # the backend's passes without inductor's slow CPU compiles
    bandwidth = copy_bandwidth(device)
    capacity = args.memory_gb * 1e9 if args.memory_gb else (
        torch.cuda.mem_get_info()[1] if device == "cuda" else None)
    if device == "cuda":
        torch.cuda.empty_cache()
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    fp8_note = (f" {FP8_MODE}: transformers' FineGrainedFP8 layout (experts and linears but lm_head and routers, "
                f"128 x 128 block scales) on moecompile's FP8 ops, "
                f"{'built in FP8 module by module' if args.fp8_only else 'converted from the bf16 model'}; every "
                f"other mode bf16." if set(FP8_MODES) & set(modes) else "")
    header = [f"# Whole-model generation ({'tiny widths, ' if args.tiny else ''}{device})", "",
              f"Command: `{shlex.join(['python', 'bench/generate.py', *(argv if argv is not None else sys.argv[1:])])}`"
              f" (commit {commit or '?'})", "",
              f"Machine: {torch.cuda.get_device_name() if device == 'cuda' else platform.processor() or 'cpu'}; torch "
              f"{torch.__version__}, triton {triton_version}, transformers {transformers.__version__}; copy bandwidth "
              f"{bandwidth / 1e12:.2f} TB/s. Context {args.context} tokens, {args.new} new tokens, "
              f"{'sampled (top-k 50, top-p 0.9)' if sampling else 'greedy'}, "
              f"{str(dtype).replace('torch.', '')}, random weights, "
              f"{'every layer' if args.full else 'a slice of layers'}; medians of {args.reps}.{fp8_note} Floor: "
              f"the weights and the key/value cache (mean length over the timed steps) one step reads, at the copy "
              f"bandwidth. Memory planned: "
              f"{'unchecked' if capacity is None else f'{capacity / 1e9:.0f} GB'} (weights, FP8 ones in FP8 only, "
              f"cache and "
              f"{HEADROOM / 1e9:.1f} GB of headroom; more is a row 'does not fit').", "",
              "| model (layers) | batch | mode | prefill ms | decode ms/step | tokens/s | floor weights ms | "
              "floor cache ms | floor ms | x floor | cos | agree | FP8 vs bf16: cos, speed-up |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(header), flush=True)
    rows, profiles, probe = [], [], []

    def save(text: str) -> None:
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
    max_positions = max(4096, args.context + args.new)
    for name in names:
        config = make_config(name, args.tiny, args.layers, args.full, max_positions)
        label = f"{name} ({config.num_hidden_layers})"
        if args.attention_probe:
            probe += attention_probe(name, config, max(batches), args.context, args.new, device, dtype, bandwidth,
                                     iters=20 if device == "cuda" else 2)
            release(device)
        if not modes:
            continue
        shapes = parameter_shapes(name, config)
        fp8 = fp8_parameters(shapes, config)
        read_in_fp8 = {FP8_MODE: fp8, **dict.fromkeys(FP8_PDL_MODES, fp8),
                       FP8_HEAD_MODE: fp8_parameters(shapes, config, head=True)}
        needed = {(mode, batch): resident_bytes(shapes, itemsize, fp8 if mode in FP8_MODES else frozenset())
                  + cache_bytes(config, batch, args.context + args.new, itemsize, windows=False) + HEADROOM
                  for mode in modes for batch in batches}
        fits = {key: capacity is None or size <= capacity for key, size in needed.items()}
        model, references, bf16, model_rows, in_fp8, elsewhere = None, {}, {}, [], False, set()
        for mode in modes:
            if mode in FP8_MODES and any(fits[mode, b] for b in batches):
                if not in_fp8:  # once: the FP8 modes share the FP8 model
                    model = build(name, config, device, dtype, fp8=True) if model is None else to_native_fp8(model)
                    in_fp8 = True
            elif model is None and any(fits[mode, b] for b in batches):
                model = build(name, config, device, dtype)
            for batch in batches:
                ids = torch.randint(0, config.vocab_size, (batch, args.context),
                                    generator=torch.Generator().manual_seed(batch)).to(device)
                reference = references.get(batch)
                if not fits[mode, batch]:
                    row = (f"| {label} | {batch} | {mode} | does not fit: {needed[mode, batch] / 1e9:.0f} GB "
                           f"(card {capacity / 1e9:.0f} GB) |")
                    print(row, flush=True)
                    model_rows.append((batch, row))
                    continue
                weights_floor = weight_bytes(shapes, config, batch, itemsize,
                                             read_in_fp8.get(mode, frozenset())) / bandwidth
                cache_floor = cache_bytes(config, batch, args.context + args.new / 2, itemsize) / bandwidth
                floor, versus = weights_floor + cache_floor, ""
                try:
                    if mode in GENERATOR_OPTIONS:
                        moecompile.backend.clear_records()
                        with pass_thresholds(mode):
                            prefill, decode, tokens, cosine, report, logits = moecompile_mode(
                                model, ids, args.new, device, args.reps, reference,
                                not args.no_profile and batch == 1, generator_options(mode, inductor), sampling)
                        if report:
                            profiles.append(f"{label}, batch {batch}, {mode}:\n{report}")
                        if args.save_logits and mode in ("moecompile", *FP8_MODES):
                            save_logits(args.save_logits, name, config, batch, mode, logits, decode)
                        if mode == "moecompile":
                            bf16[batch] = logits, decode
                        elif mode in FP8_MODES and batch not in bf16 and args.bf16_logits:
                            bf16[batch] = load_logits(args.bf16_logits, name, config, batch, "moecompile")
                            elsewhere.add(batch)
                        if mode in FP8_MODES and bf16.get(batch) is not None:
                            versus = f"{cos(logits, bf16[batch][0]):.5f}, {bf16[batch][1] / decode:.2f}x" + (
                                " (bf16: another call)" if batch in elsewhere else "")
                            if not fp8_rewrites():
                                versus += " (no expert op became FP8)"
                    elif mode == "hf-custom-generate":
                        prefill, decode, tokens = custom_generate_mode(model, ids, args.new, device, args.reps,
                                                                       sampling)
                        cosine = float("nan")
                    else:
                        prefill, decode, tokens, cosine, out = hf_mode(model, mode, ids, args.new, device, args.reps,
                                                                       reference, sampling)
                        if mode == "hf-eager":
                            reference, cosine = out, 1.0
                            references[batch] = out
                    # without hf-eager in the run there is nothing to compare with
                    matched = "—" if reference is None else \
                        f"{agree(tokens[:, args.context:], reference.sequences[:, args.context:])}/{args.new}"
                    row = (f"| {label} | {batch} | {mode} | {prefill * 1e3:.2f} | {decode * 1e3:.3f} | "
                           f"{batch / decode:.0f} | {weights_floor * 1e3:.3f} | {cache_floor * 1e3:.3f} | "
                           f"{floor * 1e3:.3f} | {decode / floor:.2f} | "
                           f"{'—' if math.isnan(cosine) else f'{cosine:.5f}'} | {matched} | {versus} |")
                except Exception as exc:  # a mode that fails is a row of the table, not the end of the run
                    row = f"| {label} | {batch} | {mode} | **{type(exc).__name__}**: {str(exc).splitlines()[0][:150]} |"
                release(device)
                print(row, flush=True)
                model_rows.append((batch, row))
                # a run cut short keeps its rows and profiles
                save(document(header + rows + [r for _, r in model_rows], probe, profiles))
        rows += [row for _, row in sorted(model_rows, key=lambda r: batches.index(r[0]))]  # by batch, then mode
        del model
        release(device)
    text = document(header + rows, probe, profiles)
    print(text[len("\n".join(header + rows)):])
    save(text)
    return 0


def document(lines: list[str], probe: list[str], profiles: list[str]) -> str:
    """The results file: the table's lines, then the attention probe's table and the profiles, where there are."""
    text = "\n".join(lines) + "\n"
    if probe:
        text += ("\n## Decode attention over the cache, one layer (--attention-probe)\n\n"
                 "| model | batch x positions read | inputs | SDPA backend | ms | x cache floor | GB/s |\n"
                 "|---|---|---|---|---|---|---|\n" + "\n".join(probe) + "\n")
    if profiles:
        text += "\n## One decode step, profiled (compiled step run uncaptured)\n\n```\n" + "\n\n".join(profiles) + \
            "\n```\n"
    return text


if __name__ == "__main__":
    sys.exit(main())
