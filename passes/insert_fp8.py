"""insert_fp8 (graph view of moecompile.fp8): each moecompile.experts node becomes quantize_fp8 -> experts_fp8.

    before   y = experts(x, offsets, w_in, b_in, w_out, b_out, act, gated)
    after    x_fp8, x_scale_inv = quantize_fp8(x, 128)
             y = experts_fp8(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                             act, gated, <x's dtype>)

The weights are quantised once, here: the constant behind each weight's get_attr becomes its float8_e4m3fn 128 × 128
blocks under the same name, with a float32 `<name>_scale_inv` beside it (MoEExpertsFP8's names, and those of HF's
FineGrainedFP8 experts); a whole MoEExperts module becomes an MoEExpertsFP8. Weights that enter as graph inputs
(Dynamo hands parameters over so) are quantised once from their real values when the caller passes them
(ctx.example_inputs, as the torch.compile backend does) and kept as constants `<input>_fp8` / `<input>_fp8_scale_inv`
on the GraphModule, like inductor's freezing: later changes to those weights are not seen. Without real values
(or for a view of an input) the graph quantises them itself on every call: w_fp8, w_scale_inv = quantize_blocks(w).
Runs when ctx.options["fp8"] is set.
"""
from __future__ import annotations

import operator

import torch
from torch import fx, nn

from moecompile.passes.nodes import value
from moecompile.block import MoEExperts
from moecompile.fp8 import ACT_GROUP, FP8, MoEExpertsFP8, quantize_blocks, quantize_weight

EXPERTS = torch.ops.moecompile.experts.default
QUANTIZE_FP8 = torch.ops.moecompile.quantize_fp8.default
EXPERTS_FP8 = torch.ops.moecompile.experts_fp8.default


def _owner(gm: fx.GraphModule, target: str) -> tuple[nn.Module, str, str]:
    path, _, attr = target.rpartition(".")
    return (gm.get_submodule(path) if path else gm), path, attr


def _unsupported(gm: fx.GraphModule, weights: list) -> str | None:
    for w in weights:
        if not isinstance(w, fx.Node):
            return "its weights are not graph values"
        if w.op != "get_attr":
            t = value(w)
            if t is None:
                return f"{w.name} is a graph input without an example value"
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
                return f"{w.name} is not a 3-d float tensor"
            continue
        if any(u.target not in (EXPERTS, EXPERTS_FP8) for u in w.users):
            return f"{w.target} is also used outside the experts"
        module, _, attr = _owner(gm, w.target)
        t = getattr(module, attr)
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
            return f"{w.target} is not a 3-d float tensor"
    return None


def _real_input(gm: fx.GraphModule, ctx, w: fx.Node) -> torch.Tensor | None:
    """The real tensor behind placeholder w, if the caller gave the inputs' values."""
    if w.op != "placeholder" or not ctx.example_inputs:
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    t = ctx.example_inputs[placeholders.index(w)]
    fake = isinstance(t, torch._subclasses.fake_tensor.FakeTensor)
    return t if isinstance(t, torch.Tensor) and not fake and t.dim() == 3 else None


def _quantize_input(gm: fx.GraphModule, ctx, w: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(w_fp8, w_scale_inv) nodes for a weight that is a graph input: constants quantised now from its real value,
    else nodes that quantise it on every call."""
    real = _real_input(gm, ctx, w)
    if real is not None:
        q, s = quantize_weight(real.detach())
        nodes = []
        for suffix, t in (("_fp8", q), ("_fp8_scale_inv", s)):
            gm.register_buffer(f"{w.name}{suffix}", t)
            node = gm.graph.get_attr(f"{w.name}{suffix}")
            node.meta.update(val=t, moecompile_constant=True)  # the backend hands these to the compiler as inputs
            nodes.append(node)
        return tuple(nodes)
    quant = gm.graph.call_function(quantize_blocks, (w,))
    parts = tuple(gm.graph.call_function(operator.getitem, (quant, i)) for i in (0, 1))
    val = value(w)
    if isinstance(val, torch._subclasses.fake_tensor.FakeTensor):
        with val.fake_mode:
            out = quantize_blocks(val)
        quant.meta["val"] = out
        for node, v in zip(parts, out):
            node.meta["val"] = v
    return parts


def _quantize_constant(gm: fx.GraphModule, target: str) -> str:
    """Turn the constant at target into FP8 blocks (same name) with scales at `<target>_scale_inv`; returns that."""
    module, path, attr = _owner(gm, target)
    scale = f"{target}_scale_inv"
    if getattr(module, attr).dtype == FP8:  # done already: weights shared by two experts nodes
        return scale
    if isinstance(module, MoEExperts) and path:  # swap the module whole, so that its class fits its tensors
        gm.set_submodule(path, MoEExpertsFP8.quantize(module))
        return scale
    is_param = attr in module._parameters
    q, s = quantize_weight(getattr(module, attr))
    delattr(module, attr)
    for name, t in ((attr, q), (f"{attr}_scale_inv", s)):
        if is_param:
            module.register_parameter(name, nn.Parameter(t, requires_grad=False))
        else:
            module.register_buffer(name, t)
    return scale


def _dtype(gm: fx.GraphModule, w: fx.Node) -> torch.dtype:
    if w.op == "get_attr":
        module, _, attr = _owner(gm, w.target)
        return getattr(module, attr).dtype
    return value(w).dtype


def _set_vals(x: fx.Node, quant: fx.Node, parts: tuple[fx.Node, fx.Node]) -> None:
    """Shape metadata for the new nodes, from the fake tensor of x (when the graph carries them)."""
    val = value(x)
    if not isinstance(val, torch._subclasses.fake_tensor.FakeTensor):
        return
    with val.fake_mode:
        out = QUANTIZE_FP8(val, ACT_GROUP)
    quant.meta["val"] = out
    for node, v in zip(parts, out):
        node.meta["val"] = v


def insert_fp8(gm: fx.GraphModule, ctx) -> dict:
    """Pass: FP8 experts (ctx.options["fp8"]); see the module docstring."""
    if not ctx.options.get("fp8"):
        return {"rewritten": [], "skipped": []}
    rewritten, skipped = [], []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not EXPERTS:
            continue
        x, offsets, w_in, b_in, w_out, b_out, activation, gated = node.args[:8]
        if len(node.args) > 8 and node.args[8]:  # GPT-OSS interleaved gate/up: no FP8 kernel for it
            continue
        why = _unsupported(gm, [w_in, w_out])
        if why:
            skipped.append(f"{node.name}: {why}")
            continue
        val = value(node)
        out_dtype = val.dtype if val is not None else _dtype(gm, w_in)  # experts' output: x's dtype
        with gm.graph.inserting_before(node):
            weights = []
            for w in (w_in, w_out):
                if w.op == "get_attr":
                    weights += [w, gm.graph.get_attr(_quantize_constant(gm, w.target))]
                else:
                    weights += list(_quantize_input(gm, ctx, w))
            (q_in, s_in), (q_out, s_out) = weights[:2], weights[2:]
            quant = gm.graph.call_function(QUANTIZE_FP8, (x, ACT_GROUP))
            x_fp8 = gm.graph.call_function(operator.getitem, (quant, 0))
            x_scale_inv = gm.graph.call_function(operator.getitem, (quant, 1))
            new = gm.graph.call_function(EXPERTS_FP8, (x_fp8, x_scale_inv, offsets, q_in, s_in, b_in, q_out, s_out,
                                                       b_out, activation, gated, out_dtype))
        for n in (quant, x_fp8, x_scale_inv, new):
            if "nn_module_stack" in node.meta:
                n.meta["nn_module_stack"] = node.meta["nn_module_stack"]
        if val is not None:
            new.meta["val"] = val
        _set_vals(x, quant, (x_fp8, x_scale_inv))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        where = "quantised in the graph" if q_in.op == "call_function" else "constants"
        rewritten.append(f"{node.name}: {w_in.name}, {w_out.name} -> float8_e4m3fn, 128x128 block scales ({where})")
    return {"rewritten": rewritten, "skipped": skipped}
