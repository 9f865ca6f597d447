"""fuse_projections: linear layers that read the same tensor become one GEMM over their concatenated weights.

    before   q = linear(x, w_q)      k = linear(x, w_k)      v = linear(x, w_v)
    after    qkv = linear(x, w_qkv)          (w_qkv: one buffer holding w_q, w_k, w_v row after row)
             q, k, v = split(qkv, [n_q, n_k, n_v], -1)   (each made contiguous)

At one decoded token each projection is a launch-bound GEMM of one row, so q/k/v (or a dense FFN's gate/up, a
shared expert's projections and its gate) cost one launch instead of three. Inductor's own batch-linear fusion
concatenates the weights on every call when they are graph inputs (Dynamo lifts parameters so), reading them twice.
Here they are concatenated once, from the real parameters (ctx.example_inputs). ctx.input_aliases says which inputs
must be views of which rows of the fused buffer: the backend rebinds each parameter so once the graph is compiled
(compiling checks the inputs against what Dynamo saw), and again when one was since replaced by another tensor.
In-place updates (load_state_dict, optimiser steps) then reach the fused weights, and a later graph of the same
model (prefill and decode step) finds them fused and shares the buffer. Inference graphs only (a training graph
keeps its parameters' gradients apart). An FP8 checkpoint's linears (moecompile::linear_fp8, weight [N, K] with a
scale per 128 x 128 block) fuse the same way, weights and scales each stacked, where every N is whole blocks.
"""
from __future__ import annotations

import operator
import re
from collections import defaultdict

import torch
from torch import fx

from moecompile.core.fp8_format import WEIGHT_BLOCK
from moecompile.passes.nodes import LINEAR_INPUTS, arg, linear_kind


def _real(node, inputs: dict) -> torch.Tensor | None:
    """The real tensor behind a placeholder read only by the node that reads it here, else None."""
    t = inputs.get(node) if isinstance(node, fx.Node) else None
    plain = type(t) in (torch.Tensor, torch.nn.Parameter)  # not a subclass (DTensor, FP8 weights)
    return t if plain and len(node.users) == 1 and t.is_contiguous() else None


# the linears this pass fuses: linear kind -> (the op a fused node calls, the arguments whose rows are stacked:
# weight first; a bias, where given, last)
LINEAR_FP8 = torch.ops.moecompile.linear_fp8.default
_LINEARS = {"linear": (torch.nn.functional.linear, ("weight", "bias")),
            "linear_fp8": (LINEAR_FP8, ("weight", "weight_scale_inv", "bias"))}


def _fusable(node: fx.Node, inputs: dict) -> tuple | None:
    """(x, [(placeholder, real tensor) of each stacked argument], with a bias) of a linear this pass can fuse."""
    kind_name = linear_kind(node)
    if kind_name is None:
        return None
    stacked = _LINEARS[kind_name][1]
    x, b_node = arg(node, LINEAR_INPUTS[kind_name]), arg(node, "bias")
    names = stacked if b_node is not None else stacked[:-1]
    parts = [(arg(node, name), _real(arg(node, name), inputs)) for name in names]
    w = parts[0][1]
    # an empty weight (Qwen2-MoE's unused shared expert) saves nothing, and its storage may sit at a neighbour's address
    if not isinstance(x, fx.Node) or w is None or w.dim() != 2 or w.numel() == 0:
        return None
    if any(t is None for _, t in parts) or (b_node is not None and parts[-1][1].dim() != 1):
        return None
    # FP8 weights: whole 128-row scale blocks, so that the stacked scales still describe the stacked weight
    if kind_name == "linear_fp8" and w.shape[0] % WEIGHT_BLOCK:
        return None
    return x, parts, b_node is not None


def _fused(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """(one buffer holding tensors back to back, its parts): a new buffer when each tensor owns its storage, the
    existing one when an earlier graph fused them in this order, else None."""
    first = tensors[0]
    rows = sum(t.shape[0] for t in tensors)
    shape = (rows, *first.shape[1:])
    storage, offset = first.untyped_storage(), first.storage_offset()
    adjacent = all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in tensors)
    start = offset
    for t in tensors:
        adjacent &= t.storage_offset() == start
        start += t.numel()
    if adjacent:  # fused by an earlier graph of the same model: share its buffer
        return first.detach().as_strided(shape, first.stride()), [t.detach() for t in tensors]
    if any(t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size() for t in tensors):
        return None  # part of some other buffer (tied, sharded, fused differently): leave it alone
    with torch.no_grad():
        fused = torch.cat([t.detach() for t in tensors])
    return fused, list(fused.split([t.shape[0] for t in tensors]))


def _module(placeholder: str) -> str:
    """model.layers.0.self_attn.q_proj for Dynamo's l_self_modules_model_modules_layers_modules_0_..._weight_"""
    return re.sub(r"^l_self_modules_|_parameters_weight_$", "", placeholder).replace("_modules_", ".")


def _constant(gm: fx.GraphModule, name: str, tensor: torch.Tensor, before: fx.Node) -> fx.Node:
    gm.register_buffer(name, tensor, persistent=False)
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    node.meta.update(val=tensor, moecompile_constant=True)  # the backend hands it to the compiler as an input
    return node


def fuse_projections(gm: fx.GraphModule, ctx) -> dict:
    """Pass: linears (or FP8 linears) of one input with real weights alike but for their rows (all with biases or
    none) -> one linear + split."""
    if ctx.training:
        return {"skipped": "training graph"}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    real = [t if isinstance(t, torch.Tensor) and not isinstance(t, torch._subclasses.FakeTensor) else None
            for t in ctx.example_inputs or []]
    inputs = {n: t for n, t in zip(placeholders, real) if t is not None}
    index = {n: i for i, n in enumerate(placeholders)}
    groups = defaultdict(list)
    for node in gm.graph.nodes:
        found = _fusable(node, inputs)
        if found:
            x, parts, with_bias = found
            layout = tuple((t.dtype, t.device, t.shape[1:]) for _, t in parts)  # all but the stacked rows alike
            groups[(linear_kind(node), x, layout, with_bias)].append((node, parts))
    fused = []
    for (kind_name, x, _, with_bias), members in groups.items():
        if len(members) < 2:
            continue
        buffers = []  # per stacked argument: (the fused buffer, each member's part of it)
        for position in range(len(members[0][1])):
            buffers.append(_fused([parts[position][1] for _, parts in members]))
            if buffers[-1] is None:
                break
        if buffers[-1] is None:
            continue
        first = members[0][0]
        call, stacked = _LINEARS[kind_name]
        name = f"fused_projection_{len(fused)}"
        nodes = [_constant(gm, name if position == 0 else f"{name}_{stacked[position]}", buffer, first)
                 for position, (buffer, _) in enumerate(buffers)]
        with gm.graph.inserting_before(first):
            y = gm.graph.call_function(call, (x, *nodes, *([] if with_bias else [None])))
            rows = [parts[0][1].shape[0] for _, parts in members]
            split = gm.graph.call_function(torch.split, (y, rows, -1))
            outputs = [gm.graph.call_method("contiguous", (gm.graph.call_function(operator.getitem, (split, i)),))
                       for i in range(len(members))]
        for i, ((node, parts), part) in enumerate(zip(members, outputs)):
            part.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val", "stack_trace")})
            node.replace_all_uses_with(part)
            gm.graph.erase_node(node)
            for (placeholder, _), (_, pieces) in zip(parts, buffers):
                ctx.input_aliases.append((index[placeholder], pieces[i]))
        fused.append(f"{', '.join(_module(parts[0][0].name) for _, parts in members)} -> "
                     f"{tuple(buffers[0][0].shape)}")
    return {"fused": fused}
