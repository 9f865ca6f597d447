"""Conversion steps at scale: peak memory of the streaming ones stays flat while the output grows.

For each size, writes a random LLaMA-architecture checkpoint (bf16, sharded safetensors, generated shard by shard
so the model is never held), then runs each step in its own subprocess under /usr/bin/time -v and tabulates peak RSS,
wall time and write throughput:
- upcycle: into 8 experts (MixtralForCausalLM), streaming (moecompile.conversion.native.upcycle_native);
- quantize: that Mixtral folder -> FP8 experts, FineGrainedFP8 layout, streaming (moecompile.io.hf_fp8);
- upcycle --fp8: the source straight into the FP8 Mixtral, one streaming pass;
- split (--split-sizes only): `convert --method split --format moecompile`, top-k = experts, streaming one FFN at a
  time (moecompile.conversion.split_stream); then quantize of that moecompile checkpoint, streaming
  (moecompile.io.quantize).
Each output is removed once measured, and the work folder at the end.

    python bench/convert_scale.py --sizes 0.5B,1B,2B --split-sizes 0.5B,1B,2B --workdir /tmp/convert-scale
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


# each step alone, in its own process so that /usr/bin/time measures its peak memory
STEP = """import json, sys, time
import transformers
from moecompile.cli import main
from moecompile.conversion.native import upcycle_native
from moecompile.io import hf_fp8, quantize
step, source, out, experts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
start = time.perf_counter()  # after the imports: the step's own time
if step in ("upcycle", "upcycle --fp8"):
    upcycle_native(source, out, experts, top_k=2, fp8=step.endswith("fp8"), progress=False)
elif step == "quantize":
    hf_fp8.quantize_checkpoint(source, out, progress=False)
elif step == "quantize (moecompile format)":
    quantize.quantize_checkpoint(source, out, progress=False)
elif step == "split":
    assert main(["convert", source, "--method", "split", "--experts", str(experts), "--top-k", str(experts),
                 "--capacity-factor", "0", "--format", "moecompile", "--out", out, "--no-progress"]) == 0
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def run_step(step: str, source: Path, out: Path, experts: int) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-c", STEP, step, str(source), str(out), str(experts)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{step} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    index_path = out / "model.safetensors.index.json"
    files = sorted(out.glob("*.safetensors"))
    if index_path.is_file():  # every shard a valid safetensors file holding what the index says
        index = json.loads(index_path.read_text())["weight_map"]
        assert sorted(set(index.values())) == [f.name for f in files]
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            keys = set(handle.keys())
        if index_path.is_file():
            assert keys == {k for k, v in index.items() if v == f.name}, f
    output = sum(f.stat().st_size for f in files)
    return {**result, "peak_rss_gb": rss_kb * 1024 / 1e9, "wall_s": wall, "output_bytes": output}


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
    p.add_argument("--split-sizes", default="", help="sizes that also run the streaming split (default none)")
    p.add_argument("--workdir", default="/tmp/moecompile-convert-scale", help="scratch folder (removed at the end)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "convert-scale.md"))
    p.add_argument("--experts", type=int, default=8)
    a = p.parse_args(argv)
    sizes = [s.strip() for s in a.sizes.split(",")]
    split_sizes = [s.strip() for s in a.split_sizes.split(",") if s.strip()]
    unknown = [s for s in sizes + split_sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown sizes {unknown}; choose from {', '.join(SIZES)}")
    work = Path(a.workdir)
    if work.exists():
        p.error(f"{work} exists: give a fresh --workdir")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    header = machine()
    rows = []

    def step(size: str, params: int, name: str, source: Path, out: Path) -> None:
        r = run_step(name, source, out, a.experts)
        rows.append((size, params, name, r))
        print(f"{size} {name}: {r['output_bytes'] / 1e9:.1f} GB, peak RSS {r['peak_rss_gb']:.2f} GB, "
              f"{r['wall_s']:.0f} s", flush=True)

    try:
        for size in sorted(set(sizes) | set(split_sizes), key=list(SIZES).index):
            source = work / f"llama-{size}"
            moe, fp8 = work / f"llama-{size}-moe{a.experts}", work / f"llama-{size}-moe{a.experts}-fp8"
            t = time.perf_counter()
            params = write_source(source, size)
            print(f"{size}: wrote {params / 1e9:.2f}B random parameters in {time.perf_counter() - t:.0f} s",
                  flush=True)
            if size in sizes:
                step(size, params, "upcycle", source, moe)
                step(size, params, "quantize", moe, fp8)
                shutil.rmtree(moe)
                shutil.rmtree(fp8)
                step(size, params, "upcycle --fp8", source, fp8)
                shutil.rmtree(fp8)
            if size in split_sizes:
                step(size, params, "split", source, moe)
                step(size, params, "quantize (moecompile format)", moe, fp8)
                shutil.rmtree(moe)
                shutil.rmtree(fp8)
            shutil.rmtree(source)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    split_arg = f" --split-sizes {a.split_sizes}" if split_sizes else ""
    lines = [
        "# Conversion steps at scale (LLaMA -> Mixtral, FP8, split; CPU)",
        "",
        f"Random LLaMA-architecture checkpoints (bf16, 1 GB source shards), {a.experts} experts, each step in a "
        "subprocess under `/usr/bin/time -v` (default 5GB output shards). Peak RSS is that process's maximum "
        "resident set; wall time includes Python start-up and the transformers import.",
        "",
        "- upcycle: streaming native upcycle into MixtralForCausalLM, top-2 (`upcycle_native`);",
        "- quantize: that Mixtral folder to FP8 experts in transformers' FineGrainedFP8 layout, streaming "
        "(`moecompile quantize --fp8`, `moecompile.io.hf_fp8`);",
        "- upcycle --fp8: the source straight into the FP8 Mixtral, one streaming pass (`convert --fp8`);",
        f"- split: `convert --method split --top-k {a.experts} --format moecompile`, streaming: each FFN read, "
        "partitioned by the balanced k-means and written as its MoE block, the model never built "
        "(`moecompile.conversion.split_stream`); quantize (moecompile format): its output to FP8 experts, streaming "
        "(`moecompile.io.quantize`).",
        "",
        f"Commit: {commit}. Machine: {header}.",
        "",
        f"Command: `python bench/convert_scale.py --sizes {a.sizes}{split_arg} --workdir {a.workdir}`",
        "",
        "| source | source params | step | output GB | peak RSS GB | wall s | MB/s written "
        "| in-function s (no start-up) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, params, name, r in rows:
        lines.append(f"| LLaMA {size} | {params / 1e9:.2f}B | {name} | {r['output_bytes'] / 1e9:.1f} | "
                     f"{r['peak_rss_gb']:.2f} | {r['wall_s']:.0f} | {r['output_bytes'] / 1e6 / r['wall_s']:.0f} | "
                     f"{r['seconds']:.0f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
