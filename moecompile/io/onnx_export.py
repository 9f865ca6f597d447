"""ONNX export through torch.onnx's dynamo exporter, with every MoE block either one `com.microsoft::MoE` node
or standard ONNX ops.

    report = moecompile.export_onnx(model, "model.onnx")    # dynamic batch and sequence axes

Per block, `contrib_reason` decides: when onnxruntime's contrib MoE op computes exactly what the block computes
(checked against onnxruntime 1.32 CPU: softmax over all logits, top-k, optional renormalisation; fc1 [E, F, H],
fc2 [E, H, I] like our w_in / w_out; activation "gelu" is the *tanh* approximation; "swiglu" with
swiglu_fusion=1 is silu(row 2i) * row 2i+1 with alpha 1, beta 0, no clamp), the block's forward is swapped, for
the export only, for one `torch.onnx.ops.symbolic("com.microsoft::MoE", ...)` node. Otherwise (capacity drops,
unit gate weighting, exact-erf gelu, gated non-silu experts, non-float32) the block keeps its moecompile ops and
translation_table() lowers each op to standard ONNX (opset 20):
    route     Softmax -> TopK -> renormalise; capacity: slot-major one-hot CumSum ranks vs ceil(|cf| T k / E)
    dispatch  stable sort of the assignments by expert (TopK on expert * N + position), Gather of the token rows
    experts   one Slice -> Gemm -> activation -> Gemm per expert (E is static), so each row is computed once,
              as in the reference kernel; empty groups are zero-row Gemms; dropped rows become zeros
    combine   inverse permutation (ScatterElements), Gather, weighted ReduceSum in float32
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx, nn

from moecompile.core.errors import MoECompileError
from moecompile.ir.block import MoEBlock
from moecompile.ir.config import MoEConfig
from moecompile.ir.knobs import never_drops
from moecompile.ir.layout import moe_blocks

OPSET = 20  # Gelu(approximate=...) is an ONNX op from opset 20
CONTRIB_OP = "com.microsoft::MoE"
# onnxruntime's activation_type for each of our plain activations it computes exactly ("gelu" is tanh-approximate)
CONTRIB_ACTIVATIONS = {"relu": "relu", "gelu_tanh": "gelu", "silu": "silu"}


def _onnx():
    """The optional dependencies, imported on use: pip install 'moecompile[onnx]'."""
    try:
        import onnx
        import onnxscript
    except ImportError as e:
        raise MoECompileError(f"ONNX export needs onnx and onnxscript: pip install 'moecompile[onnx]' ({e})") from None
    return onnx, onnxscript


# ---------------------------------------------------------------- which path a block takes

def contrib_reason(config: MoEConfig, dtype: torch.dtype) -> str | None:
    """None when com.microsoft::MoE reproduces the block exactly, otherwise why it does not."""
    if dtype != torch.float32:
        return f"{dtype} weights (the contrib path is exact for float32 routing only)"
    if config.gate_weighting != "router":
        return "unit gate weighting (every selected expert weighs 1)"
    if not never_drops(config.capacity_factor, config.top_k, config.num_experts):
        return f"capacity factor {config.capacity_factor} can drop tokens"
    if config.gated and config.activation != "silu":
        return f"gated {config.activation} experts (the contrib op gates with silu only)"
    if not config.gated and config.activation not in CONTRIB_ACTIVATIONS:
        return f"{config.activation} activation (onnxruntime's gelu is the tanh approximation)"
    return None


def _interleave(w: torch.Tensor, expert_size: int) -> torch.Tensor:
    """[E, 2I, ...] gate rows then up rows -> rows alternating gate, up (onnxruntime's swiglu_fusion=1)."""
    e = w.shape[0]
    return w.reshape(e, 2, expert_size, *w.shape[2:]).transpose(1, 2).reshape(w.shape).contiguous()


def _contrib_forward(block: MoEBlock, traced: set, hidden_states, top_k=None, capacity_factor=None):
    """MoEBlock.forward as one com.microsoft::MoE node (the block's experts already in onnxruntime's layout)."""
    traced.add(block)
    c, ex = block.config, block.experts
    if top_k not in (None, c.top_k) or capacity_factor not in (None, c.capacity_factor):
        raise MoECompileError("per-call top_k / capacity_factor overrides cannot be exported: set them in the "
                              "block's config")
    attrs = {"k": c.top_k, "normalize_routing_weights": int(c.renormalize), "use_sparse_mixer": 0}
    if c.gated:
        attrs.update(activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0)
    else:
        attrs["activation_type"] = CONTRIB_ACTIVATIONS[c.activation]
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    out = torch.onnx.ops.symbolic(CONTRIB_OP, [x, block.router_logits(x), ex.w_in, ex.b_in, ex.w_out, ex.b_out],
                                  attrs, dtype=x.dtype, shape=x.shape, version=1)
    if block.bias is not None:
        out = out + block.bias
    return out.reshape(shape)


def _use_contrib(block: MoEBlock, traced: set):
    """Swap in the contrib forward (and, for gated experts, interleaved gate/up rows); returns the undo."""
    ex, saved = block.experts, {}
    if block.config.gated:  # the interleaved copy replaces the parameter: no reshuffle op in the graph
        for name in ("w_in", "b_in"):
            p = getattr(ex, name)
            if p is not None:
                saved[name] = p
                setattr(ex, name, nn.Parameter(_interleave(p.detach(), block.config.expert_size),
                                               requires_grad=False))
    block.forward = functools.partial(_contrib_forward, block, traced)

    def undo():
        del block.forward  # back to the class's forward
        for name, p in saved.items():
            setattr(ex, name, p)
    return undo


@contextlib.contextmanager
def _export_view(model: nn.Module, contrib: bool, decisions: dict):
    """Plan every MoEBlock (decisions: path -> None or why not the contrib op) and put the contrib ones in
    their export form for the duration; the model is left exactly as it was. On exit, every block planned for
    the contrib op must have been traced through its forward (else its swapped weights fed other ops)."""
    undo, planned, traced = [], {}, set()
    # the graph view (passes/moeize) calls the moecompile ops directly: its blocks only hold the weights
    graph_view = isinstance(model, fx.GraphModule)
    try:
        for path, block in moe_blocks(model):
            if not contrib:
                reason = "contrib op disabled"
            elif graph_view:
                reason = "graph view: the moecompile ops are lowered one by one"
            else:
                reason = contrib_reason(block.config, block.experts.w_in.dtype)
            decisions[path] = reason
            if reason is None:
                undo.append(_use_contrib(block, traced))
                planned[path] = block
        yield
        missed = [path for path, block in planned.items() if block not in traced]
        if missed:
            raise MoECompileError(f"MoE block {missed[0]} was never called as a module during the export: "
                                  "export with contrib=False")
    finally:
        for f in reversed(undo):
            f()


# ---------------------------------------------------------------- translation table: moecompile op -> ONNX

def translation_table() -> dict:
    """moecompile op overload -> onnxscript function traced by torch.onnx (Python control flow on attributes
    runs at export time, so each function emits only the ops its block needs)."""
    _onnx()
    from onnxscript import ir
    from onnxscript import opset20 as op

    i64 = ir.DataType.INT64

    def const(values, dtype=i64):
        return op.Constant(value=ir.tensor(values, dtype=dtype))

    def static_dim(value, axis: int, what: str) -> int:
        dim = value.shape[axis] if value.shape is not None else None
        if not isinstance(dim, int):
            raise MoECompileError(f"ONNX export needs a static {what}, got {dim!r}")
        return dim

    def route(router_logits, top_k: int, capacity_factor: float, renormalize: bool):
        num_experts = static_dim(router_logits, -1, "expert count")
        probs = op.Softmax(op.Cast(router_logits, to=ir.DataType.FLOAT), axis=-1)
        weights, ids = op.TopK(probs, const([top_k]), axis=-1, largest=1, sorted=1)
        if renormalize:
            weights = op.Div(weights, op.ReduceSum(weights, const([-1]), keepdims=1))
        if capacity_factor == 0:
            return weights, ids
        # capacity ceil(|cf| * T * k / E), evaluated in float64 in the reference kernel's order
        tokens = op.Shape(router_logits, start=0, end=1)
        cap = op.Cast(op.Ceil(op.Div(op.Mul(op.Mul(op.Cast(tokens, to=ir.DataType.DOUBLE),
                                                   const([abs(capacity_factor)], ir.DataType.DOUBLE)),
                                            const([float(top_k)], ir.DataType.DOUBLE)),
                                     const([float(num_experts)], ir.DataType.DOUBLE))), to=i64)
        cap = op.Max(cap, const([1]))
        # slot-major queue position of each assignment in its expert: earlier same-expert assignments
        slot_major = op.Reshape(op.Transpose(ids, perm=[1, 0]), const([-1]))
        onehot = op.Cast(op.Equal(op.Unsqueeze(slot_major, const([1])), op.Range(const(0), const(num_experts),
                                                                                  const(1))), to=i64)
        rank = op.ReduceSum(op.Mul(op.CumSum(onehot, const(0), exclusive=1), onehot), const([1]), keepdims=0)
        keep = op.Reshape(op.Less(rank, cap), op.Concat(const([top_k]), tokens, axis=0))
        keep = op.Transpose(keep, perm=[1, 0])
        return (op.Where(keep, weights, const([0.0], ir.DataType.FLOAT)),
                op.Where(keep, ids, const([num_experts])))

    def dispatch(hidden, expert_ids, num_experts: int):
        top_k = static_dim(expert_ids, -1, "top_k")
        flat = op.Reshape(expert_ids, const([-1]))
        n = op.Shape(flat)
        n_scalar = op.Squeeze(n, const([0]))
        # unique keys (expert, position): TopK's ascending order of them is a stable sort by expert
        key = op.Add(op.Mul(flat, n_scalar), op.Range(const(0), n_scalar, const(1)))
        _, order = op.TopK(key, n, axis=0, largest=0, sorted=1)
        rows = op.Gather(hidden, op.Div(order, const(top_k)), axis=0)
        member = op.Equal(op.Unsqueeze(flat, const([1])), op.Range(const(0), const(num_experts), const(1)))
        counts = op.ReduceSum(op.Cast(member, to=i64), const([0]), keepdims=0)  # dropped (id E) left out
        offsets = op.Cast(op.CumSum(counts, const(0)), to=ir.DataType.INT32)
        return rows, order, offsets

    def act(h, name: str):
        if name == "gelu":
            return op.Gelu(h, approximate="none")
        if name == "gelu_tanh":
            return op.Gelu(h, approximate="tanh")
        if name == "relu":
            return op.Relu(h)
        if name == "silu":
            return op.Mul(h, op.Sigmoid(h))
        raise MoECompileError(f"no ONNX lowering for activation {name!r}")

    def scalar(value: float, like):
        return op.Constant(value=ir.tensor([value], dtype=like.dtype))

    def gated_activation(h, inner: int, name: str, interleaved: bool, alpha: float, limit: float):
        """ir.activations.expert_activation for gated experts: [gate | up] halves or interleaved columns."""
        step = const([2 if interleaved else 1])
        gate = op.Slice(h, const([0]), const([2 * inner if interleaved else inner]), const([1]), step)
        up = op.Slice(h, const([1 if interleaved else inner]), const([2 * inner]), const([1]), step)
        if name != "swiglu_oai":
            return op.Mul(act(gate, name), up)
        g = op.Min(gate, scalar(limit, h))  # GPT-OSS: gate clamped above, up both sides
        u = op.Max(op.Min(up, scalar(limit, h)), scalar(-limit, h))
        return op.Mul(op.Add(u, scalar(1.0, h)), op.Mul(g, op.Sigmoid(op.Mul(g, scalar(alpha, h)))))

    def experts(x, offsets, w_in, b_in, w_out, b_out, activation: str, gated: bool, interleaved: bool = False,
                alpha: float = 1.702, limit: float = 7.0):
        num_experts = static_dim(w_in, 0, "expert count")
        hidden = static_dim(w_out, 1, "hidden size")
        inner = static_dim(w_out, 2, "expert size")
        ends = op.Cast(offsets, to=i64)
        starts = op.Concat(const([0]), op.Slice(ends, const([0]), const([-1])), axis=0)
        outs = []
        for e in range(num_experts):
            index = const(e)
            xe = op.Slice(x, op.Slice(starts, const([e]), const([e + 1])), op.Slice(ends, const([e]), const([e + 1])),
                          const([0]))
            h = op.Gemm(xe, op.Gather(w_in, index, axis=0),
                        *([op.Gather(b_in, index, axis=0)] if b_in is not None else []), transB=1)
            if gated:
                a = gated_activation(h, inner, activation, interleaved, alpha, limit)
            else:
                a = act(h, activation)
            outs.append(op.Gemm(a, op.Gather(w_out, index, axis=0),
                                *([op.Gather(b_out, index, axis=0)] if b_out is not None else []), transB=1))
        # rows past the last group were dropped by capacity: zeros, as the reference kernel writes
        dropped = op.Sub(op.Shape(x, start=0, end=1), op.Slice(ends, const([-1]), const([num_experts])))
        zero = ir.tensor([0], dtype=w_out.dtype)
        outs.append(op.ConstantOfShape(op.Concat(dropped, const([hidden]), axis=0), value=zero))
        return op.Concat(*outs, axis=0)

    def combine(expert_out, order, weights):
        # inverse permutation: assignment (t, j) sits at sorted row inv[t * k + j]
        positions = op.Range(const(0), op.Squeeze(op.Shape(order), const([0])), const(1))
        inv = op.ScatterElements(op.ConstantOfShape(op.Shape(order), value=ir.tensor([0], dtype=i64)), order,
                                 positions, axis=0)
        rows = op.Gather(expert_out, inv, axis=0)
        rows = op.Reshape(rows, op.Concat(op.Shape(weights), op.Shape(expert_out, start=1), axis=0))
        acc = ir.DataType.DOUBLE if expert_out.dtype == ir.DataType.DOUBLE else ir.DataType.FLOAT
        out = op.ReduceSum(op.Mul(op.Cast(rows, to=acc), op.Unsqueeze(op.Cast(weights, to=acc), const([2]))),
                           const([1]), keepdims=0)
        return op.Cast(out, to=expert_out.dtype)

    return {torch.ops.moecompile.route.default: route,
            torch.ops.moecompile.dispatch.default: dispatch,
            torch.ops.moecompile.experts.default: experts,
            torch.ops.moecompile.combine.default: combine}


# ---------------------------------------------------------------- export

@dataclass
class ExportReport:
    path: Path
    blocks: dict[str, str | None] = field(default_factory=dict)  # module path -> None (contrib op) or why not
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)  # what was written: the .onnx file and any external data

    @property
    def contrib_blocks(self) -> list[str]:
        return [p for p, why in self.blocks.items() if why is None]

    @property
    def decomposed_blocks(self) -> dict[str, str]:
        return {p: why for p, why in self.blocks.items() if why is not None}

    def lines(self) -> list[str]:
        return [f"{p}: {CONTRIB_OP}" if why is None else f"{p}: standard ONNX ops ({why})"
                for p, why in self.blocks.items()]


EXAMPLE_BATCH, EXAMPLE_SEQUENCE = 2, 8  # > 1 each: torch.export specialises dimensions of size 0 and 1
DYNAMIC_AXES = {0: "batch", 1: "sequence"}


def token_ids(model: nn.Module, batch: int, sequence: int, seed: int = 0) -> torch.Tensor:
    """Random token ids for an HF text model (its config's vocab_size)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab:
        raise MoECompileError(f"cannot make token ids for {type(model).__name__}: pass args (and dynamic_shapes)")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, sequence), generator=gen).to(next(model.parameters()).device)


@contextlib.contextmanager
def _no_cache(model: nn.Module):
    """HF decoders return a KV cache unless config.use_cache is off; the export wants the logits alone."""
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None)
    if cached:
        config.use_cache = False
    try:
        yield
    finally:
        if cached:
            config.use_cache = cached


@contextlib.contextmanager
def _hf_experts_as_moecompile_ops(model: nn.Module):
    """An HF MoE model's experts modules run as moecompile's ops while exporting: torch.onnx has no form for HF's
    own implementations (grouped_mm's custom op; the eager loop's data-dependent shapes)."""
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    previous = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if can_set is None or previous in (None, "moecompile") or not can_set():
        yield
        return
    model.set_experts_implementation("moecompile")
    try:
        yield
    finally:
        model.set_experts_implementation(previous)


def _output_names(out) -> list[str] | None:
    """An HF ModelOutput's field names, in the order torch.onnx flattens its tensors."""
    if hasattr(out, "keys") and all(isinstance(v, torch.Tensor) for v in out.values()):
        return list(out.keys())
    return None


def _external_data(model: nn.Module) -> bool:
    """A protobuf holds at most 2 GB: larger models keep their weights in a side file."""
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return size > 1_500_000_000


def export_onnx(model: nn.Module, path: str | os.PathLike, args: tuple | None = None, kwargs: dict | None = None,
                dynamic_shapes=None, contrib: bool = True, overwrite: bool = False,
                progress: bool = True) -> ExportReport:
    """Export model (in eval mode) to an ONNX file that onnxruntime runs; returns which block took which path.

    Without args, model must be an HF text model: one input `input_ids` [batch, sequence], both axes dynamic.
    With args, pass dynamic_shapes as torch.export takes it (None: static shapes). contrib=False lowers every
    block to standard ops. The file is checked with onnx.checker and written atomically.
    """
    onnx, _ = _onnx()
    from tqdm.auto import tqdm

    path = Path(path)
    if path.exists() and not overwrite:
        raise MoECompileError(f"output file {path} exists")
    if args is None:
        args = (token_ids(model, EXAMPLE_BATCH, EXAMPLE_SEQUENCE),)
        dynamic_shapes = {"input_ids": DYNAMIC_AXES} if dynamic_shapes is None else dynamic_shapes
    args, kwargs = tuple(args), dict(kwargs or {})
    was_training = _set_training(model, False)
    report = ExportReport(path)
    try:
        with tqdm(total=2, desc="export onnx", unit="step", disable=not progress) as steps, \
                _no_cache(model), _hf_experts_as_moecompile_ops(model), torch.no_grad():
            names = _output_names(model(*args, **kwargs))
            with _export_view(model, contrib, report.blocks), _quiet_exporter():
                try:
                    program = torch.onnx.export(model, args, kwargs=kwargs, dynamo=True, opset_version=OPSET,
                                                dynamic_shapes=dynamic_shapes, output_names=names,
                                                custom_translation_table=translation_table(), optimize=True,
                                                verbose=False)
                except MoECompileError:
                    raise
                except Exception as e:  # noqa: BLE001 - the exporter's own failures, as one line
                    raise MoECompileError(f"torch.onnx could not export {type(model).__name__}: "
                                          f"{_summary(e)}") from e
            steps.update()
            report.input_names = [v.name for v in program.model.graph.inputs]
            report.output_names = [v.name for v in program.model.graph.outputs]
            report.files = _save(program, path, _external_data(model), onnx)
            steps.update()
    finally:
        _set_training(model, was_training)
    return report


def _set_training(model: nn.Module, mode: bool) -> bool:
    """model.train(mode); returns the previous mode. A module unlifted from torch.export refuses both: its mode
    was fixed when it was captured (moecompile captures in eval mode)."""
    previous = model.training
    try:
        model.train(mode)
    except NotImplementedError:
        pass
    return previous


@contextlib.contextmanager
def _quiet_exporter():
    """torch.onnx logs a warning per missing torchvision op and torch warns about its own deprecations."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _summary(e: Exception) -> str:
    """The line of an exporter error that says what went wrong (its first lines are boilerplate)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("<class"):
            return ln
    return lines[0] if lines else type(e).__name__


def _save(program, path: Path, external_data: bool, onnx) -> list[Path]:
    """Write into a temporary sibling folder, check, then move into place: no half-written output. Returns the
    files written (the model, and its external data file where the weights are too large to embed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        target = tmp / path.name
        program.save(target, external_data=external_data)
        try:
            onnx.checker.check_model(str(target), full_check=True)
        except onnx.checker.ValidationError as e:
            raise MoECompileError(f"the exported model fails onnx.checker: {_summary(e)}") from e
        written = []
        for f in sorted(tmp.iterdir()):
            os.replace(f, path.parent / f.name)
            written.append(path.parent / f.name)
        return written
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


def compare_onnxruntime(model: nn.Module, path: str | os.PathLike, inputs: list[tuple]) -> list[float]:
    """Max abs difference between onnxruntime (CPU provider) and torch on each input tuple, over all outputs."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise MoECompileError(f"checking the export needs onnxruntime: pip install 'moecompile[onnx]' ({e})") from None
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    diffs = []
    model.eval()
    with _no_cache(model), torch.no_grad():
        for args in inputs:
            out = model(*args)
            expected = list(out.values()) if _output_names(out) else torch.utils._pytree.tree_leaves(out)
            got = session.run(None, {n: a.cpu().numpy() for n, a in zip(names, args)})
            diffs.append(max(float((torch.from_numpy(g) - e.cpu()).abs().max()) for g, e in zip(got, expected)))
    return diffs
