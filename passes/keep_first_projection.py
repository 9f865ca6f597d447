"""keep_first_projection: in a training graph, each experts node becomes experts_train, whose first projection is
kept for the backward instead of recomputed there (N x F more saved activations per MoE layer, a quarter less GEMM
work in its backward: what eager training does, moecompile.ir.ops.expert_ffn). Inference graphs are left alone."""
from __future__ import annotations

import operator

import torch
from torch import fx

EXPERTS = torch.ops.moecompile.experts.default
EXPERTS_TRAIN = torch.ops.moecompile.experts_train.default


def keep_first_projection(gm: fx.GraphModule, ctx) -> dict:
    """Pass: experts(...) -> experts_train(...)[0] when ctx.training."""
    if not ctx.training:
        return {"skipped": "inference graph"}
    rewritten = []
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is EXPERTS]:
        with gm.graph.inserting_after(node):
            train = gm.graph.call_function(EXPERTS_TRAIN, node.args, node.kwargs)
        with gm.graph.inserting_after(train):
            y = gm.graph.call_function(operator.getitem, (train, 0))
        train.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "example_value")})
        y.meta.update(node.meta)
        node.replace_all_uses_with(y)
        gm.graph.erase_node(node)
        rewritten.append(node.meta.get("moecompile_block", node.name))
    return {"experts_train": rewritten}
