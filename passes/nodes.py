"""What an FX node computes, the same way for Dynamo graphs (torch functions, Tensor methods, Python operators)
and exported graphs (aten ops), so that the passes read one vocabulary."""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

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
    for name, (functions, methods, ops) in _KINDS.items():
        if node.op == "call_function" and (node.target in functions or op_name(node) in ops):
            return name
        if node.op == "call_method" and node.target in methods:
            return name
    return None


def moe_op(node: fx.Node) -> str | None:
    """"route", "dispatch", ... for a moecompile op node."""
    name = op_name(node)
    return name.split("::", 1)[1] if name and name.startswith("moecompile::") else None


def value(node) -> object:
    """The example value Dynamo (meta "example_value") or export / FakeTensorProp (meta "val") recorded."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def scalar_args(node: fx.Node) -> list:
    return [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, (int, float))
            and not isinstance(a, bool)]


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


def call(graph: fx.Graph, target, *args, meta: dict | None = None) -> fx.Node:
    """A call_function node; `meta` (module scope, block tag) is copied onto it so later passes still see where
    it belongs."""
    node = graph.call_function(target, args)
    node.meta.update(meta or {})
    return node


def outputs(graph: fx.Graph, node: fx.Node, count: int, meta: dict | None = None) -> list[fx.Node]:
    return [call(graph, operator.getitem, node, i, meta=meta) for i in range(count)]
