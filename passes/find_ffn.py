"""find_ffn: structural match of feed-forward blocks in an exported graph.

An FFN is a linear whose input is an elementwise-only function of one linear's output (plain: act(x W1) W2) or
of two linears' outputs on the same input (gated: act(x Wg) * (x Wu) Wd). Only structure is matched: GPT-2's
NewGELU appears as mul/pow/tanh nodes, not aten.gelu. The activation is then identified by evaluating the matched
chain on random inputs and comparing it with the activations the experts kernel knows.

Works on the unlifted GraphModule of torch.export (`ep.module()`), where parameters are get_attr nodes named by
their fully qualified names, so each match maps back to modules of the original model.
"""
from __future__ import annotations

import networkx as nx
import torch
from torch import fx, nn

from moecompile.core.errors import MoECompileError
from moecompile.ffn.match import DenseFFN, FFNMatch, LinearRef, dense_ffn
from moecompile.ir.config import ACTIVATIONS
from moecompile.ir.config import activation_fn as apply_activation
from moecompile.passes.capture import capture, module_scopes
from moecompile.passes.nodes import arg

aten = torch.ops.aten

# ops that pass values through without computing: allowed inside an FFN chain and around its linears
TRANSPARENT = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default, aten.dropout.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
    aten.type_as.default,
}
IGNORED_SINKS = {aten._assert_tensor_metadata.default}
# linear-like ops: (data argument, weight argument, bias argument or None, weight stored as [out, in]?); aten's
# `self` is `input` (passes.nodes.arg)
LINEAR_OPS = {
    aten.linear.default: ("input", "weight", "bias", True),
    aten.addmm.default: ("mat1", "mat2", "input", False),
    aten.mm.default: ("input", "mat2", None, False),
    aten.matmul.default: ("input", "other", None, False),
}
MAX_CHAIN_NODES = 64


def _is_transparent(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in TRANSPARENT:
        return True
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags


def _linear_ref(node: fx.Node) -> LinearRef | None:
    spec = LINEAR_OPS.get(node.target) if node.op == "call_function" else None
    if spec is None:
        return None
    _, weight_name, bias_name, out_in = spec
    weight = arg(node, weight_name)
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
        return None
    bias = arg(node, bias_name) if bias_name is not None else None
    if bias is not None and not (isinstance(bias, fx.Node) and bias.op == "get_attr"):
        return None
    if len(weight.meta.get("val", torch.empty(0, 0)).shape) != 2:
        return None
    return LinearRef(node, weight.target, bias.target if bias is not None else None, out_in)


def _data_input(ref: LinearRef) -> fx.Node:
    return arg(ref.node, LINEAR_OPS[ref.node.target][0])


def _strip_views(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in TRANSPARENT and not _is_pointwise(node):
        node = arg(node, "input")
    return node


def node_graph(graph: fx.Graph) -> nx.DiGraph:
    """The data-flow graph of an FX graph: an edge from each node to every user."""
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        for user in node.users:
            g.add_edge(node, user)
    return g


def _chain_into(down: LinearRef, linears: dict[fx.Node, LinearRef], dfg: nx.DiGraph):
    """The transparent nodes feeding `down` back to their linear sources, or None if anything else feeds it."""
    chain, sources, stack = set(), set(), [_data_input(down)]
    while stack:
        node = stack.pop()
        if node in chain or node in sources:
            continue
        if node in linears:
            sources.add(node)
        elif _is_transparent(node) and len(chain) < MAX_CHAIN_NODES:
            chain.add(node)
            stack.extend(a for a in node.all_input_nodes)
        else:
            return None, None
    # the chain and its sources must feed nothing but the chain and the down projection
    allowed = chain | {down.node}
    for node in chain | sources:
        for user in dfg.successors(node):
            if user not in allowed and user.target not in IGNORED_SINKS:
                return None, None
    return chain, [linears[s] for s in sources]


def _evaluate_chain(gm: fx.GraphModule, chain: set, sources: list[LinearRef], out: fx.Node, inputs):
    """Run the matched chain alone as a function of its source linears' outputs."""
    g = fx.Graph()
    env = {s.node: g.placeholder(f"src{i}") for i, s in enumerate(sources)}
    for node in gm.graph.nodes:  # graph order is a topological order
        if node in chain:
            env[node] = g.node_copy(node, lambda n: env[n])
    g.output(env[out])
    return fx.GraphModule(gm, g)(*inputs)


def _identify(gm, chain, sources, out):
    """Which known activation the chain computes; for gated chains also which source is the gate."""
    gen = torch.Generator().manual_seed(0)
    shapes = [s.node.meta["val"].shape for s in sources]
    inputs = [torch.rand(shape, generator=gen) * 8 - 4 for shape in shapes]
    try:
        got = _evaluate_chain(gm, chain, sources, out, inputs).reshape(-1).float()
    except Exception:  # noqa: BLE001 - an unevaluable chain is simply not an FFN we can rewrite
        return None
    if got.numel() != inputs[0].numel():
        return None
    flat = [t.reshape(-1) for t in inputs]
    if len(sources) == 1:
        candidates = [(name, None) for name in ACTIVATIONS]
        compute = lambda name, _: apply_activation(name, flat[0])  # noqa: E731
    else:
        candidates = [(name, gate) for name in ACTIVATIONS for gate in (0, 1)]
        compute = lambda name, gate: apply_activation(name, flat[gate]) * flat[1 - gate]  # noqa: E731
    for name, gate in candidates:
        if torch.allclose(got, compute(name, gate), rtol=1e-4, atol=1e-5):
            return name, gate
    return None


def find_ffns(gm: fx.GraphModule) -> tuple[list[FFNMatch], list[str]]:
    """All FFNs in graph order, and one line for each linear->elementwise->linear pattern that was rejected."""
    linears = {n: ref for n in gm.graph.nodes if (ref := _linear_ref(n)) is not None}
    dfg = node_graph(gm.graph)
    matches, rejected = [], []
    for node, down in linears.items():
        chain, sources = _chain_into(down, linears, dfg)
        if not chain or not sources or len(sources) > 2:
            continue
        if len(sources) == 2 and _strip_views(_data_input(sources[0])) is not _strip_views(_data_input(sources[1])):
            continue
        if len(sources) == 1 and all(n.target in TRANSPARENT and not _is_pointwise(n) for n in chain):
            continue  # linear -> view -> linear: no activation, not an FFN
        found = _identify(gm, chain, sources, _data_input(down))
        if found is None:
            rejected.append(f"{down.module}: elementwise chain is not a supported activation "
                            f"({', '.join(ACTIVATIONS)})")
            continue
        activation, gate_index = found
        gate = up = None
        if gate_index is None:
            up = sources[0]
        else:
            gate, up = sources[gate_index], sources[1 - gate_index]
        ordered_chain = [n for n in gm.graph.nodes if n in chain]
        matches.append(FFNMatch(up=up, down=down, gate=gate, activation=activation, chain=ordered_chain,
                                input=_data_input(up)))
    return matches, rejected


def _is_pointwise(node: fx.Node) -> bool:
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def find_ffn(gm: fx.GraphModule, ctx) -> dict:
    """Pass: annotate ctx.ffns with the FFNs of gm (graph order); the report lists them."""
    matches, rejected = find_ffns(gm)
    ctx.ffns = matches
    for i, m in enumerate(matches):
        for ref in m.linears:
            ref.node.meta["moecompile_ffn"] = i
    return {"matched": [m.describe() for m in matches], "rejected": rejected}


# ---- the module view: the FFNs of a model and the module each replacement takes over -------------------------------

def _scope(scopes, path):
    return {n for n, paths in scopes.items()
            if path in paths and n.target is not torch.ops.aten._assert_tensor_metadata.default}


def _is_passthrough(node: fx.Node) -> bool:
    return node.target in TRANSPARENT and torch.Tag.pointwise not in getattr(node.target, "tags", ())


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _plan(model: nn.Module, gm: fx.GraphModule, match: FFNMatch, scopes) -> tuple[str, list[str]]:
    """Which module the MoEBlock replaces: the FFN's own module when it holds nothing else (GPT-2 mlp, LLaMA mlp),
    otherwise the module of the first projection and activation, with the second projection made an Identity
    (BERT: intermediate -> MoEBlock, output.dense -> Identity, output's LayerNorm kept)."""
    ffn_nodes = set(match.chain) | {r.node for r in match.linears}
    paths = [r.module for r in match.linears]
    common = paths[0].split(".")
    for p in paths[1:]:
        parts = p.split(".")
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    owner = ".".join(common)
    if owner and owner not in paths and all(n in ffn_nodes or _is_passthrough(n) for n in _scope(scopes, owner)):
        return owner, []
    # split form: the largest ancestor of the input projections holding only them and the activation chain
    in_nodes = ffn_nodes - {match.down.node}
    best = None
    for cand in _ancestors(match.up.module):
        scope = _scope(scopes, cand)
        if match.down.node in scope or not all(n in in_nodes or _is_passthrough(n) for n in scope):
            break
        if all(r.node in scope for r in match.linears[:-1]) and set(match.chain) <= scope:
            best = cand
    down_scope = _scope(scopes, match.down.module)
    if best is None or not all(n is match.down.node or _is_passthrough(n) for n in down_scope):
        raise MoECompileError(f"found {match.describe()} but no module boundary to replace it at")
    return best, [match.down.module]




def find_dense_ffns(model: nn.Module, example_args=None, example_kwargs=None) -> tuple[list[DenseFFN], list[str]]:
    """Capture the model and return its rewritable FFNs in graph order, plus one line per FFN skipped and why."""
    gm = capture(model, example_args, example_kwargs)
    matches, skipped = find_ffns(gm)
    scopes = module_scopes(gm)
    found = []
    for match in matches:
        try:
            owner, identity = _plan(model, gm, match, scopes)
        except MoECompileError as e:
            skipped.append(str(e))
            continue
        ffn = dense_ffn(model, match, owner, identity)
        if ffn.w_out.shape[0] != ffn.w_in.shape[1]:
            skipped.append(f"{owner}: output size {ffn.w_out.shape[0]} differs from input size {ffn.w_in.shape[1]}")
            continue
        if not identity:
            ffn.dropout = next((m.p for m in model.get_submodule(owner).children() if isinstance(m, nn.Dropout)), 0.0)
        found.append(ffn)
    return found, skipped
