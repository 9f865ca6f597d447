"""recognise_moe: Hugging Face MoE blocks in a Dynamo graph -> moecompile route / dispatch / experts / combine.

In a Dynamo graph every node carries nn_module_stack, so the nodes of a known block class (MixtralSparseMoeBlock,
...) are found by scope, and inside it those of its router (a `*Router` child) and its experts (an `*Experts`
child, HF's fused 3D weights). The routing semantics are read off the router's nodes (the constants Dynamo
baked in: top-k, group sizes, the scaling factor, GPT-OSS's clamp limit and alpha) and the experts' activation is
identified by evaluating their act_fn nodes. Everything from the router logits to the experts' output is then
replaced; the router's logits linear is kept as it is (dtype behaviour included), and whatever else the block does
(Qwen2-MoE's shared expert and its sigmoid gate, DeepSeek-V3's shared experts, reshapes) stays dense, for inductor.
A block that does not fit (a graph break inside it, an unknown gate function) is left alone and reported.
"""
from __future__ import annotations

import torch
from torch import fx

from moecompile.ir.config import identify_activation
from moecompile.passes.nodes import (
    arg,
    call,
    call_op,
    defaults,
    kind,
    moe_op,
    op_args,
    outputs,
    scalar_args,
    strip_casts,
    symbolic_number,
    tensor,
    value,
)

MOE = torch.ops.moecompile
GROUPED = defaults(MOE.route_grouped.default)  # routing a plain route does: softmax, no bias, one group, no scaling
GLU = {k: defaults(MOE.experts.default)[k] for k in ("interleaved", "alpha", "limit")}  # GPT-OSS's SwiGLU constants
KNOWN_BLOCKS = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock",
                "DeepseekV3MoE", "GptOssMLP")


class NotRecognised(Exception):
    """Why a block was left alone (goes into the report)."""


def _class_name(cls) -> str:
    return cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    return [(path, _class_name(cls)) for path, cls in (node.meta.get("nn_module_stack") or {}).values()]


def find_blocks(gm: fx.GraphModule) -> dict[str, dict]:
    """Known MoE blocks in graph order: block path -> {"cls", "router": [nodes], "experts": [nodes], "first"}."""
    blocks: dict[str, dict] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" and node.op != "call_method":
            continue  # parameters are placeholders (Dynamo) or get_attr (export) with a scope too: inputs here
        stack = _stack(node)
        for i, (path, cls) in enumerate(stack):
            if cls not in KNOWN_BLOCKS:
                continue
            block = blocks.setdefault(path, {"cls": cls, "router": [], "experts": [], "first": node})
            child = stack[i + 1][1] if i + 1 < len(stack) else ""
            if "router" in child.lower():
                block["router"].append(node)
            elif child.endswith("Experts"):
                block["experts"].append(node)
            break
    return blocks


def _external_inputs(nodes: list[fx.Node]) -> list[fx.Node]:
    inside, seen = set(nodes), []
    for node in nodes:
        for a in node.all_input_nodes:
            if a not in inside and a not in seen:
                seen.append(a)
    return seen


def _escaping(nodes: list[fx.Node]) -> list[fx.Node]:
    """The nodes' values read outside them; sizes left out (a dynamic-shape graph computes a symbolic size once and
    reads it wherever it recurs, so a size first computed inside the experts is read by later layers too)."""
    inside = set(nodes)
    return [n for n in nodes if any(u not in inside for u in n.users) and not _size(n)]


def _size(node: fx.Node) -> bool:
    return isinstance(value(node), (int, torch.SymInt))


def _descendants(node: fx.Node, within: set) -> set:
    found, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user in within and user not in found:
                found.add(user)
                stack.append(user)
    return found


def _routing(router: list[fx.Node], experts: list[fx.Node]) -> dict:
    """Logits node, router weight, top_k, scoring, renormalisation, correction bias, groups and scaling factor."""
    linears = [n for n in router if kind(n) == "linear"]
    if len(linears) != 1:
        raise NotRecognised(f"router has {len(linears)} linear layers, expected 1")
    logits = linears[0]
    weight, _ = strip_casts(arg(logits, "weight"))
    into_experts = [n for n in _escaping(router) if any(u in set(experts) for u in n.users)]
    ids = [n for n in into_experts if tensor(n) is not None and not tensor(n).dtype.is_floating_point]
    weights = [n for n in into_experts if tensor(n) is not None and tensor(n).dtype.is_floating_point]
    if len(ids) != 1 or len(weights) != 1:
        raise NotRecognised("router outputs are not one weights and one ids tensor (graph break inside the block?)")
    topks = [n for n in router if kind(n) == "topk"]
    if len(topks) not in (1, 3):
        raise NotRecognised(f"router has {len(topks)} top-k operations, expected 1 (or 3 with expert groups)")
    after = _descendants(topks[-1], set(router))
    softmaxes = [n for n in router if kind(n) == "softmax"]
    scoring = "sigmoid" if any(kind(n) == "sigmoid" for n in router) else "softmax" if softmaxes else None
    if scoring is None:
        raise NotRecognised("router computes neither softmax nor sigmoid scores")
    info = {**GROUPED, "logits": logits, "weight": weight, "top_k": tensor(ids[0]).shape[-1],
            "num_experts": tensor(weight).shape[0], "scoring": scoring}
    # GPT-OSS: softmax over the top-k logits == softmax over all, top-k, renormalised
    info["renormalize"] = any(s in after for s in softmaxes) or any(kind(n) == "div" for n in after)
    scales = [scalar_args(n)[0] for n in after if kind(n) == "mul" and len(scalar_args(n)) == 1
              and len(n.all_input_nodes) == 1 + symbolic_number(scalar_args(n)[0])]
    if any(symbolic_number(a) for a in scales) and len(scales) > 1:
        raise NotRecognised("the routing weights are scaled more than once, by a graph input among others")
    for a in scales:  # a graph input (dynamic=True) is passed on as it is
        info["scaling_factor"] = a if symbolic_number(a) else info["scaling_factor"] * float(a)
    if len(topks) == 3:  # DeepSeek-V3: group score = sum of the two best, keep topk_group groups, then top-k
        grouped = tensor(arg(topks[0], "input"))
        if grouped is None or grouped.dim() != 3 or arg(topks[0], "k") != min(2, grouped.shape[-1]):
            raise NotRecognised("expert groups are not scored by their two best experts")
        info["n_group"], info["topk_group"] = int(grouped.shape[1]), int(arg(topks[1], "k"))
    for n in router:
        if kind(n) == "add" and scoring == "sigmoid":
            biases = [a for a in n.all_input_nodes if a.op == "placeholder" or a.op == "get_attr"]
            if len(biases) == 1 and tensor(biases[0]) is not None and tensor(biases[0]).dim() == 1:
                info["correction_bias"] = biases[0]
    return info


def _evaluate_scope(nodes: list[fx.Node]):
    """The function from a scope's single tensor input to its single output (an act_fn module's nodes)."""
    inputs, outs = _external_inputs(nodes), _escaping(nodes)
    if len(inputs) != 1 or len(outs) != 1:
        raise NotRecognised(f"experts' act_fn takes {len(inputs)} inputs and gives {len(outs)} outputs, expected 1")
    (inp,), (out,) = inputs, outs

    def fn(x):
        env = {inp: x}
        for node in nodes:
            args = fx.map_arg(node.args, lambda a: env[a])
            kwargs = fx.map_arg(node.kwargs, lambda a: env[a])
            if node.op == "call_method":
                env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                env[node] = node.target(*args, **kwargs)
        return env[out]
    return fn


def _experts(experts: list[fx.Node], hidden_size: int) -> dict:
    """Expert weights (as graph nodes), layout and activation."""
    existing = [n for n in experts if moe_op(n) in ("experts", "experts_fp8")]
    if existing:  # the model already runs moecompile's experts (model.set_experts_implementation("moecompile"))
        args = op_args(existing[0])
        spec = {k: args.get(k, GLU.get(k)) for k in ("w_in", "b_in", "w_out", "b_out", "activation", "gated",
                                                     "interleaved", "alpha", "limit")}
        # FP8 experts (a FineGrainedFP8 model, moecompile.integrations.finegrained_fp8): weights stored in FP8
        scales = {args[w]: args[f"{w}_scale_inv"] for w in ("w_in", "w_out") if f"{w}_scale_inv" in args}
        return spec | {"transpose": False, "fp8_scales": scales}
    params = [a for a in _external_inputs(experts) if a.op in ("placeholder", "get_attr") and tensor(a) is not None]
    mats = [p for p in params if tensor(p).dim() == 3]
    vecs = [p for p in params if tensor(p).dim() == 2]
    if len(mats) != 2 or len(vecs) not in (0, 2):
        raise NotRecognised(f"experts hold {len(mats)} 3D weights and {len(vecs)} biases, expected 2 and 0 or 2")
    gate_up, down = (tensor(m).shape for m in mats)
    if gate_up[2] == hidden_size and down[1] == hidden_size and gate_up[1] == 2 * down[2]:
        transpose = False  # [E, 2I, H], [E, H, I]: moecompile's own layout
    elif gate_up[1] == hidden_size and down[2] == hidden_size and gate_up[2] == 2 * down[1]:
        transpose = True  # [E, H, 2I], [E, I, H] (GPT-OSS): passed as transposed views, never copied
    else:
        raise NotRecognised(f"expert weights {tuple(gate_up)}, {tuple(down)} are not gate_up / down projections")
    interleaved = any(kind(n) == "getitem" and _steps_by_two(n.args[1]) for n in experts)
    spec = {"w_in": mats[0], "w_out": mats[1], "b_in": vecs[0] if vecs else None, "b_out": vecs[1] if vecs else None,
            **GLU, "transpose": transpose, "gated": True, "interleaved": interleaved, "fp8_scales": {}}
    act_scope = _act_fn_nodes(experts)
    if act_scope:
        try:
            spec["activation"] = identify_activation(_evaluate_scope(act_scope))
        except NotRecognised:
            raise
        except Exception as e:  # noqa: BLE001 - an act_fn that cannot run on its own is not one we know
            raise NotRecognised(f"experts' act_fn cannot be evaluated alone ({type(e).__name__})") from e
        if spec["activation"] is None:
            raise NotRecognised("experts' act_fn is none of the known activations")
        return spec
    # no act_fn module: a custom gate such as GPT-OSS's clamp / sigmoid(alpha * gate) SwiGLU
    clamps = [n for n in experts if kind(n) == "clamp" and tensor(n) is not None and tensor(n).dtype.is_floating_point]
    upper = [arg(n, "max") for n in clamps if arg(n, "min") is None]
    alphas = [scalar_args(n)[0] for n in experts if kind(n) == "mul" and len(scalar_args(n)) == 1
              and any(kind(u) == "sigmoid" for u in n.users)]
    if len(upper) != 1 or len(alphas) != 1 or not any(kind(n) == "sigmoid" for n in experts):
        raise NotRecognised("experts' gate function is neither act(gate) * up nor GPT-OSS's clamped SwiGLU")
    spec.update(activation="swiglu_oai", limit=_number(upper[0]), alpha=_number(alphas[0]))
    return spec


def _number(a):
    """A float constant as a float; a symbolic one (a graph node) as the node, which the experts op then reads."""
    return a if symbolic_number(a) else float(a)


def _describe(a) -> str:
    return a.name if isinstance(a, fx.Node) else f"{a:g}"


def _steps_by_two(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, slice) and i.step == 2 for i in items)


def _act_fn_nodes(experts: list[fx.Node]) -> list[fx.Node]:
    """Nodes that ran inside a child module of the experts (their act_fn)."""
    depth = min(len(_stack(n)) for n in experts)
    return [n for n in experts if len(_stack(n)) > depth]


def _hidden_input(router: list[fx.Node], experts: list[fx.Node]) -> fx.Node:
    """The token rows the experts take: their one floating-point input computed outside router and parameters."""
    inside_router = set(router)
    candidates = [a for a in _external_inputs(experts) if a not in inside_router
                  and a.op not in ("placeholder", "get_attr") and tensor(a) is not None
                  and tensor(a).dtype.is_floating_point]
    if len(candidates) != 1 or tensor(candidates[0]).dim() != 2:
        raise NotRecognised("experts do not take one [tokens, hidden] input")
    return candidates[0]


def _rewrite(gm: fx.GraphModule, ctx, path: str, block: dict) -> str:
    router, experts = block["router"], block["experts"]
    if not router or not experts:
        raise NotRecognised("router or experts missing from this graph (graph break inside the block?)")
    r = _routing(router, experts)
    hidden = _hidden_input(router, experts)
    x = _experts(experts, tensor(hidden).shape[-1])
    escaping = _escaping(experts)
    if len(escaping) != 1:
        raise NotRecognised(f"experts have {len(escaping)} outputs, expected 1")
    out, graph = escaping[0], gm.graph
    meta = {"nn_module_stack": {k: v for k, v in (out.meta.get("nn_module_stack") or {}).items()
                                if v[0] == path or not v[0].startswith(path)}, "moecompile_block": path}
    with graph.inserting_before(out.next):
        routing = dict(router_logits=r["logits"], top_k=r["top_k"], capacity_factor=0.0,  # dropless, as HF routes
                       renormalize=r["renormalize"])
        if all(r[k] is v or r[k] == v for k, v in GROUPED.items()):
            route = call_op(graph, MOE.route.default, meta, **routing)
        else:
            route = call_op(graph, MOE.route_grouped.default, meta, **routing, **{k: r[k] for k in GROUPED})
        weights, ids = outputs(graph, route, 2, meta=meta)
        dispatch = call(graph, MOE.dispatch.default, hidden, ids, r["num_experts"], meta=meta)
        rows, order, offsets = outputs(graph, dispatch, 3, meta=meta)
        w_in, w_out = x["w_in"], x["w_out"]
        if x["transpose"]:
            w_in = call(graph, torch.transpose, w_in, 1, 2, meta=meta)
            w_out = call(graph, torch.transpose, w_out, 1, 2, meta=meta)
        y = call_op(graph, MOE.experts.default, meta, x=rows, offsets=offsets, w_in=w_in, b_in=x["b_in"], w_out=w_out,
                    b_out=x["b_out"], **{k: x[k] for k in ("activation", "gated", "interleaved", "alpha", "limit")})
        combined = call(graph, MOE.combine.default, y, order, weights, meta=meta)
    out.replace_all_uses_with(combined)
    ctx.fp8_scales.update(x["fp8_scales"])  # insert_fp8 runs these experts on the weights as stored
    keep = {r["logits"], hidden}  # the router linear stays; the rest of router and experts goes unless still used
    for node in reversed(router + experts):
        if node not in keep and not node.users:
            graph.erase_node(node)
    desc = [f"{r['num_experts']} experts", f"top-{r['top_k']}", r["scoring"]]
    if r["renormalize"]:
        desc.append("renormalised")
    if r["correction_bias"] is not None:
        desc.append("correction bias")
    if r["n_group"] > 1:
        desc.append(f"{r['topk_group']} of {r['n_group']} groups")
    if symbolic_number(r["scaling_factor"]) or r["scaling_factor"] != 1.0:
        desc.append(f"scaled x{_describe(r['scaling_factor'])}")
    desc.append(x["activation"] + (f" (alpha {_describe(x['alpha'])}, limit {_describe(x['limit'])})"
                                   if x["activation"] == "swiglu_oai" else ""))
    if x["interleaved"]:
        desc.append("interleaved gate/up")
    if x["b_in"] is not None:
        desc.append("expert biases")
    if x["fp8_scales"]:
        desc.append("FP8 weights as stored")
    return f"{path}: {block['cls']} -> " + ", ".join(desc)


def recognise_moe(gm: fx.GraphModule, ctx) -> dict:
    """Pass: replace every known HF MoE block's router + experts with moecompile ops."""
    recognised, rejected = [], []
    for path, block in find_blocks(gm).items():
        try:
            recognised.append(_rewrite(gm, ctx, path, block))
        except NotRecognised as e:
            rejected.append(f"{path}: {block['cls']} left as is: {e}")
    ctx.moe_blocks = len(recognised)
    return {"recognised": recognised, "rejected": rejected}
