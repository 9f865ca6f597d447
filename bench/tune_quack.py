"""Tune the QuACK expert GEMMs offline: for each MoE shape and each of its expert GEMMs, QuACK's own autotuner times
every candidate tile configuration on the layer's real routing; the winner is written to the runtime's table
(kernels/configs/quack_gemm.json, read by runtime/choices.py), with a markdown table of default vs tuned times.

    python bench/tune_quack.py --json kernels/configs/quack_gemm.json --out $OUT/quack-tuning.md   # on the device

GEMMs per shape (d, f, E, k, tokens; SwiGLU, bf16): first = x W_in^T with SwiGLU in the epilogue on dispatched rows
(W_in's gate rows then up rows, as moecompile stores it); first gathered = the same reading token rows through the
dispatch order (no dispatch copy); second = a W_out^T; with --backward the training backward's four (data =
grad_y W_out with SwiGLU's derivative, weight_out / weight_in = the weight gradients over each group's rows, input =
grad_h W_in) and data / weight_out gathered (the combine's gradient read through each row's token, as
quack_gemm.combined_backward runs them). Needs a Hopper GPU and the quack extra.

    python bench/tune_quack.py --backward --shapes qwen3-moe,mixtral --out $OUT/quack-tuning-backward.md
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fine_grained import SHAPES  # noqa: E402  (the bench's shapes, beside this script)

from moecompile.kernels import quack_gemm, triton_routing  # noqa: E402
from moecompile.runtime import choices  # noqa: E402


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def gemms(d, f, e, k, tokens):
    """{name: (json key, autotuned QuACK function, its args, its kwargs, our adapter's call with a config)}."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_in = torch.randn(e, 2 * f, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w_out = torch.randn(e, d, f, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    logits = torch.randn(tokens, e, device="cuda", generator=gen)
    _, ids = triton_routing.topk(logits, k, True)
    rows, order, offsets = triton_routing.dispatch(x, ids, e)
    cu, gather = triton_routing.gather_indices(order, offsets, k)
    a = torch.randn(rows.shape[0], f, device="cuda", dtype=torch.bfloat16, generator=gen)
    from quack import gemm_interface as q

    preact = torch.empty(rows.shape[0], 2 * f, device="cuda", dtype=torch.bfloat16)
    post = torch.empty(rows.shape[0], f, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(rows.shape[0], d, device="cuda", dtype=torch.bfloat16)
    b_in, b_out = w_in.transpose(1, 2), w_out.transpose(1, 2)
    return {
        "first": (choices.quack_key("first", d, 2 * f), q.gemm_gated_tuned,
                  (rows, b_in, preact, post, None, None, "swiglu", cu, None, False), dict(concat_layout=("B",)),
                  lambda c: quack_gemm.first_projection(rows, cu, w_in, None, "silu", True, config=c)),
        "first gathered": (choices.quack_key("first", d, 2 * f, gathered=True), q.gemm_gated_tuned,
                           (x, b_in, None, post, None, None, "swiglu", cu, gather, False),
                           dict(concat_layout=("B",)),
                           lambda c: quack_gemm.first_projection(x, cu, w_in, None, "silu", True, gather_rows=gather,
                                                                 config=c)),
        "second": (choices.quack_key("second", f, d), q.gemm_tuned, (a, b_out, y), dict(cu_seqlens_m=cu),
                   lambda c: quack_gemm.second_projection(a, cu, w_out, None, config=c)),
    }


def backward_gemms(d, f, e, k, tokens):
    """gemms() for the four QuACK GEMMs of the experts' backward (kernels/quack_gemm.backward's calls, SwiGLU),
    and the data / weight_out GEMMs of combined_backward (gathered: the combine's gradient read through each row's
    token), each timed as that call with a configuration."""
    from quack import gemm_interface as q

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_in = torch.randn(e, 2 * f, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w_out = torch.randn(e, d, f, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    _, ids = triton_routing.topk(torch.randn(tokens, e, device="cuda", generator=gen), k, True)
    rows, order, offsets = triton_routing.dispatch(x, ids, e)
    cu, tokens_of_rows = triton_routing.gather_indices(order, offsets, k)
    scores = torch.rand(rows.shape[0], device="cuda", generator=gen)
    _, h = quack_gemm.first_projection_train(rows, cu, w_in, None, "silu", True)
    grad_y = torch.randn(rows.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad_out = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # the combine's gradient
    grad_h, a = torch.empty_like(h), torch.empty(rows.shape[0], f, device="cuda", dtype=torch.bfloat16)
    grad_w_in, grad_w_out, grad_x = torch.empty_like(w_in), torch.empty_like(w_out), torch.empty_like(rows)
    calls = {
        "data": (q.gemm_dgated_tuned, (grad_y, w_out, h, grad_h, a),
                 dict(activation="swiglu", cu_seqlens_m=cu, dynamic_scheduler=False)),
        "data gathered": (q.gemm_dgated_tuned, (grad_out, w_out, h, grad_h, a),
                          dict(colvec_scale=scores, activation="swiglu", colvec_reduce=True, cu_seqlens_m=cu,
                               A_idx=tokens_of_rows, dynamic_scheduler=False)),
        "weight_out": (q.gemm_tuned, (grad_y.t(), a, grad_w_out), dict(cu_seqlens_k=cu)),
        "weight_out gathered": (q.gemm_tuned, (grad_out.t(), a, grad_w_out),
                                dict(cu_seqlens_k=cu, A_idx=tokens_of_rows)),
        "weight_in": (q.gemm_tuned, (rows.t(), grad_h, grad_w_in.transpose(1, 2)),
                      dict(cu_seqlens_k=cu, concat_layout=("out",))),
        "input": (q.gemm_tuned, (grad_h, w_in, grad_x), dict(cu_seqlens_m=cu, concat_layout=("B",))),
    }
    sizes = choices.quack_backward_sizes(d, f, 2 * f)

    def timed(fn, args, kwargs):
        return lambda c: fn.fn(*args, **kwargs, config=quack_gemm.gemm_config(c))
    keys = {name: choices.quack_key(name.split()[0], *sizes[name.split()[0]], gathered=name.endswith("gathered"))
            for name in calls}
    return {f"backward {name}": (keys[name], fn, args, kwargs, timed(fn, args, kwargs))
            for name, (fn, args, kwargs) in calls.items()}


def tune_shape(name, d, f, e, k, tokens, table, lines, backward=False, only=None, save=lambda: None):
    todo = {**gemms(d, f, e, k, tokens), **(backward_gemms(d, f, e, k, tokens) if backward else {})}
    for gemm, (key, tuned_fn, args, kwargs, ours) in todo.items():
        if only and gemm not in only:
            continue
        start = time.time()
        tuned_fn(*args, **kwargs)  # QuACK's autotuner: compiles the candidates in parallel, times each
        best = tuned_fn.best_config.kwargs["config"]
        config = dataclasses.asdict(best)
        default_ms, tuned_ms = bench(lambda: ours(None)), bench(lambda: ours(config))
        if tuned_ms < default_ms:  # the autotuner times each candidate briefly: a pick that re-times slower is dropped
            table[key] = config
        else:
            table.pop(key, None)
        flops = 2 * tokens * k * d * f * (2 if gemm.startswith("first") or gemm.endswith(("weight_in", "input")) else 1)
        line = (f"| {name} | {gemm} | {key} | {default_ms:.3f} | {tuned_ms:.3f} ({flops / tuned_ms / 1e9:.0f} TF/s) | "
                f"{best.tile_m}x{best.tile_n} cluster {best.cluster_m}x{best.cluster_n} "
                f"{'pingpong' if best.pingpong else 'cooperative'}{'' if key in table else ' (dropped: not faster)'} | "
                f"{time.time() - start:.0f} s |")
        lines.append(line)
        print(line, flush=True)
        save()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="kernels/configs/quack_gemm.json", help="the runtime's table, updated in place")
    p.add_argument("--out", default=None, help="markdown table of default vs tuned times")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--backward", action="store_true", help="also the GEMMs of the experts' training backward")
    p.add_argument("--gemms", default=None, help="only these GEMMs (comma-separated names as the table prints them)")
    p.add_argument("--commit", default=None, help="the commit for the header where git is absent or stale")
    a = p.parse_args(argv)
    if not quack_gemm.available(torch.device("cuda")):
        sys.exit("tune_quack: needs a Hopper GPU and the quack extra")
    with open(a.json) as fh:
        data = json.load(fh)
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    lines = [f"# QuACK expert GEMM tuning on {torch.cuda.get_device_name()}", "",
             f"Commit {commit or 'unknown'}; command `python bench/tune_quack.py {' '.join(sys.argv[1:])}`. "
             "Median ms (triton do_bench) of our adapter's call with QuACK's default configuration and with the "
             "configuration QuACK's autotuner picked; time = the tuning's wall time (compiles included).", "",
             "| shape | GEMM | key | default ms | tuned ms | tuned config | time |", "|---|---|---|---|---|---|---|"]
    data["device_name"] = torch.cuda.get_device_name()

    def save():  # after each GEMM: a run cut short keeps what it tuned
        with open(a.json, "w") as fh:
            json.dump(data, fh, indent=2)
            fh.write("\n")
        if a.out:
            with open(a.out, "w") as fh:
                fh.write("\n".join(lines) + "\n")
    only = set(a.gemms.split(",")) if a.gemms else None
    for name in a.shapes.split(","):
        tune_shape(name, *SHAPES[name], data["configs"], lines, a.backward, only, save)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
