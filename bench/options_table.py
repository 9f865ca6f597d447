"""Shared driver of the kernel-option benches (expert_gemms.py, fp8_gemm.py): each shape, one markdown table."""
from __future__ import annotations

import argparse
import platform
import sys
import time
import types

import torch


def ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def routed_layer(d: int, f: int, e: int, k: int, tokens: int) -> types.SimpleNamespace:
    """Random SwiGLU expert weights (bf16, CUDA) and one layer's tokens x routed by a random router and dispatched:
    w_in, w_out, router, x, weights, ids, rows, order, offsets and the generator g."""
    from moecompile.ir import ops

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w_in = torch.randn(e, 2 * f, d, generator=g, device=dev, dtype=torch.bfloat16) * d ** -0.5
    w_out = torch.randn(e, d, f, generator=g, device=dev, dtype=torch.bfloat16) * f ** -0.5
    router = torch.randn(e, d, generator=g, device=dev, dtype=torch.bfloat16) * d ** -0.5
    x = torch.randn(tokens, d, generator=g, device=dev, dtype=torch.bfloat16)
    weights, ids = ops.route(x @ router.t(), k, 0.0, True)
    rows, order, offsets = ops.dispatch(x, ids, e)
    return types.SimpleNamespace(w_in=w_in, w_out=w_out, router=router, x=x, weights=weights, ids=ids, rows=rows,
                                 order=order, offsets=offsets, g=g)


def dispatched_layer(d: int, f: int, e: int, k: int, tokens: int):
    """routed_layer's (w_in, w_out, rows, offsets, g)."""
    r = routed_layer(d, f, e, k, tokens)
    return r.w_in, r.w_out, r.rows, r.offsets, r.g


def main(doc: str, script: str, title: str, header: str, shapes: dict, run, argv=None) -> str:
    """`run(name, *shape, lines)` appends table rows; the table goes to stdout and --out. `doc`: the script's
    docstring (first line: description; from its second paragraph on: the table's legend)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--shapes", default=",".join(shapes), help=f"comma-separated subset of {', '.join(shapes)}")
    a = p.parse_args(argv)
    start = time.time()
    lines = []
    for name in a.shapes.split(","):
        run(name, *shapes[name], lines)
        torch.cuda.empty_cache()
    columns = header.count("|") - 1
    text = "\n".join([
        f"# {title}", "",
        f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}, python {platform.python_version()}.",
        f"Command: `python bench/{' '.join([script] + (sys.argv[1:] if argv is None else list(argv)))}` "
        f"({time.time() - start:.0f} s).", "", doc.split("\n\n", 2)[2].strip(), "",
        header, "|" + "---|" * columns, *lines]) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
    return text
