"""gqa_attention: attention over key/value heads repeated to the query heads (Hugging Face's repeat_kv) becomes
SDPA's own grouped-query attention, where one of its fused CUDA kernels takes it (SDPA's own checks say).

    before   k = k[:, :, None].expand(b, kv, n, L, d).reshape(b, kv * n, L, d)    (v alike)
             scaled_dot_product_attention(q, k, v, attn_mask=m, ...)
    after    scaled_dot_product_attention(q, k, v, attn_mask=m, ..., enable_gqa=True)

HF repeats the heads whenever it passes a mask (a static cache always does): a copy of the whole key/value cache,
n times over, in every layer at every decode step, before attention reads it again. With enable_gqa the kernel
reads each key/value head once for its n query heads. Inference graphs of the backend; the query-head to key/value-head
mapping of repeat_kv (head h reads head h // n) is the one enable_gqa uses.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from moecompile.passes.nodes import arg, kind, set_arg, value

_ALL = slice(None, None, None)
_UNSQUEEZE_2 = (_ALL, _ALL, None, _ALL, _ALL)  # x[:, :, None, :, :]


def repeated_heads(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(the [b, kv, L, d] tensor, n) when node is repeat_kv's reshape(expand(x[:, :, None])) of it, n > 1."""
    if kind(node) != "view" or kind(node.args[0]) != "expand":
        return None
    expand = node.args[0]
    unsqueezed = expand.args[0]
    if not (unsqueezed.op == "call_function" and unsqueezed.target is operator.getitem
            and unsqueezed.args[1] == _UNSQUEEZE_2):
        return None
    base = unsqueezed.args[0]
    shapes = [value(n) for n in (base, node)]
    if any(v is None for v in shapes) or shapes[0].dim() != 4:
        return None
    (b, kv, length, d), repeated = shapes[0].shape, tuple(shapes[1].shape)
    if kv == 0 or repeated[1] % kv or repeated != (b, repeated[1], length, d):
        return None
    n = repeated[1] // kv
    return (base, n) if n > 1 else None


def fused_kernel_takes_gqa(query, key, value_, attn_mask, dropout_p: float, is_causal: bool) -> bool:
    """Whether SDPA runs grouped-query attention on these tensors (example or fake values) in a fused CUDA kernel;
    elsewhere it falls back to its unfused math, which repeating the heads first avoids."""
    if not query.is_cuda:
        return False
    params = torch.backends.cuda.SDPAParams(query, key, value_, attn_mask, dropout_p, is_causal, True)
    return any(can_use(params, False) for can_use in (torch.backends.cuda.can_use_cudnn_attention,
                                                      torch.backends.cuda.can_use_flash_attention,
                                                      torch.backends.cuda.can_use_efficient_attention))


def gqa_attention(gm: fx.GraphModule, ctx) -> dict:
    """Pass: each SDPA over repeat_kv'd keys and values reads the key/value heads themselves (enable_gqa)."""
    if ctx.training:
        return {"skipped": "training graph"}
    graph, rewritten = gm.graph, []
    for node in [n for n in graph.nodes if kind(n) == "sdpa"]:
        if arg(node, "enable_gqa"):
            continue
        k_heads, v_heads = (repeated_heads(arg(node, name)) for name in ("key", "value"))
        if k_heads is None or v_heads is None or k_heads[1] != v_heads[1]:
            continue
        k, v = k_heads[0], v_heads[0]
        query, mask = value(arg(node, "query")), value(arg(node, "attn_mask"))
        if query is None or not fused_kernel_takes_gqa(query, value(k), value(v), mask, arg(node, "dropout_p"),
                                                      arg(node, "is_causal")):
            continue
        repeated = [arg(node, "key"), arg(node, "value")]
        set_arg(node, "key", k)
        set_arg(node, "value", v)
        set_arg(node, "enable_gqa", True)
        for step in repeated:
            erase_unused_chain(graph, step, keep=(k, v))
        rewritten.append(node.name)
    return {"rewritten": rewritten}


def erase_unused_chain(graph: fx.Graph, step: fx.Node, keep: tuple) -> None:
    """Erase step and the ops it reads through its first argument (repeat_kv's reshape, expand and indexing), up to
    a node in keep or one something else still reads."""
    while step.op in ("call_function", "call_method") and not step.users and step not in keep:
        source = step.args[0]
        graph.erase_node(step)
        step = source
