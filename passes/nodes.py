"""What an FX node computes, the same way for Dynamo graphs (torch functions, Tensor methods, Python operators)
and exported graphs (aten ops), so that the passes read one vocabulary."""
from __future__ import annotations

import inspect
import operator

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.operator_schemas import get_signature_for_torch_op

from moecompile.ir import ops  # noqa: F401  (registers the torch.ops.moecompile ops every pass matches and builds)

# kind -> (callables, Tensor method names, aten / namespaced op names)
_KINDS = {
    "linear": ({F.linear, torch._C._nn.linear}, set(), {"aten::linear"}),
    "topk": ({torch.topk}, {"topk"}, {"aten::topk"}),
    "softmax": ({F.softmax, torch.softmax}, {"softmax"}, {"aten::softmax", "aten::_softmax"}),
    "sigmoid": ({torch.sigmoid, F.sigmoid}, {"sigmoid"}, {"aten::sigmoid"}),
    "div": ({operator.truediv, operator.itruediv, torch.div, torch.true_divide}, {"div", "div_", "__truediv__"},
            {"aten::div"}),
    "mul": ({operator.mul, operator.imul, torch.mul}, {"mul", "mul_", "__mul__"}, {"aten::mul"}),
    "add": ({operator.add, operator.iadd, torch.add}, {"add", "add_", "__add__"}, {"aten::add"}),
    "clamp": ({torch.clamp, torch.clip}, {"clamp", "clamp_", "clip"}, {"aten::clamp"}),
    "cast": (set(), {"float", "to", "type"}, {"aten::to", "aten::_to_copy"}),
    "view": ({torch.reshape}, {"view", "reshape"}, {"aten::view", "aten::reshape", "aten::_unsafe_view"}),
    "getitem": ({operator.getitem}, set(), set()),
    "chunk": ({torch.chunk}, {"chunk"}, {"aten::chunk"}),
    "expand": (set(), {"expand"}, {"aten::expand"}),
    "sdpa": ({F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}, set(),
             {"aten::scaled_dot_product_attention"}),
}


def op_name(node: fx.Node) -> str | None:
    """"namespace::name" of a torch.ops call (OpOverload or OpOverloadPacket), else None."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def kind(node: fx.Node) -> str | None:
    for name, (functions, methods, op_names) in _KINDS.items():
        if node.op == "call_function" and (node.target in functions or op_name(node) in op_names):
            return name
        if node.op == "call_method" and node.target in methods:
            return name
    return None


def moe_op(node: fx.Node) -> str | None:
    """"route", "dispatch", ... for a moecompile op node."""
    name = op_name(node)
    return name.split("::", 1)[1] if name and name.startswith("moecompile::") else None


# the input argument of each linear the passes rewrite: torch's, and moecompile's FP8 linear (weight in FP8 blocks)
LINEAR_INPUTS = {"linear": "input", "linear_fp8": "x"}


def linear_kind(node: fx.Node) -> str | None:
    """A key of LINEAR_INPUTS for a linear node, else None."""
    name = "linear_fp8" if moe_op(node) == "linear_fp8" else kind(node)
    return name if name in LINEAR_INPUTS else None


def value(node) -> object:
    """The example value Dynamo (meta "example_value") or export / FakeTensorProp (meta "val") recorded."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def tensor(node) -> torch.Tensor | None:
    """value(node) when it is a tensor; None for a symbolic size (a SymInt placeholder of a dynamic-shape graph),
    a Python scalar or a node without one."""
    v = value(node)
    return v if isinstance(v, torch.Tensor) else None


def scalar_args(node: fx.Node) -> list:
    """The node's number arguments: constants, and nodes of a symbolic number (dynamic=True makes a module's float
    attribute a graph input that the graph reads with .item())."""
    return [a for a in list(node.args) + list(node.kwargs.values()) if symbolic_number(a)
            or (isinstance(a, (int, float)) and not isinstance(a, bool))]


def symbolic_number(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(value(a), (torch.SymInt, torch.SymFloat))


def cast_dtype(node: fx.Node):
    """The dtype a cast node converts to (None if it is not a cast or the dtype is not a constant)."""
    if kind(node) != "cast":
        return None
    if node.op == "call_method" and node.target == "float":
        return torch.float32
    for a in list(node.args[1:]) + list(node.kwargs.values()):
        if isinstance(a, torch.dtype):
            return a
    return None


def strip_casts(node):
    """(the node under any dtype casts, whether one of them cast to float32)."""
    to_fp32 = False
    while isinstance(node, fx.Node) and cast_dtype(node) is not None:
        to_fp32 |= cast_dtype(node) == torch.float32
        node = node.args[0]
    return node, to_fp32


def _view_base(node):
    while isinstance(node, fx.Node) and kind(node) == "view":
        node = node.args[0]
    return node


def same_tensor(a: fx.Node, b: fx.Node) -> bool:
    """a and b hold the same values: the same node, or views of one base with the same shape (view and reshape
    keep the element order)."""
    if a is b:
        return True
    if _view_base(a) is not _view_base(b) or value(a) is None or value(b) is None:
        return False
    return str(tuple(value(a).shape)) == str(tuple(value(b).shape))


_NO_DEFAULT = object()


def _parameters(node: fx.Node) -> list[tuple[str, bool, object]]:
    """(name, keyword-only, default or _NO_DEFAULT) of each argument of the op node's target, in schema order.
    torch.ops targets (moecompile's and aten's) from their schema; a torch function or Tensor method (Dynamo graphs)
    from its first signature. The tensor an op works on is `input` in all three (aten's schemas call it `self`)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        return [("input" if a.name == "self" else a.name, a.kwarg_only,  # aten's `self`: as torch's `input`
                 a.default_value if a.has_default_value() else _NO_DEFAULT) for a in target._schema.arguments]
    function = getattr(torch, target, None) if node.op == "call_method" else target
    signatures = get_signature_for_torch_op(function) if callable(function) else None
    if not signatures:
        raise TypeError(f"{node.format_node()}: no schema to read its arguments by name")
    return [(p.name, p.kind is inspect.Parameter.KEYWORD_ONLY,
             _NO_DEFAULT if p.default is inspect.Parameter.empty else p.default)
            for p in signatures[0].parameters.values()]


def _lookup(node: fx.Node, name: str) -> tuple[int, bool, object]:
    for index, (arg_name, kwarg_only, default) in enumerate(_parameters(node)):
        if arg_name == name:
            return index, kwarg_only, default
    raise KeyError(f"{node.format_node()} has no argument {name!r}")


def arg(node: fx.Node, name: str):
    """Argument `name` of an op node, passed by position or keyword, else its default: passes read op arguments by
    name, never by position."""
    index, kwarg_only, default = _lookup(node, name)
    if not kwarg_only and index < len(node.args):
        return node.args[index]
    if name in node.kwargs:
        return node.kwargs[name]
    if default is _NO_DEFAULT:
        raise KeyError(f"{node.format_node()} lacks argument {name!r}")
    return default


def set_arg(node: fx.Node, name: str, new) -> None:
    """Replace argument `name` of an op node where it is passed (by position or keyword; a keyword if omitted)."""
    index, kwarg_only, _ = _lookup(node, name)
    if not kwarg_only and index < len(node.args):
        node.update_arg(index, new)
    else:
        node.update_kwarg(name, new)


def getitems(node: fx.Node) -> dict[int, fx.Node]:
    """The getitem nodes reading a tuple-returning node, by index."""
    return {u.args[1]: u for u in node.users if u.op == "call_function" and u.target is operator.getitem}


def op_args(node: fx.Node) -> dict:
    """Every argument of an op node by name, defaults filled in."""
    return {name: arg(node, name) for name, _, _ in _parameters(node)}


def inline_graph(gm: fx.GraphModule, sub: fx.GraphModule, prefix: str, inputs: list[fx.Node]) -> fx.Node:
    """Copy sub's graph into gm's before the current insertion point, sub's get_attr targets under `prefix.` (where
    the caller put sub's module or parameters); returns the node of sub's output."""
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


def block_meta(node: fx.Node) -> dict:
    """What says where a node belongs (module scope, stack trace, MoE block tag): copied onto the nodes replacing it."""
    return {k: node.meta[k] for k in ("nn_module_stack", "stack_trace", "moecompile_block") if k in node.meta}


def call(graph: fx.Graph, target, *args, meta: dict | None = None) -> fx.Node:
    """A call_function node; `meta` (module scope, block tag) is copied onto it so later passes still see where
    it belongs."""
    node = graph.call_function(target, args)
    node.meta.update(meta or {})
    return node


def defaults(target) -> dict:
    """The arguments of a torch.ops overload that have defaults, with them (the schema is where they are decided)."""
    return {a.name: a.default_value for a in target._schema.arguments if a.has_default_value()}


def call_op(graph: fx.Graph, target, meta: dict | None = None, **arguments) -> fx.Node:
    """A call_function node of a torch.ops overload, its arguments given by name and placed in schema order (those
    left out before the last one given take their defaults)."""
    names = [a.name for a in target._schema.arguments]
    unknown = set(arguments) - set(names)
    if unknown:
        raise KeyError(f"{target} has no argument {sorted(unknown)}")
    last = max(names.index(n) for n in arguments) if arguments else -1
    args = []
    for a in target._schema.arguments[:last + 1]:
        if a.name not in arguments and not a.has_default_value():
            raise KeyError(f"{target} needs argument {a.name!r}")
        args.append(arguments[a.name] if a.name in arguments else a.default_value)
    return call(graph, target, *args, meta=meta)


def outputs(graph: fx.Graph, node: fx.Node, count: int, meta: dict | None = None) -> list[fx.Node]:
    return [call(graph, operator.getitem, node, i, meta=meta) for i in range(count)]
