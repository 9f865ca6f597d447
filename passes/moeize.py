"""moeize (graph view): replace each matched FFN subgraph by the nodes of an MoEBlock.

The block is built from the FFN's weights exactly as the module view builds it (ffn/build.py, build_block),
exported on its own, and its graph inlined in place of the FFN: the rewritten graph holds the moecompile ops
(route, dispatch, experts, combine) as single nodes and the block's parameters as get_attr nodes under
`moe<i>.*`. The dense weights the FFN used become dead and are removed.
"""
from __future__ import annotations

import warnings

import torch
from torch import fx

from moecompile.ffn.build import build_block, check_ffns, check_options
from moecompile.ffn.layers import parse_layers
from moecompile.ffn.match import dense_ffn
from moecompile.ir import knobs
from moecompile.passes.nodes import inline_graph


def _export_block(block, hidden: fx.Node) -> fx.GraphModule:
    example = torch.zeros(hidden.meta["val"].shape, dtype=hidden.meta["val"].dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(block.eval(), (example,), strict=False).module()


def _remove_unused_parameters(gm: fx.GraphModule, names: set[str]) -> None:
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in names - used:
        owner, _, attr = name.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        if hasattr(module, attr):
            delattr(module, attr)


def moeize(gm: fx.GraphModule, ctx) -> dict:
    """Pass: rewrite the FFNs that find_ffn matched (ctx.options: experts, top_k, capacity_factor, method, layers,
    noise, seed; moeize()'s defaults) into MoE op nodes."""
    o = ctx.options
    experts, top_k = o.get("experts", knobs.EXPERTS), o.get("top_k", knobs.TOP_K)
    method = o.get("method", knobs.METHOD)
    check_options(experts, top_k, method)
    chosen = parse_layers(o.get("layers"), len(ctx.ffns))
    ffns = {index: dense_ffn(gm, ctx.ffns[index]) for index in chosen}
    check_ffns(list(ffns.values()), experts, method)
    dense_params, rewritten = set(), []
    for index in chosen:
        match = ctx.ffns[index]
        block = build_block(ffns[index], experts, top_k, o.get("capacity_factor", knobs.CAPACITY_FACTOR), method,
                            o.get("noise", 0.0), o.get("seed", 0), index=index)
        prefix = f"moe{index}"
        gm.add_submodule(prefix, block)
        sub = _export_block(block, match.input)
        down = match.down.node
        with gm.graph.inserting_before(down):
            out = inline_graph(gm, sub, prefix, [match.input])
            out = gm.graph.call_function(torch.ops.aten.reshape.default, (out, list(down.meta["val"].shape)))
        out.meta["val"] = down.meta["val"]
        down.replace_all_uses_with(out)
        dense_params |= {p for r in match.linears for p in (r.weight, r.bias) if p}
        c = block.config
        rewritten.append(f"{prefix}: {match.describe()} -> {c.num_experts} experts, top-{c.top_k}")
    gm.graph.eliminate_dead_code()
    _remove_unused_parameters(gm, dense_params)
    return {"rewritten": rewritten}
