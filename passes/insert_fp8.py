"""insert_fp8 (graph view of moecompile.ir.fp8): each moecompile.experts node becomes quantize_fp8 -> experts_fp8.

    before   y = experts(x, offsets, w_in, b_in, w_out, b_out, act, gated)
    after    x_fp8, x_scale_inv = quantize_fp8(x, 128)
             y = experts_fp8(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                             act, gated, <x's dtype>)

When x is the rows of a plain dispatch (x, order, offsets = dispatch(tokens, ids, E)) read by nothing else, the
tokens are quantised before the dispatch instead (FP8 dispatch, the module view's MoEExpertsFP8.routed): T rows
quantised instead of T * k, one byte per value moved, the same numbers (the scales are per row):

    after    t_fp8, t_scale_inv = quantize_fp8(tokens, 128)
             x_fp8, order, offsets = dispatch(t_fp8, ids, E)
             x_scale_inv = index_select(t_scale_inv, 0, order // top_k)
             y = experts_fp8(x_fp8, x_scale_inv, ...)

A fused route_dispatch (the compile pipeline) still dispatches the unquantised rows: its router reads them too.

The weights are quantised once, here: the constant behind each weight's get_attr becomes its float8_e4m3fn 128 × 128
blocks under the same name, with a float32 `<name>_scale_inv` beside it (MoEExpertsFP8's names, and those of HF's
FineGrainedFP8 experts); a whole MoEExperts module becomes an MoEExpertsFP8. Weights that enter as graph inputs
(Dynamo hands parameters over so) are quantised once from their real values when the caller passes them
(ctx.example_inputs, as the torch.compile backend does) and kept as constants `<input>_fp8` / `<input>_fp8_scale_inv`
on the GraphModule, like inductor's freezing: later changes to those weights are not seen. Without real values
(or for a view of an input) the graph quantises them itself on every call: w_fp8, w_scale_inv = quantize_blocks(w).
Runs when ctx.options["fp8"] is set.

A routed_experts node (direct_experts' form of a decode-sized block) becomes routed_experts_fp8 over the same FP8
weights, its activations left as they are (weight-only: at a few tokens the weights are the bytes, and the kernel
dequantises them in registers):

    before   terms = routed_experts(x, w, ids, w_in, b_in, w_out, b_out, act, gated)
    after    terms = routed_experts_fp8(x, w, ids, w_in_fp8, w_in_scale_inv, b_in, w_out_fp8, w_out_scale_inv, b_out,
                                        act, gated)

insert_fp8_linears (option fp8_linears) does the same for the graph's plain linears, routers excepted:

    before   y = linear(x, w, b)
    after    y = linear_fp8(x, w_fp8, w_scale_inv, b)        (w_fp8 [N, K], scale_inv per 128 x 128 block)

Attention projections, dense and shared-expert FFNs and the logits head are the bytes a decode step reads besides
the experts; routers stay as they are (a few kilobytes per layer, and an FP8 error there changes which experts run).
Their weights are quantised once into new constants (the original tensors stay: the embedding may share the head's
weight, and other graphs of the model read them), each real weight once per process however many graphs read it.
"""
from __future__ import annotations

import operator
import weakref

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from moecompile.core.errors import MoECompileError
from moecompile.ir.block import MoEExperts
from moecompile.ir.fp8 import ACT_GROUP, FP8, MoEExpertsFP8, quantize_blocks, quantize_weight
from moecompile.passes.nodes import arg, block_meta, call_op, kind, moe_op, op_args, set_arg, value

EXPERTS = torch.ops.moecompile.experts.default
QUANTIZE_FP8 = torch.ops.moecompile.quantize_fp8.default
EXPERTS_FP8 = torch.ops.moecompile.experts_fp8.default
ROUTED_EXPERTS = torch.ops.moecompile.routed_experts.default
ROUTED_EXPERTS_FP8 = torch.ops.moecompile.routed_experts_fp8.default
LINEAR_FP8 = torch.ops.moecompile.linear_fp8.default
EXPERT_USES = (EXPERTS, EXPERTS_FP8, ROUTED_EXPERTS, ROUTED_EXPERTS_FP8)  # the nodes that may read expert weights
ROUTERS = ("route", "route_grouped")  # the ops a router linear's logits go to
ROUTER_HOPS = 4  # how far (casts, views) a router linear's output may travel before its routing op
ROUTER_MODULES = ("gate", "router")  # HF's names of a router's module (gate_proj, shared_expert_gate are not)
# (memory location, shape, strides, dtype) of a real weight -> (weakref to it, its version, its FP8 form): the prefill
# and decode graphs of one model share one FP8 copy of each weight
_QUANTIZED: dict[tuple, tuple] = {}


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
        if any(u.target not in EXPERT_USES for u in w.users):
            return f"{w.target} is also used outside the experts"
        module, _, attr = _owner(gm, w.target)
        t = getattr(module, attr)
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
            return f"{w.target} is not a 3-d float tensor"
    return None


def _real_input(gm: fx.GraphModule, ctx, w: fx.Node, dims: int = 3) -> torch.Tensor | None:
    """The real tensor behind placeholder w, if the caller gave the inputs' values."""
    if w.op != "placeholder" or not ctx.example_inputs:
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    t = ctx.example_inputs[placeholders.index(w)]
    fake = isinstance(t, torch._subclasses.fake_tensor.FakeTensor)
    return t if isinstance(t, torch.Tensor) and not fake and t.dim() == dims else None


def _quantized(real: torch.Tensor, quantize) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize(real), made once per weight while that weight lives unchanged (_QUANTIZED)."""
    try:
        version = real._version
    except RuntimeError:  # inference tensors keep no version counter (and cannot change outside inference mode)
        version = None
    key = (real.data_ptr(), tuple(real.shape), real.stride(), real.dtype, real.device, quantize)
    hit = _QUANTIZED.get(key)
    if hit is not None and hit[0]() is not None and hit[1] == version:
        return hit[2]
    out = quantize(real.detach())
    _QUANTIZED[key] = (weakref.ref(real, lambda _, key=key: _QUANTIZED.pop(key, None)), version, out)
    return out


def _constants(gm: fx.GraphModule, name: str, tensors) -> tuple[fx.Node, ...]:
    """get_attr nodes of new constants `<name><suffix>`, which the backend hands to the compiler as inputs."""
    nodes = []
    for suffix, t in zip(("_fp8", "_fp8_scale_inv"), tensors, strict=True):
        gm.register_buffer(f"{name}{suffix}", t, persistent=False)
        node = gm.graph.get_attr(f"{name}{suffix}")
        node.meta.update(val=t, moecompile_constant=True)
        nodes.append(node)
    return tuple(nodes)


def _quantize_input(gm: fx.GraphModule, ctx, w: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(w_fp8, w_scale_inv) nodes for a weight that is a graph input: constants quantised now from its real value,
    else nodes that quantise it on every call."""
    real = _real_input(gm, ctx, w)
    if real is not None:
        return _constants(gm, w.name, _quantized(real, quantize_weight))
    quant = gm.graph.call_function(quantize_blocks, (w,))
    parts = tuple(gm.graph.call_function(operator.getitem, (quant, i)) for i in (0, 1))
    _propagate([quant, *parts])
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


def _propagate(nodes: list[fx.Node]) -> None:
    """Shape metadata for new or changed nodes, in order, from their inputs' fake tensors (when the graph carries
    them); Dynamo's "example_value" is replaced too where a node has one, since value() reads it first."""
    for node in nodes:
        inputs = [value(n) for n in node.all_input_nodes]
        fakes = [v for v in pytree.tree_leaves(inputs) if isinstance(v, torch._subclasses.fake_tensor.FakeTensor)]
        if not fakes or any(v is None for v in inputs):
            return  # (the nodes after it read its value)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
        with fakes[0].fake_mode:
            out = node.target(*args, **kwargs)
        node.meta["val"] = out
        if "example_value" in node.meta:
            node.meta["example_value"] = out


def _dispatched(x: fx.Node) -> tuple[fx.Node, int] | None:
    """(dispatch node, top_k) when x is the rows of a plain dispatch that nothing else reads, with top_k known."""
    if not (x.op == "call_function" and x.target is operator.getitem and x.args[1] == 0 and len(x.users) == 1):
        return None
    dispatch = x.args[0]  # (getitem's tuple)
    ids = value(arg(dispatch, "expert_ids")) if moe_op(dispatch) == "dispatch" else None
    return (dispatch, int(ids.shape[-1])) if isinstance(ids, torch.Tensor) else None


def _quantize_activations(gm: fx.GraphModule, x: fx.Node, experts: fx.Node) -> tuple[fx.Node, fx.Node, str]:
    """(x_fp8, x_scale_inv) nodes for the experts node's input rows x, and where they were quantised."""
    graph = gm.graph
    found = _dispatched(x)
    source = arg(found[0], "hidden") if found else x
    with graph.inserting_before(found[0] if found else experts):
        quant = graph.call_function(QUANTIZE_FP8, (source, ACT_GROUP))
        q, scale_inv = (graph.call_function(operator.getitem, (quant, i)) for i in (0, 1))
    if not found:
        _propagate([quant, q, scale_inv])
        return q, scale_inv, "rows quantised after the dispatch"
    dispatch, top_k = found
    set_arg(dispatch, "hidden", q)
    with graph.inserting_before(experts):
        order = graph.call_function(operator.getitem, (dispatch, 1))
        token = graph.call_function(torch.ops.aten.div.Scalar_mode, (order, top_k), {"rounding_mode": "floor"})
        rows_scale_inv = graph.call_function(torch.ops.aten.index_select.default, (scale_inv, 0, token))
    _propagate([quant, q, scale_inv, dispatch, x, order, token, rows_scale_inv])
    return x, rows_scale_inv, "FP8 dispatch"


def _quantized_expert_weights(gm: fx.GraphModule, ctx, node: fx.Node, w_in: fx.Node, w_out: fx.Node) -> list:
    """[w_in_fp8, w_in_scale_inv, w_out_fp8, w_out_scale_inv] nodes, inserted before node."""
    weights = []
    with gm.graph.inserting_before(node):
        for w in (w_in, w_out):
            if w.op == "get_attr":
                weights += [w, gm.graph.get_attr(_quantize_constant(gm, w.target))]
            else:
                weights += list(_quantize_input(gm, ctx, w))
    return weights


def _replace(gm: fx.GraphModule, node: fx.Node, new: fx.Node, before: set) -> None:
    """new takes node's place, and the nodes made for it (those not in `before`) node's module scope."""
    if "nn_module_stack" in node.meta:
        for n in set(gm.graph.nodes) - before:
            n.meta["nn_module_stack"] = node.meta["nn_module_stack"]
    if value(node) is not None:
        new.meta["val"] = value(node)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _experts_in_fp8(ctx, w_in: fx.Node, w_out: fx.Node) -> bool:
    """Whether insert_fp8 runs these experts in FP8: all of them under option fp8, else those stored in FP8."""
    return bool(ctx.options.get("fp8")) or (w_in in ctx.fp8_scales and w_out in ctx.fp8_scales)


def insert_fp8(gm: fx.GraphModule, ctx) -> dict:
    """Pass: FP8 experts (ctx.options["fp8"]); see the module docstring."""
    quantise = bool(ctx.options.get("fp8"))
    stored = ctx.fp8_scales  # expert weights already in FP8 -> their scales (recognise_moe)
    if not quantise and not stored:
        return {"rewritten": [], "skipped": []}
    rewritten, skipped = [], []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (EXPERTS, ROUTED_EXPERTS):
            continue
        a = op_args(node)
        w_in, b_in, w_out, b_out = (a[k] for k in ("w_in", "b_in", "w_out", "b_out"))
        activation, gated = a["activation"], a["gated"]
        as_stored = w_in in stored and w_out in stored
        if a["interleaved"] or not _experts_in_fp8(ctx, w_in, w_out):  # GPT-OSS interleaved gate/up: no FP8 kernel
            continue
        why = None if as_stored else _unsupported(gm, [w_in, w_out])
        if why:
            skipped.append(f"{node.name}: {why}")
            continue
        val = value(node)
        out_dtype = val.dtype if val is not None else _dtype(gm, w_in)  # experts' output: x's dtype
        before = set(gm.graph.nodes)
        if as_stored:
            q_in, s_in, q_out, s_out = w_in, stored[w_in], w_out, stored[w_out]
            where = "the model's own, as stored"
        else:
            q_in, s_in, q_out, s_out = _quantized_expert_weights(gm, ctx, node, w_in, w_out)
            where = "quantised in the graph" if q_in.op == "call_function" else "constants"
        weights = dict(w_in=q_in, w_in_scale_inv=s_in, b_in=b_in, w_out=q_out, w_out_scale_inv=s_out, b_out=b_out,
                       activation=activation, gated=gated)
        if node.target is ROUTED_EXPERTS:
            with gm.graph.inserting_before(node):
                new = call_op(gm.graph, ROUTED_EXPERTS_FP8, block_meta(node), x=a["x"], weights=a["weights"],
                              expert_ids=a["expert_ids"], **weights)
            dispatched = "not quantised (weight-only, direct experts)"
        else:
            x_fp8, x_scale_inv, dispatched = _quantize_activations(gm, a["x"], node)
            with gm.graph.inserting_before(node):
                new = call_op(gm.graph, EXPERTS_FP8, x=x_fp8, x_scale_inv=x_scale_inv, offsets=a["offsets"],
                              **weights, out_dtype=out_dtype)
        _replace(gm, node, new, before)
        rewritten.append(f"{node.name}: {w_in.name}, {w_out.name} -> float8_e4m3fn, 128x128 block scales ({where}); "
                         f"activations: {dispatched}")
    return {"rewritten": rewritten, "skipped": skipped}


def _is_router(node: fx.Node) -> bool:
    """Whether linear node is a router: its output reaches a routing op within ROUTER_HOPS nodes (its logits, maybe
    cast), or it sits in a module named as HF names routers (`mlp.gate`, `mlp.router`, a `...TopKRouter` class),
    for a graph where no routing op follows (an unrecognised block, a graph break)."""
    frontier = [node]
    for _ in range(ROUTER_HOPS):
        frontier = [u for n in frontier for u in n.users]
        if any(moe_op(u) in ROUTERS for u in frontier):
            return True
    scopes = list(node.meta.get("nn_module_stack", {}).values())
    if not scopes:
        return False
    path, cls = scopes[-1]
    name = getattr(cls, "__name__", str(cls))
    return path.rpartition(".")[2] in ROUTER_MODULES or "router" in name.lower()


def _linear_weight(gm: fx.GraphModule, ctx, w) -> torch.Tensor | None:
    """The real 2-d float weight behind w (a graph input with a given value, or a constant), else None."""
    if not isinstance(w, fx.Node):
        return None
    t = _real_input(gm, ctx, w, dims=2) if w.op == "placeholder" else None
    if w.op == "get_attr":
        module, _, attr = _owner(gm, w.target)
        t = getattr(module, attr, None)
    ok = isinstance(t, torch.Tensor) and t.dim() == 2 and t.is_floating_point() and t.dtype != FP8
    return t if ok and t.numel() else None


def insert_fp8_linears(gm: fx.GraphModule, ctx) -> dict:
    """Pass: FP8 linears (ctx.options["fp8_linears"]): each linear with a real weight, routers excepted, becomes
    linear_fp8 over its weight quantised once; see the module docstring."""
    if ctx.training:
        raise MoECompileError("option 'fp8_linears' is inference-only: call the compiled model under "
                              "torch.no_grad()")
    rewritten, skipped = [], []
    for node in [n for n in gm.graph.nodes if kind(n) == "linear"]:
        x, w, b = arg(node, "input"), arg(node, "weight"), arg(node, "bias")
        if _is_router(node):
            skipped.append(f"{node.name}: a router")
            continue
        real = _linear_weight(gm, ctx, w)
        out, x_val = value(node), value(x)
        if real is None or (out is not None and x_val is not None and out.dtype != x_val.dtype):
            skipped.append(f"{node.name}: {'no real 2-d float weight' if real is None else 'a mixed-dtype linear'}")
            continue
        before = set(gm.graph.nodes)
        with gm.graph.inserting_before(node):
            q, s = _constants(gm, f"{w.name}_linear", _quantized(real, quantize_blocks))
            new = call_op(gm.graph, LINEAR_FP8, block_meta(node), x=x, weight=q, weight_scale_inv=s, bias=b)
        _replace(gm, node, new, before)
        if w.op == "get_attr" and not w.users:
            gm.graph.erase_node(w)
        rewritten.append(f"{node.name}: {w.name} {tuple(real.shape)}")
    return {"rewritten": rewritten, "skipped": skipped}
