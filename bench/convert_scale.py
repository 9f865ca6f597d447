"""Streaming native upcycle at scale: peak memory stays flat while the output grows.

For each size, writes a random LLaMA-architecture checkpoint (bf16, sharded safetensors, generated shard by shard
so the model is never held), upcycles it into 8 experts (MixtralForCausalLM) in a subprocess under /usr/bin/time -v,
and tabulates peak RSS, wall time and write throughput. The work folder is removed at the end.

    python bench/convert_scale.py --sizes 0.5B,1B,2B --workdir /tmp/convert-scale --out bench/results/convert-scale.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
# LLaMA-architecture shapes (vocab 32000, untied embeddings, GQA with head_dim 64 or 128)
SIZES = {
    "0.5B": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=4),
    "1B": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4),  # TinyLlama-1.1B
    "2B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=16,
               num_key_value_heads=4),
}
VOCAB = 32000
SOURCE_SHARD = 1 << 30  # bytes of source tensors held before a shard is written


def layer_shapes(c: dict) -> list[tuple[str, tuple]]:
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    return [("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,)),
            ("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, h)),
            ("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)), ("mlp.down_proj.weight", (h, i))]


def write_source(directory: Path, size: str, seed: int = 0) -> int:
    """A random bf16 LLaMA checkpoint, sharded; returns its parameter count. At most SOURCE_SHARD bytes held."""
    c = SIZES[size]
    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    names = [("model.embed_tokens.weight", (VOCAB, c["hidden_size"]))]
    for layer in range(c["num_hidden_layers"]):
        names += [(f"model.layers.{layer}.{n}", s) for n, s in layer_shapes(c)]
    names += [("model.norm.weight", (c["hidden_size"],)), ("lm_head.weight", (VOCAB, c["hidden_size"]))]
    current, held, params, files = {}, 0, 0, []

    def flush():
        name = f"part-{len(files):05d}.safetensors"  # renamed below, once the shard count is known
        save_file(current, directory / name, metadata={"format": "pt"})
        files.append((name, list(current)))
        current.clear()

    for name, shape in names:
        t = torch.randn(shape, generator=g, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
        nbytes = t.numel() * t.element_size()
        if held and held + nbytes > SOURCE_SHARD:
            flush()
            held = 0
        current[name] = t
        held += nbytes
        params += t.numel()
    flush()
    weight_map = {}
    for k, (name, keys) in enumerate(files):
        final = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        os.rename(directory / name, directory / final)
        weight_map.update({key: final for key in keys})
    index = {"metadata": {"total_size": 2 * params}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "tie_word_embeddings": False, "dtype": "bfloat16", "rope_parameters": {"rope_type": "default",
                                                                                    "rope_theta": 10000.0}, **c}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return params


# the conversion alone, in its own process so that /usr/bin/time measures its peak memory
UPCYCLE = """import json, sys
from moecompile.conversion.native import upcycle_native
r = upcycle_native(sys.argv[1], sys.argv[2], int(sys.argv[3]), top_k=2, progress=False)
print(json.dumps({**r.__dict__, "out": str(r.out)}))
"""


def run_upcycle(source: Path, out: Path, experts: int) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-c", UPCYCLE, str(source), str(out), str(experts)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"upcycle failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for name in sorted(set(index.values())):  # every shard a valid safetensors file holding what the index says
        with safe_open(str(out / name), framework="pt") as f:
            assert set(f.keys()) == {k for k, v in index.items() if v == name}, name
    return {**result, "peak_rss_gb": rss_kb * 1024 / 1e9, "wall_s": wall}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
        mem = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal")) / 2**20
    except (OSError, StopIteration):
        mem = float("nan")
    load = os.getloadavg()[0]
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, 1-minute load average {load:.1f} at the start "
            f"(shared machine), Python {platform.python_version()}, torch {torch.__version__}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="0.5B,1B,2B", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--workdir", default="/tmp/moecompile-convert-scale", help="scratch folder (removed at the end)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "convert-scale.md"))
    p.add_argument("--experts", type=int, default=8)
    a = p.parse_args(argv)
    sizes = [s.strip() for s in a.sizes.split(",")]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown sizes {unknown}; choose from {', '.join(SIZES)}")
    work = Path(a.workdir)
    if work.exists():
        p.error(f"{work} exists: give a fresh --workdir")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    header = machine()
    rows = []
    try:
        for size in sizes:
            source, out = work / f"llama-{size}", work / f"llama-{size}-moe{a.experts}"
            t = time.perf_counter()
            params = write_source(source, size)
            print(f"{size}: wrote {params / 1e9:.2f}B random parameters in {time.perf_counter() - t:.0f} s",
                  flush=True)
            r = run_upcycle(source, out, a.experts)
            rows.append((size, r))
            print(f"{size}: {r['output_params'] / 1e9:.2f}B params, {r['output_bytes'] / 1e9:.1f} GB, "
                  f"peak RSS {r['peak_rss_gb']:.2f} GB, {r['wall_s']:.0f} s", flush=True)
            shutil.rmtree(source)
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        "# Streaming native upcycle at scale (LLaMA -> Mixtral, CPU)",
        "",
        f"Random LLaMA-architecture checkpoints (bf16, 1 GB source shards) upcycled into {a.experts} experts, top-2, "
        "by `moecompile.conversion.native.upcycle_native` (default 5GB output shards) in a subprocess under "
        "`/usr/bin/time -v`. Peak RSS is the converting process's maximum resident set; wall time includes "
        "Python start-up and the transformers import.",
        "",
        f"Commit: {commit}. Machine: {header}.",
        "",
        f"Command: `python bench/convert_scale.py --sizes {a.sizes} --workdir {a.workdir}`",
        "",
        "| source | source params | output params | output GB | peak RSS GB | wall s | MB/s written "
        "| in-function s (no start-up) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, r in rows:
        lines.append(f"| LLaMA {size} | {r['source_params'] / 1e9:.2f}B | {r['output_params'] / 1e9:.2f}B | "
                     f"{r['output_bytes'] / 1e9:.1f} | {r['peak_rss_gb']:.2f} | {r['wall_s']:.0f} | "
                     f"{r['output_bytes'] / 1e6 / r['wall_s']:.0f} | {r['seconds']:.0f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
