"""insert_all_to_all (graph view of expert parallelism): each moecompile::experts node becomes
    exchange_counts -> all_to_all_single -> wait_tensor -> [dispatch by local expert] -> experts on the local
    weights -> [un-permute] -> all_to_all_single back -> wait_tensor -> pad the dropped rows
with torch's c10d functional collectives as graph nodes, traced from the same function the module view runs
(parallel/all_to_all.py, expert_parallel_experts). The expert weights of a get_attr node are replaced in the module
by this rank's slice (the other ranks' experts leave memory); weights that enter as graph inputs are narrowed by a
node instead. A no-op unless ctx.options["expert_parallel"] is set: {"group": ProcessGroup or None (the world),
"overlap_degree": int (1)}. In the torch.compile backend's pipeline the same data path is one opaque node,
moecompile::expert_parallel_experts (inference only): AOT autograd cannot trace the host sync of its split sizes.
"""
from __future__ import annotations

import torch
from torch import fx, nn

from moecompile.ir.sharding import local_experts
from moecompile.parallel.all_to_all import trace_expert_parallel
from moecompile.parallel.groups import process_group
from moecompile.passes.nodes import inline_graph, op_args, value

EXPERTS = torch.ops.moecompile.experts.default
EP_EXPERTS = torch.ops.moecompile.expert_parallel_experts.default


def _num_experts(gm: fx.GraphModule, node: fx.Node) -> int:
    if node.op == "get_attr":
        return gm.get_parameter(node.target).shape[0]
    return value(node).shape[0]


def _local_weight(gm: fx.GraphModule, node: fx.Node | None, first: int, local: int) -> fx.Node | None:
    if node is None:
        return None
    if node.op == "get_attr":
        owner, _, name = node.target.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        full = getattr(module, name)
        local_weight = full.detach()[first:first + local].clone()
        setattr(module, name, nn.Parameter(local_weight, requires_grad=full.requires_grad))
        return node
    return gm.graph.call_method("narrow", (node, 0, first, local))


def insert_all_to_all(gm: fx.GraphModule, ctx) -> dict:
    """Pass: shard every experts node over the ranks of ctx.options["expert_parallel"]["group"]."""
    options = ctx.options.get("expert_parallel")
    if options is None or options is False:  # {} means on, with the defaults
        return {"rewritten": [], "skipped": []}
    group = process_group(options.get("group"))
    degree = options.get("overlap_degree", 1)
    world = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    rewritten, skipped = [], []
    for n, node in enumerate([n for n in gm.graph.nodes if n.op == "call_function" and n.target is EXPERTS]):
        a = op_args(node)
        rows, offsets, w_in, b_in, w_out, b_out = (a[k] for k in ("x", "offsets", "w_in", "b_in", "w_out", "b_out"))
        activation, gated = a["activation"], a["gated"]
        if a["interleaved"] or activation == "swiglu_oai":  # GPT-OSS's extra arguments
            skipped.append(f"{node.name}: GPT-OSS experts (interleaved / clamped SwiGLU) have no expert-parallel path")
            continue
        experts = _num_experts(gm, w_in)
        local = local_experts(experts, world)
        with gm.graph.inserting_before(node):
            weights = [_local_weight(gm, w, rank * local, local) for w in (w_in, b_in, w_out, b_out)]
            if ctx.pipeline == "compile":
                out = gm.graph.call_function(EP_EXPERTS, (rows, offsets, *weights, activation, gated,
                                                          group.group_name, world, local, degree))
            else:
                sub = trace_expert_parallel(activation, gated, group.group_name, world, local, degree)
                out = inline_graph(gm, sub, f"ep{n}", [rows, offsets, *weights])
        out.meta.update({k: v for k, v in node.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        rewritten.append(f"{node.name}: experts {rank * local}..{rank * local + local - 1} of {experts} on rank "
                         f"{rank}/{world}, overlap degree {degree}")
    return {"rewritten": rewritten, "skipped": skipped}
