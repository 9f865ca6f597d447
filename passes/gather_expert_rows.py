"""gather_expert_rows: in an inference graph, experts over route_dispatch's rows become experts_gathered over the
tokens route_dispatch read, and route_dispatch stops copying them. Where the runtime's first projection gathers its
rows itself (QuACK's), the permuted [T * k, H] copy of the activations is never written.

    before   weights, ids, rows, order, offsets = route_dispatch(hidden, ...)
             y = experts(rows, offsets, w_in, b_in, w_out, b_out, activation, gated)
    after    weights, ids, _, order, offsets = route_dispatch(hidden, ..., copy_rows=False)
             y = experts_gathered(hidden, order, offsets, top_k, w_in, b_in, w_out, b_out, activation, gated)

Left alone: training graphs (the dispatch's backward reads the rows; experts_gathered has no backward), blocks of
fewer assignments than a batch (ops.gathers_rows: there the copy is part of the one-launch routing kernels), rows
that anything else reads, and GPT-OSS's activation arguments (interleaved gate / up, swiglu_oai), which
experts_gathered does not take.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from moecompile.ir.ops import gathers_rows, glu_args
from moecompile.passes.nodes import arg, block_meta, call_op, getitems, kind, moe_op, op_args, set_arg, value

EXPERTS_GATHERED = torch.ops.moecompile.experts_gathered.default
ROWS, ORDER, OFFSETS = 2, 3, 4  # route_dispatch's outputs


def _rows_source(experts: fx.Node) -> fx.Node | None:
    """The route_dispatch whose rows (read by nothing else) and offsets this experts node reads."""
    rows = arg(experts, "x")
    if not (kind(rows) == "getitem" and rows.args[1] == ROWS and len(rows.users) == 1):
        return None
    route_dispatch, offsets = rows.args[0], arg(experts, "offsets")  # (getitem's tuple)
    if moe_op(route_dispatch) != "route_dispatch" or getitems(route_dispatch).get(OFFSETS) is not offsets:
        return None
    return route_dispatch


def _order(graph: fx.Graph, route_dispatch: fx.Node) -> fx.Node:
    order = getitems(route_dispatch).get(ORDER)
    if order is None:
        with graph.inserting_after(route_dispatch):
            order = graph.call_function(operator.getitem, (route_dispatch, ORDER))
    return order


def gather_expert_rows(gm: fx.GraphModule, ctx) -> dict:
    """Pass: experts(route_dispatch(...).rows, ...) -> experts_gathered(hidden, order, ...), route_dispatch
    without its row copy, in inference graphs (option gather_rows)."""
    if ctx.training:
        return {"skipped": "training graph"}
    gathered = []
    for node in [n for n in gm.graph.nodes if moe_op(n) == "experts"]:
        kw = op_args(node)
        route_dispatch = _rows_source(node)
        if route_dispatch is None or glu_args(kw["activation"], kw["interleaved"], kw["alpha"], kw["limit"]):
            continue
        rows, offsets = value(kw["x"]), value(kw["offsets"])  # [T * k, H], [E]
        if rows is not None and offsets is not None and not gathers_rows(rows.shape[0], offsets.shape[0]):
            continue
        order = _order(gm.graph, route_dispatch)
        with gm.graph.inserting_before(node):
            new = call_op(gm.graph, EXPERTS_GATHERED, meta=block_meta(node), hidden=arg(route_dispatch, "hidden"),
                          order=order, offsets=kw["offsets"], top_k=arg(route_dispatch, "top_k"), w_in=kw["w_in"],
                          b_in=kw["b_in"], w_out=kw["w_out"], b_out=kw["b_out"], activation=kw["activation"],
                          gated=kw["gated"])
        new.meta.update({k: v for k, v in node.meta.items() if k in ("val", "example_value")})
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        gm.graph.erase_node(kw["x"])  # the rows' getitem: its one reader is gone
        set_arg(route_dispatch, "copy_rows", False)
        gathered.append(node.meta.get("moecompile_block", node.name))
    return {"gathered": gathered}
