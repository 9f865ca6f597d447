"""The pass pipelines: ordered lists of passes over a captured GraphModule, one list per entry point.

Each pass is a plain function `pass_(gm, ctx) -> report` that rewrites gm in place and returns a small dict
saying what it matched. After every pass the graph is checked: linted, recompiled and, when its placeholders carry
example values (Dynamo and export graphs do), fake-tensor propagated, with the output shapes and dtypes required
to stay what they were. Set MOECOMPILE_PRINT_GRAPH=1 (or the option print_graph) to print the graph before the
first pass and after each one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from moecompile.core import settings
from moecompile.passes.decode_attention import decode_attention
from moecompile.passes.direct_experts import direct_experts
from moecompile.passes.find_ffn import find_ffn
from moecompile.passes.fuse_projections import fuse_projections
from moecompile.passes.fuse_route_dispatch import fuse_route_dispatch
from moecompile.passes.gather_expert_rows import gather_expert_rows
from moecompile.passes.gqa_attention import gqa_attention
from moecompile.passes.insert_all_to_all import insert_all_to_all
from moecompile.passes.insert_fp8 import insert_fp8, insert_fp8_linears
from moecompile.passes.keep_first_projection import keep_first_projection
from moecompile.passes.matvec_fp8_linears import matvec_fp8_linears
from moecompile.passes.moeize import moeize
from moecompile.passes.nodes import value
from moecompile.passes.recognise_moe import recognise_moe
from moecompile.passes.set_capacity import set_capacity

PIPELINES = {
    # dense -> MoE on graphs captured by torch.export (moecompile.moeize's graph view)
    # (here and below) insert_fp8 and insert_all_to_all run only when options["fp8"] / options["expert_parallel"] ask
    "convert": [find_ffn, moeize, insert_fp8, insert_all_to_all],
    # Dynamo graphs in the torch.compile backend: existing MoE blocks -> moecompile ops, then their optimisation
    # (keep_first_projection only in training graphs; direct_experts, gather_expert_rows, fuse_projections,
    # gqa_attention and decode_attention only in inference graphs; gather_expert_rows after fuse_route_dispatch, whose
    # rows it reads, and after insert_fp8 and insert_all_to_all, which read the rows themselves; insert_fp8_linears
    # after fuse_projections, so that a fused weight is quantised whole, and matvec_fp8_linears after both, over every
    # FP8 linear the graph then has; decode_attention after gqa_attention, taking SDPA in either form).
    "compile": [recognise_moe, set_capacity, direct_experts, fuse_route_dispatch, insert_fp8, insert_all_to_all,
                gather_expert_rows, keep_first_projection, fuse_projections, insert_fp8_linears, matvec_fp8_linears,
                gqa_attention, decode_attention],
}
PIPELINE = PIPELINES["convert"]

# passes that an option turns on (default None: off) or off (default True: on): pass -> (option, default)
GATES = {set_capacity: ("capacity_factor", None), direct_experts: ("direct_experts", True),
         fuse_route_dispatch: ("fuse", True), gather_expert_rows: ("gather_rows", True),
         insert_fp8: ("fp8", None), insert_fp8_linears: ("fp8_linears", None),
         insert_all_to_all: ("expert_parallel", None),
         fuse_projections: ("fuse_projections", True), matvec_fp8_linears: ("decode_matvec", True),
         gqa_attention: ("gqa_attention", True), decode_attention: ("decode_attention", None)}


class GraphCheckError(RuntimeError):
    """A pass left a graph that does not type-check or changed what the graph returns (a moecompile bug)."""


@dataclass
class PassContext:
    options: dict = field(default_factory=dict)
    ffns: list = field(default_factory=list)  # set by find_ffn
    moe_blocks: int = 0  # set by recognise_moe
    # set by recognise_moe: expert weight node -> its scale_inv node, for experts stored in FP8 (a FineGrainedFP8
    # model); insert_fp8 runs them on those tensors as they are, whatever the option fp8
    fp8_scales: dict = field(default_factory=dict)
    reports: list[tuple[str, dict]] = field(default_factory=list)
    checked: str = "lint"  # "fake" when every pass was also fake-tensor propagated
    pipeline: str = "convert"  # which of PIPELINES runs (passes may emit different forms for each)
    example_inputs: list | None = None  # the placeholders' real values, when the caller has them (the backend)
    training: bool = False  # the graph will be differentiated (the backend: grad mode on, an input needing grad)
    # (input index, tensor): inputs a pass made views of its constants (fuse_projections); the caller keeps them so
    input_aliases: list = field(default_factory=list)


def output_signature(gm: fx.GraphModule, memo: dict | None = None) -> list | None:
    """Shapes and dtypes of gm's outputs, by fake-tensor propagation from the placeholders' example values; None
    when the graph carries none (then only lint checks it). With a memo (node -> its call and value, filled here)
    a node whose call is unchanged and whose inputs kept their metadata keeps its value: a pass's check
    propagates what the pass changed and what that changes."""
    from torch._subclasses.fake_tensor import FakeTensor

    inputs = [value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    modes = {v.fake_mode for v in inputs if isinstance(v, FakeTensor)}
    if len(modes) != 1 or any(v is None for v in inputs):
        return None
    (mode,) = modes  # the mode of the graph's own example values (the backend's tracing context has another)

    allow = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True  # constants a pass added (get_attr) are real tensors
    try:
        out = _Propagation(gm, mode, {} if memo is None else memo).propagate_dont_convert_inputs(*inputs)
    finally:
        mode.allow_non_fake_inputs = allow
    return [(str(tuple(v.shape)), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
            for v in pytree.tree_leaves(out)]


def _call(node: fx.Node) -> tuple:
    return node.op, node.target, node.args, node.kwargs


def _metadata(v) -> object:
    """What a node's readers see of its value: shape, strides, dtype and device of each tensor; other values."""
    return [(str(tuple(t.shape)), str(t.stride()), t.dtype, t.device) if isinstance(t, torch.Tensor) else
            (type(t).__name__, str(t)) for t in pytree.tree_leaves(v)]


class _Propagation(FakeTensorProp):
    def __init__(self, gm: fx.GraphModule, mode, memo: dict):
        super().__init__(gm, mode)
        self.memo, self.changed = memo, set()

    def run_node(self, n: fx.Node):
        kept = self.memo.get(n)
        if kept is not None and n.op != "placeholder" and not any(a in self.changed for a in n.all_input_nodes):
            try:
                same = kept[0] == _call(n)
            except Exception:  # noqa: BLE001 - an argument without a plain == (a tensor constant): recompute
                same = False
            if same:
                return kept[1]
        result = super().run_node(n)
        if kept is None or _metadata(kept[1]) != _metadata(result):
            self.changed.add(n)
        self.memo[n] = (_call(n), result)
        return result


def _check(gm: fx.GraphModule, name: str, expected: list | None, before: str, memo: dict) -> None:
    gm.graph.lint()
    gm.recompile()
    if expected is None or gm.code == before:  # an unchanged graph was checked already
        return
    try:
        got = output_signature(gm, memo)
    except GuardOnDataDependentSymNode:  # split sizes exchanged between ranks (insert_all_to_all): lint only
        return
    except Exception as e:  # noqa: BLE001 - any other failure to propagate is the pass's fault
        raise GraphCheckError(f"graph check after {name}: {type(e).__name__}: {e}") from e
    if got != expected:
        raise GraphCheckError(f"graph check after {name}: outputs changed from {expected} to {got}")


def _disabled(p, ctx: PassContext) -> str | None:
    """Why an option keeps pass p from running, or None."""
    if p not in GATES or (p is insert_fp8 and ctx.fp8_scales):
        return None
    option, default = GATES[p]
    chosen = ctx.options.get(option, default)
    return f"off (option {option}={chosen!r})" if chosen is None or chosen is False else None


def run_pipeline(gm: fx.GraphModule, options: dict | None = None, passes=None, pipeline: str = "convert",
                 example_inputs: list | None = None, training: bool = False) -> tuple[fx.GraphModule, PassContext]:
    ctx = PassContext(options=dict(options or {}), pipeline=pipeline, example_inputs=example_inputs,
                      training=training)
    verbose = settings.print_graph() or bool(ctx.options.get("print_graph"))
    memo = {}  # each node's call and value at the last check
    try:
        expected = output_signature(gm, memo)
    except Exception:  # noqa: BLE001 - a graph fake tensors cannot run (real get_attr weights): lint only
        expected = None
    ctx.checked = "lint" if expected is None else "fake"
    if verbose:
        print("=== graph before passes ===\n" + gm.graph.python_code("self").src)
    for p in PIPELINES[pipeline] if passes is None else passes:
        why = _disabled(p, ctx)
        if why:
            ctx.reports.append((p.__name__, {"skipped": why}))
            if verbose:
                print(f"=== after {p.__name__}: skipped, {why}: graph unchanged ===")
            continue
        before = gm.code
        report = p(gm, ctx)
        _check(gm, p.__name__, expected, before, memo)
        ctx.reports.append((p.__name__, report))
        if verbose:
            print(f"=== after {p.__name__}: {report} ===\n" + gm.graph.python_code("self").src)
    return gm, ctx
