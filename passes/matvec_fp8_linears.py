"""matvec_fp8_linears: in a batch-1 decode step each FP8 linear becomes graph ops over its FP8 weight that inductor
fuses into reductions reading the weight and its scales once, tuned and fused with their neighbours as the bf16
linears are.

    before   y = linear_fp8(x, w_fp8, w_scale_inv, b)                     (x: one row)
    after    y = matvec_blocks(x, w_fp8, w_scale_inv)                     (float32: per-block sums, then the scales)
             y = (y + b.float()).to(x.dtype)

The scales multiply each row's 128-channel partial sums rather than every weight: inductor's code then streams the
FP8 weight far nearer the copy rate (bench/fp8_linear.py --forms). Float32 math, as linear_fp8's reference kernel,
summed in another order. Where the graph is not a batch-1 decode step (most of its linears read more than one row)
or inductor does not compile it (eagerly the float32 weight would be written whole), linear_fp8 stays on its Triton
kernel.
"""
from __future__ import annotations

import math

import torch
from torch import fx

from moecompile.core.fp8_format import matvec_blocks
from moecompile.passes.nodes import LINEAR_INPUTS, arg, linear_kind, moe_op, value


def _rows(node: fx.Node) -> int | None:
    shape = getattr(value(arg(node, LINEAR_INPUTS[linear_kind(node)])), "shape", None)
    return math.prod(shape[:-1]) if shape is not None and all(isinstance(d, int) for d in shape[:-1]) else None


def one_row_linears(gm: fx.GraphModule) -> int:
    """How many of the graph's linears (FP8 ones included) read a single row, when they are most of its linears (a
    batch-1 decode step, whose other linears may read the cache, as DeepSeek-V3's kv_b_proj does; not a prefill,
    whose one-row linear is the logits head), else 0."""
    rows = [_rows(n) for n in gm.graph.nodes if linear_kind(n)]
    one = rows.count(1)
    return one if 2 * one > len(rows) else 0


def matvec_fp8_linears(gm: fx.GraphModule, ctx) -> dict:
    """Pass: one-row linear_fp8 -> per-block sums of the FP8 weight times the row, then its scales, in a decode step
    inductor compiles (options decode_matvec and inductor)."""
    if not any(moe_op(n) == "linear_fp8" for n in gm.graph.nodes):
        return {"skipped": "no FP8 linear"}
    if ctx.training:
        return {"skipped": "training graph"}
    if not ctx.options.get("inductor", True):
        return {"skipped": "inductor off: the dequantised weight would be written whole"}
    if not one_row_linears(gm):
        return {"skipped": "not a batch-1 decode step"}
    rewritten = []
    for node in [n for n in gm.graph.nodes if moe_op(n) == "linear_fp8" and _rows(n) == 1]:
        x, w, s, b = (arg(node, name) for name in ("x", "weight", "weight_scale_inv", "bias"))
        with gm.graph.inserting_before(node):
            y = gm.graph.call_function(matvec_blocks, (x, w, s))
            if b is not None:
                y = gm.graph.call_function(torch.add, (y, gm.graph.call_method("float", (b,))))
            y = gm.graph.call_method("type_as", (y, x))
        y.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val", "stack_trace")})
        node.replace_all_uses_with(y)
        gm.graph.erase_node(node)
        rewritten.append(f"{node.name}: {w.name}")
    return {"rewritten": rewritten}
