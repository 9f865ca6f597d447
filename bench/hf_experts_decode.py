"""HF generate's decode step, eager, with HF's default experts (grouped_mm, which generate switches to batched_mm for
decoding on GPUs) against `set_experts_implementation("moecompile")`: ms per step, which experts function each layer
call reached, and a CPU + CUDA profile of a few steps of each. What bench/generate.py's hf-experts-mc row needs
explained when it is slower than hf-eager.

    python bench/hf_experts_decode.py --model qwen3-30b-a3b --batch 1 > $OUT/hf-experts-decode.txt
"""
from __future__ import annotations

import argparse
import collections
import time

import torch
from generate import build  # bench/generate.py: the same random models at real per-layer sizes
from torch.profiler import ProfilerActivity, profile
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import moecompile  # noqa: F401  (registers the "moecompile" experts implementation)

IMPLEMENTATIONS = ("grouped_mm", "moecompile")


def count_calls(counts: collections.Counter) -> None:
    """Wrap every registered experts function so that counts[name] says how often it ran."""
    for name in ("batched_mm", "grouped_mm", "moecompile"):
        function = ALL_EXPERTS_FUNCTIONS[name]

        def counted(*args, _function=function, _name=name, **kwargs):
            counts[_name] += 1
            return _function(*args, **kwargs)

        ALL_EXPERTS_FUNCTIONS.register(name, counted)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=17)
    parser.add_argument("--tiny", action="store_true", help="small widths (a smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    model = build(args.model, args.tiny, args.device, torch.bfloat16 if cuda else torch.float32)
    ids = torch.randint(0, 1000, (args.batch, 128), device=args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    counts = collections.Counter()
    count_calls(counts)
    for implementation in IMPLEMENTATIONS * 2:  # twice each, interleaved: the second pair is the one to read
        model.set_experts_implementation(implementation)
        model.generate(ids, max_new_tokens=4, **kwargs)
        sync()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        sync()
        prefill = time.perf_counter() - start
        counts.clear()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=args.new, **kwargs)
        sync()
        decode = (time.perf_counter() - start - prefill) / (args.new - 1)
        print(f"{implementation}: decode {decode * 1e3:.3f} ms/step, prefill {prefill * 1e3:.2f} ms, experts calls "
              f"{dict(counts)}", flush=True)
    for implementation in IMPLEMENTATIONS:
        model.set_experts_implementation(implementation)
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            model.generate(ids, max_new_tokens=9, **kwargs)
            sync()
        for sort in ("self_cpu_time_total", "self_cuda_time_total")[:1 + cuda]:
            print(f"--- {implementation}: generate(9 new tokens), by {sort}")
            print(prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
