"""set_capacity: give every router in the graph one capacity factor (option `capacity_factor`).

Hugging Face MoE models route dropless; a capacity bounds each expert's rows (Tutel's convention: > 0 fixed
capacity ceil(cf * tokens * k / E) with the overflow dropped, 0 dropless, < 0 dropless up to that cap).
"""
from __future__ import annotations

from torch import fx

from moecompile.passes.nodes import moe_op

# position of capacity_factor in each routing op's arguments
CAPACITY_ARG = {"route": 2, "route_grouped": 2, "route_dispatch": 4}


def set_capacity(gm: fx.GraphModule, ctx) -> dict:
    """Pass: set capacity_factor on every route / route_grouped / route_dispatch node."""
    factor = float(ctx.options["capacity_factor"])
    changed = []
    for node in gm.graph.nodes:
        index = CAPACITY_ARG.get(moe_op(node))
        if index is not None:
            args = list(node.args)
            args[index] = factor
            node.args = tuple(args)
            changed.append(node.meta.get("moecompile_block", node.name))
    return {"capacity_factor": factor, "routers": changed}
