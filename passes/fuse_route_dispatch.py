"""fuse_route_dispatch: router linear -> route (or route_grouped) -> dispatch becomes one moecompile::route_dispatch.

Matched on the dispatch node: its expert ids come from a route whose logits are a linear of the same token rows
(up to dtype casts: a cast to float32 means the logits are computed in float32). A fused kernel then never
writes the [tokens, experts] logits or probabilities to memory. A logits node still used elsewhere (an aux loss,
output_router_logits) is kept for those users.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from moecompile.passes.nodes import (
    arg,
    block_meta,
    call_op,
    cast_dtype,
    defaults,
    getitems,
    kind,
    moe_op,
    op_args,
    outputs,
    same_tensor,
    strip_casts,
)

ROUTE_GROUPED = torch.ops.moecompile.route_grouped.default
ROUTE_DISPATCH = torch.ops.moecompile.route_dispatch.default


def _routing_args(route: fx.Node) -> dict:
    """route's or route_grouped's arguments after the logits; a plain route's rest are route_grouped's defaults."""
    return {**defaults(ROUTE_GROUPED), **{k: v for k, v in op_args(route).items() if k != "router_logits"}}


def _match(dispatch: fx.Node):
    """(route, linear, weight, bias, logits_fp32) if dispatch's ids come from a route over a linear of its rows."""
    hidden, ids = arg(dispatch, "hidden"), arg(dispatch, "expert_ids")
    if not (ids.op == "call_function" and ids.target is operator.getitem and ids.args[1] == 1):
        return None
    route = ids.args[0]  # (getitem's tuple)
    if moe_op(route) not in ("route", "route_grouped"):
        return None
    linear = arg(route, "router_logits")
    if kind(linear) != "linear":
        return None
    x, x_fp32 = strip_casts(arg(linear, "input"))
    weight, w_fp32 = strip_casts(arg(linear, "weight"))
    bias = arg(linear, "bias")
    if bias is not None:
        bias, _ = strip_casts(bias)
    base = hidden
    while cast_dtype(base) == torch.float32:  # x.float() on float32 rows is the rows (export keeps the cast)
        base = base.args[0]  # (the tensor a cast converts)
    if not (same_tensor(x, hidden) or same_tensor(x, base)):
        return None
    return route, linear, weight, bias, x_fp32 or w_fp32


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase the linear and the casts feeding it once nothing uses them."""
    while nodes:
        node = nodes.pop()
        if node.users or kind(node) not in ("linear", "cast"):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        nodes.extend(inputs)


def _place_users_after(start: fx.Node, fused: fx.Node, outs: list[fx.Node]) -> None:
    """Move the nodes after start that read outs (the fused op's outputs) before they are defined (a split block's
    unit gate weights read the expert ids before its dispatch), and the nodes reading those, to just after outs, in
    their order: the graph stays topologically sorted."""
    early, node = set(outs), start.next
    moved = []
    while node is not fused:
        if any(a in early for a in node.all_input_nodes):
            early.add(node)
            moved.append(node)
        node = node.next
    last = outs[-1]
    for node in moved:
        last.append(node)
        last = node


def fuse_route_dispatch(gm: fx.GraphModule, ctx) -> dict:
    """Pass: fuse every router linear + route + dispatch chain into one route_dispatch node."""
    graph, fused = gm.graph, []
    for dispatch in [n for n in graph.nodes if moe_op(n) == "dispatch"]:
        found = _match(dispatch)
        if found is None:
            continue
        route, linear, weight, bias, logits_fp32 = found
        r = _routing_args(route)
        meta = block_meta(dispatch)
        route_at = route.prev  # where the routing was: its users between there and dispatch must now follow the op
        with graph.inserting_before(dispatch):
            node = call_op(graph, ROUTE_DISPATCH, meta, hidden=arg(dispatch, "hidden"), router_weight=weight,
                           router_bias=bias, **r, logits_fp32=logits_fp32)
            new = outputs(graph, node, 5, meta=meta)
        for i, old in getitems(route).items():
            old.replace_all_uses_with(new[i])
        for i, old in getitems(dispatch).items():
            old.replace_all_uses_with(new[2 + i])
        for old in list(getitems(dispatch).values()) + [dispatch] + list(getitems(route).values()) + [route]:
            graph.erase_node(old)
        for getitem in new:
            if not getitem.users:
                graph.erase_node(getitem)
        _place_users_after(route_at, node, [g for g in new if g.users])
        _erase_unused(graph, [linear])  # the logits and their casts, unless used elsewhere
        fused.append(meta.get("moecompile_block", node.name))
    return {"fused": fused}
