"""moeize (graph view): replace each matched FFN subgraph by the nodes of an MoEBlock.

The block is built from the FFN's weights exactly as the module view builds it (moecompile.conversion.moeize.build_block),
exported on its own, and its graph inlined in place of the FFN: the rewritten graph holds the moecompile ops
(route, dispatch, experts, combine) as single nodes and the block's parameters as get_attr nodes under
`moe<i>.*`. The dense weights the FFN used become dead and are removed.
"""
from __future__ import annotations

import warnings

import torch
from torch import fx

from moecompile.conversion.moeize import build_block, dense_ffn, parse_layers


def _export_block(block, hidden: fx.Node) -> fx.GraphModule:
    example = torch.zeros(hidden.meta["val"].shape, dtype=hidden.meta["val"].dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(block.eval(), (example,), strict=False).module()


def _inline(gm: fx.GraphModule, sub: fx.GraphModule, prefix: str, inputs: list[fx.Node]) -> fx.Node:
    """Copy sub's graph into gm's before the current insertion point; returns the node of sub's output."""
    env, placeholders = {}, iter(inputs)
    for node in sub.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "get_attr":
            env[node] = gm.graph.get_attr(f"{prefix}.{node.target}")
        elif node.op == "call_module":  # export's input guards (_guards_fn): they check sub's inputs, not ours
            continue
        elif node.op == "output":
            (result,) = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
            return env[result]
        else:
            env[node] = gm.graph.node_copy(node, lambda n: env[n])
    raise AssertionError("graph without output")


def _remove_unused_parameters(gm: fx.GraphModule, names: set[str]) -> None:
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in names - used:
        owner, _, attr = name.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        if hasattr(module, attr):
            delattr(module, attr)


def moeize(gm: fx.GraphModule, ctx) -> dict:
    """Pass: rewrite the FFNs that find_ffn matched (ctx.options: experts, top_k, capacity_factor, method, layers,
    noise, seed) into MoE op nodes."""
    o = ctx.options
    chosen = parse_layers(o.get("layers"), len(ctx.ffns))
    dense_params, rewritten = set(), []
    for n, index in enumerate(chosen):
        match = ctx.ffns[index]
        block = build_block(dense_ffn(gm, match), o.get("experts", 16), o.get("top_k", 2),
                            o.get("capacity_factor", 1.2), o.get("method", "upcycle"), o.get("noise", 0.0),
                            o.get("seed", 0) + n)
        prefix = f"moe{index}"
        gm.add_submodule(prefix, block)
        sub = _export_block(block, match.input)
        down = match.down.node
        with gm.graph.inserting_before(down):
            out = _inline(gm, sub, prefix, [match.input])
            out = gm.graph.call_function(torch.ops.aten.reshape.default, (out, list(down.meta["val"].shape)))
        out.meta["val"] = down.meta["val"]
        down.replace_all_uses_with(out)
        dense_params |= {p for r in match.linears for p in (r.weight, r.bias) if p}
        rewritten.append(f"{prefix}: {match.describe()} -> {block.config.num_experts} experts, top-{block.config.top_k}")
    gm.graph.eliminate_dead_code()
    _remove_unused_parameters(gm, dense_params)
    return {"rewritten": rewritten}
