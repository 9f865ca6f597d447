"""keep_first_projection: in a training graph, each experts node becomes experts_train, whose first projection is
kept for the backward instead of recomputed there (N x F more saved activations per MoE layer, a quarter less GEMM
work in its backward: what eager training does, moecompile.ir.ops.expert_ffn_combine), and where the experts'
output only feeds a combine, the pair becomes experts_combine_train, whose backward a device may fuse with the
combine's. Inference graphs are left alone."""
from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from moecompile.ir.ops import glu_args

EXPERTS = torch.ops.moecompile.experts.default
EXPERTS_TRAIN = torch.ops.moecompile.experts_train.default
EXPERTS_COMBINE_TRAIN = torch.ops.moecompile.experts_combine_train.default
COMBINE = torch.ops.moecompile.combine.default


def _combined_args(node: fx.Node) -> tuple[fx.Node, tuple] | None:
    """(the combine, experts_combine_train's arguments) where that combine is the only user of this experts node's
    output and the node's arguments let the two be one op."""
    users = list(node.users)
    if len(users) != 1 or users[0].target is not COMBINE or users[0].args[0] is not node:
        return None
    kw = normalize_function(EXPERTS, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    if glu_args(kw["activation"], kw["interleaved"], kw["alpha"], kw["limit"]):  # normalize_function fills defaults
        return None  # GPT-OSS's activation: the combined op does not take its arguments
    combine = users[0]
    return combine, (kw["x"], kw["offsets"], combine.args[1], combine.args[2], kw["w_in"], kw["b_in"], kw["w_out"],
                     kw["b_out"], kw["activation"], kw["gated"])


def _replace(gm: fx.GraphModule, node: fx.Node, target, args: tuple, kwargs: dict) -> None:
    """node -> target(args, kwargs)[0], node's metadata kept."""
    with gm.graph.inserting_after(node):
        train = gm.graph.call_function(target, args, kwargs)
    with gm.graph.inserting_after(train):
        out = gm.graph.call_function(operator.getitem, (train, 0))
    train.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "example_value")})
    out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def keep_first_projection(gm: fx.GraphModule, ctx) -> dict:
    """Pass: combine(experts(...), order, weights) -> experts_combine_train(...)[0], any other experts(...) ->
    experts_train(...)[0], when ctx.training."""
    if not ctx.training:
        return {"skipped": "inference graph"}
    report = {"experts_train": [], "experts_combine_train": []}
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is EXPERTS]:
        name = node.meta.get("moecompile_block", node.name)
        combined = _combined_args(node)
        if combined is None:
            _replace(gm, node, EXPERTS_TRAIN, node.args, node.kwargs)
            report["experts_train"].append(name)
            continue
        combine, args = combined
        if "moecompile_block" in node.meta:
            combine.meta["moecompile_block"] = node.meta["moecompile_block"]
        _replace(gm, combine, EXPERTS_COMBINE_TRAIN, args, {})
        gm.graph.erase_node(node)
        report["experts_combine_train"].append(name)
    return {k: v for k, v in report.items() if v}
