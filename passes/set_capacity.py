"""set_capacity: give every router in the graph one capacity factor (option `capacity_factor`).

Hugging Face MoE models route dropless; a capacity bounds each expert's rows (what the factor means: MoEConfig).
"""
from __future__ import annotations

from torch import fx

from moecompile.passes.nodes import moe_op, set_arg

ROUTERS = ("route", "route_grouped", "route_dispatch")  # the ops that take a capacity_factor


def set_capacity(gm: fx.GraphModule, ctx) -> dict:
    """Pass: set capacity_factor on every route / route_grouped / route_dispatch node."""
    factor = float(ctx.options["capacity_factor"])
    changed = []
    for node in gm.graph.nodes:
        if moe_op(node) in ROUTERS:
            set_arg(node, "capacity_factor", factor)
            changed.append(node.meta.get("moecompile_block", node.name))
    return {"capacity_factor": factor, "routers": changed}
