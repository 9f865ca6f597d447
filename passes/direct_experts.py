"""direct_experts: dispatch -> experts -> combine becomes one moecompile::routed_experts where the batch is a few
tokens (decode), as decode_sized decides from the graph's static token count; a symbolic count (a dynamic-shape
graph) keeps the sorted path, which serves every count.

    before   rows, order, offsets = dispatch(x, ids, E)    y = experts(rows, offsets, ...)    combine(y, order, w)
    after    routed_experts(x, w, ids, ...).sum(1).to(x.dtype)

At a few tokens the sorted form costs three launches around the expert GEMMs (the sort, the row copy, the combine)
and tiles that are mostly empty rows; routed_experts reads each assignment's expert and token directly, multiplies
by the routing weights in its second projection (kernels/triton_direct.py) and returns the k weighted terms of each
token, whose sum is left in the graph (one small inductor reduction where the sorted path has its combine kernel).
Inference graphs only, and only where no later pass needs the dispatched rows (expert parallelism exchanges them)
or the kernels need GPT-OSS's interleaved gate/up. With option fp8, insert_fp8 then makes each routed_experts a
routed_experts_fp8 (FP8 weights dequantised in registers, activations not quantised): what is decode-sized is
decided here, for both precisions. Runs before fuse_route_dispatch, which then leaves these routers as they are:
their top-k is the only routing left.
"""
from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from moecompile.ir.ops import glu_args
from moecompile.passes.nodes import arg, block_meta, call, call_op, moe_op, op_args, value

ROUTED_EXPERTS = torch.ops.moecompile.routed_experts.default
NEEDS_DISPATCHED_ROWS = ("expert_parallel",)  # options whose passes rewrite the dispatched rows
# Direct at any one token, whose experts are distinct (Mixtral's 2 of 8 included: there the sorted path's expert
# kernels are as fast, and its routing, dispatch and combine cost more than a sum; in FP8 it would also quantise the
# row for a GEMM kernel built for batches), and beyond while there are at most this many assignments per expert, so
# that few experts are read twice (bench/results/gpu-direct-experts.md, gpu-generate.md).
MAX_ASSIGNMENTS_PER_EXPERT = 0.125


def decode_sized(tokens: int, top_k: int, num_experts: int) -> bool:
    return tokens == 1 or tokens * top_k <= MAX_ASSIGNMENTS_PER_EXPERT * num_experts


def _static_int(size) -> int | None:
    """The size when it is known when the graph compiles; None for a symbolic one (a dynamic-shape graph's token
    count), which then keeps the sorted batch path: the graph must serve every count its guards admit."""
    return int(size) if is_concrete_int(size) else None


def _match(combine: fx.Node):
    """(dispatch, experts) when combine's rows come from experts over one dispatch's rows, in that dispatch's order,
    and nothing else reads the dispatch."""
    experts = arg(combine, "expert_out")
    if moe_op(experts) != "experts" or len(experts.users) != 1:
        return None
    rows, offsets, order = arg(experts, "x"), arg(experts, "offsets"), arg(combine, "order")
    parts = {}
    for i, node in enumerate((rows, order, offsets)):
        if not (node.op == "call_function" and node.target is operator.getitem and node.args[1] == i):
            return None
        parts[i] = node
    dispatch = rows.args[0]  # (getitem's tuple)
    if moe_op(dispatch) != "dispatch" or any(p.args[0] is not dispatch for p in parts.values()):
        return None
    readers = {u for p in parts.values() for u in p.users}
    if readers != {experts, combine} or len(dispatch.users) != 3:
        return None
    return dispatch, experts


def _decode_sized(dispatch: fx.Node) -> bool:
    hidden, ids = value(arg(dispatch, "hidden")), value(arg(dispatch, "expert_ids"))
    if hidden is None or ids is None:
        return False
    tokens, top_k = _static_int(ids.shape[0]), _static_int(ids.shape[-1])
    return tokens is not None and top_k is not None and decode_sized(tokens, top_k, arg(dispatch, "num_experts"))


def direct_experts(gm: fx.GraphModule, ctx) -> dict:
    """Pass: each decode-sized dispatch -> experts -> combine chain becomes one routed_experts node."""
    needed = [o for o in NEEDS_DISPATCHED_ROWS if ctx.options.get(o)]
    if ctx.training or needed:
        return {"direct": [], "kept": "training graph" if ctx.training else f"option {needed[0]}"}
    graph, direct = gm.graph, []
    for combine in [n for n in graph.nodes if moe_op(n) == "combine"]:
        found = _match(combine)
        if found is None:
            continue
        dispatch, experts = found
        e = op_args(experts)
        if glu_args(e["activation"], e["interleaved"], e["alpha"], e["limit"]) or not _decode_sized(dispatch):
            continue
        meta = block_meta(experts)
        x = arg(dispatch, "hidden")
        with graph.inserting_before(combine):
            node = call_op(graph, ROUTED_EXPERTS, meta, x=x, weights=arg(combine, "weights"),
                           expert_ids=arg(dispatch, "expert_ids"),
                           **{k: e[k] for k in ("w_in", "b_in", "w_out", "b_out", "activation", "gated")})
            total = call(graph, torch.sum, node, 1, meta=meta)
            out = graph.call_method("to", (total, value(x).dtype))
            out.meta.update(meta)
        combine.replace_all_uses_with(out)
        graph.erase_node(combine)
        graph.erase_node(experts)
        for getitem in list(dispatch.users):
            graph.erase_node(getitem)
        graph.erase_node(dispatch)
        direct.append(meta.get("moecompile_block", node.name))
    return {"direct": direct}
