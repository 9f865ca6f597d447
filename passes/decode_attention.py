"""decode_attention: attention of one query token per sequence (a decode step) becomes moecompile::decode_attention,
which reads each key/value head once for its query heads and splits the cache positions into runs that fill the GPU
(kernels/triton_decode_attention.py), in place of SDPA's kernel for a 1-row query.

    before   scaled_dot_product_attention(q, k, v, attn_mask=m, scale=s, enable_gqa=...)   (q [B, H, 1, D])
             (or over k, v repeated to the query heads by HF's repeat_kv)
    after    decode_attention(q, k, v, m, s)                                                (k, v unrepeated)

Only where the op computes the same thing: one query token, no dropout, not causal, a boolean mask [B or 1, 1, 1, L]
or none, the query heads a multiple of the key/value heads. Inference graphs; off by default (option
decode_attention): on an H100 the kernel beat SDPA's alone but not in whole decode steps
(bench/results/gpu-generate.md).
"""
from __future__ import annotations

import torch
from torch import fx

from moecompile.ir import ops  # noqa: F401 - registers the op
from moecompile.passes.gqa_attention import erase_unused_chain, repeated_heads
from moecompile.passes.nodes import arg, kind, value

DECODE_ATTENTION = torch.ops.moecompile.decode_attention.default


def _heads(node: fx.Node, name: str, query_heads: int) -> fx.Node | None:
    """SDPA's key or value node as its key/value heads: unrepeated when HF repeated them, None when its head count
    does not divide the query's."""
    tensor = arg(node, name)
    repeated = repeated_heads(tensor)
    if repeated is not None:
        return repeated[0]
    heads = getattr(value(tensor), "shape", (None, None))[1]
    return tensor if isinstance(heads, int) and heads and query_heads % heads == 0 else None


def _static(*tensors) -> bool:
    """Every dimension a plain int: the pass compares shapes, which on symbolic ones would add guards after tracing."""
    return all(isinstance(t, torch.Tensor) and all(isinstance(d, int) for d in t.shape) for t in tensors)


def _mask_fits(mask, batch: int, length: int) -> bool:
    if mask is None:
        return True
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and _static(mask)
            and tuple(mask.shape[1:]) == (1, 1, length) and mask.shape[0] in (1, batch))


def decode_attention(gm: fx.GraphModule, ctx) -> dict:
    """Pass: SDPA of a one-token query -> moecompile::decode_attention (option decode_attention)."""
    if ctx.training:
        return {"skipped": "training graph"}
    graph, rewritten = gm.graph, []
    for node in [n for n in graph.nodes if kind(n) == "sdpa"]:
        query = value(arg(node, "query"))
        if query is None or query.dim() != 4 or not _static(query) or query.shape[2] != 1:
            continue  # (a symbolic query length may be more than one token: SDPA keeps it)
        if arg(node, "dropout_p") != 0.0 or arg(node, "is_causal"):
            continue
        key, val = (_heads(node, name, query.shape[1]) for name in ("key", "value"))
        if key is None or val is None or not _static(value(key), value(val)) or \
                value(key).shape[1] != value(val).shape[1]:
            continue
        batch, length = query.shape[0], value(key).shape[2]
        mask = arg(node, "attn_mask")
        if not _mask_fits(value(mask), batch, length):
            continue
        scale = arg(node, "scale")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        if not isinstance(scale, (int, float)):  # a scale computed in the graph: the op takes a constant
            continue
        repeated = [arg(node, "key"), arg(node, "value")]
        with graph.inserting_before(node):
            attended = graph.call_function(DECODE_ATTENTION, (arg(node, "query"), key, val, mask, float(scale)))
        attended.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val", "stack_trace")})
        node.replace_all_uses_with(attended)
        graph.erase_node(node)
        for step in repeated:
            erase_unused_chain(graph, step, keep=(key, val))
        rewritten.append(attended.name)
    return {"rewritten": rewritten}
