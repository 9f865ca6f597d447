"""The torch.compile backend: `torch.compile(model, backend="moecompile", options={...})`.

Dynamo hands over each captured graph; the "compile" pipeline of passes/pipeline.py rewrites the MoE parts into
moecompile ops (recognise_moe, set_capacity, fuse_route_dispatch, and when asked insert_fp8 or insert_all_to_all),
fuses linears that read one tensor (fuse_projections) and everything else goes on to inductor
(compile_fx) unchanged; at one token (a batch-1 decode step) inductor computes the linears as matrix-vector
reductions (decode_matvec). The backend is found through the `torch_dynamo_backends` entry point, so no import of
moecompile is needed; it is a plain function (Dynamo registers the entry point's name itself, and registering
the same name twice fails).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch
from torch import fx

from moecompile.core.errors import MoECompileError

log = logging.getLogger("moecompile")

# option -> (type, default, meaning)
OPTIONS = {
    "inductor": (bool, True, "compile the rewritten graph with inductor; False: AOT autograd without code "
                             "generation (aot_eager, fast to compile)"),
    "mode": (str, None, "inductor mode, as torch.compile's mode= (e.g. max-autotune-no-cudagraphs)"),
    "inductor_config": (dict, None, "inductor config patches"),
    "fuse": (bool, True, "fuse_route_dispatch: router linear + routing + permutation as one op"),
    "gather_rows": (bool, True, "gather_expert_rows: the experts read the token rows in expert order themselves "
                                "instead of a permuted copy (inference graphs)"),
    "direct_experts": (bool, True, "direct_experts: at a few tokens (decode) permutation + experts + combine as one "
                                   "op over the unsorted assignments (inference graphs)"),
    "fuse_projections": (bool, True, "fuse_projections: linears reading one tensor (q/k/v, gate/up) as one GEMM "
                                     "over weights concatenated once (inference graphs)"),
    "gqa_attention": (bool, True, "gqa_attention: attention over repeated key/value heads as SDPA's grouped-query "
                                  "attention where a fused kernel takes it (inference graphs)"),
    "decode_attention": (bool, None, "decode_attention: one query token's attention over the cache as moecompile's "
                                     "split-KV kernel instead of SDPA (inference graphs; off: no faster in a step)"),
    "decode_matvec": (bool, True, "at one token (a batch-1 decode step) inductor computes the linears as "
                                  "matrix-vector reductions tuned by coordinate descent and fused with their "
                                  "neighbours, instead of GEMM library calls (inference graphs)"),
    "capacity_factor": ((int, float), None, "set_capacity: one capacity factor for every router (MoEConfig's "
                                            "convention)"),
    "print_graph": (bool, False, "print the graph before and after each pass"),
    "fp8": (bool, None, "insert_fp8: FP8 experts (inference); the expert weights are quantised once, from their "
                        "values when the graph compiles; at a few tokens (direct_experts) the kernel reads the FP8 "
                        "weights and dequantises them in registers, activations not quantised"),
    "fp8_linears": (bool, None, "insert_fp8_linears: the other linears (attention projections, dense and shared "
                                "FFNs, the logits head; not routers) as FP8 weights in 128x128 blocks, quantised "
                                "once when the graph compiles, dequantised in registers at decode (inference)"),
    "expert_parallel": (dict, None, "insert_all_to_all: experts sharded over {'group': ProcessGroup or None (the "
                                    "world), 'overlap_degree': int}; torch.distributed must be initialised"),
}
HISTORY = 64


@dataclass
class CompileRecord:
    """One graph the backend compiled: the rewritten GraphModule and each pass's report."""
    graph_module: fx.GraphModule
    reports: list[tuple[str, dict]]
    checked: str
    matvec_linears: int = 0  # linears inductor computes as matrix-vector reductions (option decode_matvec)

    @property
    def moe_blocks(self) -> int:
        return sum(len(r.get("recognised", [])) for _, r in self.reports)


_records: deque[CompileRecord] = deque(maxlen=HISTORY)


def records() -> list[CompileRecord]:
    """The last graphs the backend compiled in this process (oldest first)."""
    return list(_records)


def clear_records() -> None:
    _records.clear()


def resolve_options(options: dict | None, mode: str | None = None) -> dict:
    """Check options against OPTIONS and fill the defaults; a mistake is a one-line MoECompileError."""
    options = dict(options or {})
    if mode is not None and mode != "default":
        options.setdefault("mode", mode)
    for key, val in options.items():
        if key not in OPTIONS:
            raise MoECompileError(f"unknown moecompile option {key!r}; known: {', '.join(OPTIONS)}")
        kind = OPTIONS[key][0]
        if val is not None and (not isinstance(val, kind) or (kind is not bool and isinstance(val, bool))):
            raise MoECompileError(f"option {key!r} must be {getattr(kind, '__name__', 'a number')}, got {val!r}")
    if options.get("fp8") and options.get("expert_parallel") is not None:
        raise MoECompileError("options 'fp8' and 'expert_parallel' cannot be combined yet (the expert-parallel "
                              "path runs bf16/float32 experts)")
    unknown = set(options.get("expert_parallel") or {}) - {"group", "overlap_degree"}
    if unknown:
        raise MoECompileError(f"option 'expert_parallel' takes 'group' and 'overlap_degree', not {sorted(unknown)}")
    return {key: options.get(key, default) for key, (_, default, _) in OPTIONS.items()}


def recorded_options(model) -> dict:
    """The backend options a converted model records in its config (config.json's "moecompile" entry: the capacity
    factor chosen at conversion), which torch.compile with this backend and moecompile.compile both apply unless the
    caller's options say otherwise."""
    recorded = getattr(getattr(model, "config", None), "moecompile", None)
    if isinstance(recorded, dict) and "capacity_factor" in recorded:
        return {"capacity_factor": recorded["capacity_factor"]}
    return {}


def _traced_options() -> dict:
    """recorded_options of the model in the frame Dynamo hands over: a module among its arguments (self of
    model.forward), or a module an argument holds (as moecompile.generate's Generator holds its model); {} outside
    Dynamo or where none records any."""
    from torch._dynamo.symbolic_convert import tls

    tx = getattr(tls, "current_tx", None)  # the frame being traced; None when the backend is called directly
    candidates = []
    for local in getattr(tx, "f_locals", {}).values():
        if isinstance(local, torch.nn.Module):
            candidates.append(local)
        elif not isinstance(local, (torch.Tensor, type)) and hasattr(local, "__dict__"):
            candidates += [v for v in vars(local).values() if isinstance(v, torch.nn.Module)]
    for module in candidates:
        found = recorded_options(module)
        if found:
            return found
    return {}


def _inductor(gm: fx.GraphModule, example_inputs, opts: dict, matvec: bool, one_token: bool):
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    from moecompile.runtime import choices

    # with coordinate-descent tuning inductor decomposes a one-row matmul into a reduction it tunes to the memory
    # bandwidth and fuses with the norm before it or the add after it
    patches = {"coordinate_descent_tuning": True} if matvec else {}
    if choices.inductor_programmatic_launch(one_token) and hasattr(torch._inductor.config.triton, "enable_pdl"):
        patches["triton.enable_pdl"] = True  # (inductor checks the GPU has it)
    patches.update(list_mode_options(opts["mode"]) if opts["mode"] else {})
    patches.update(opts["inductor_config"] or {})
    return compile_fx(gm, example_inputs, config_patches=patches or None)


def moecompile_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    """Dynamo backend: rewrite MoE blocks into moecompile ops, then inductor (or eager with inductor=False)."""
    from moecompile.passes.matvec_fp8_linears import one_row_linears
    from moecompile.passes.pipeline import run_pipeline

    opts = resolve_options({**_traced_options(), **(options or {})}, mode)
    training = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in example_inputs)
    if training and (opts["expert_parallel"] is not None or opts["fp8"]):
        raise MoECompileError(f"option {'fp8' if opts['fp8'] else 'expert_parallel'!r} is inference-only: call the "
                              "compiled model under torch.no_grad() (train expert-parallel with "
                              "moecompile.distribute(model))")
    gm, ctx = run_pipeline(gm, opts, pipeline="compile", example_inputs=list(example_inputs), training=training)
    one_row = 0 if training else one_row_linears(gm)  # > 0: a batch-1 decode step
    matvec = one_row if opts["decode_matvec"] else 0
    _records.append(CompileRecord(gm, ctx.reports, ctx.checked, matvec))
    for name, report in ctx.reports:
        log.info("%s: %s", name, report)
    if matvec:
        log.info("decode_matvec: %d one-row linears as matrix-vector reductions", matvec)
    gm, constants = _constants_as_inputs(gm)
    inputs = [*example_inputs, *_static_fakes(constants, example_inputs)]
    if not opts["inductor"]:  # AOT autograd without code generation: the rewritten graph as inductor sees it
        from torch._dynamo.backends.debugging import aot_eager

        compiled = aot_eager(gm, inputs)
    else:
        compiled = _inductor(gm, inputs, opts, bool(matvec), one_row > 0)
    _keep_aliases(example_inputs, ctx.input_aliases)
    if not constants and not ctx.input_aliases:
        return compiled

    def call(*args):
        _keep_aliases(args, ctx.input_aliases)
        return compiled(*args, *constants)

    return call


def _keep_aliases(args, aliases: list) -> None:
    """Each input fuse_projections fused becomes a view of its part of the fused buffer, after it is compiled and
    whenever it was since replaced by another tensor (`p.data = t`): its values go into the buffer first."""
    for index, part in aliases:
        if args[index].data_ptr() != part.data_ptr():
            with torch.no_grad():
                part.copy_(args[index])
            args[index].data = part


def _static_fakes(constants: list[torch.Tensor], example_inputs) -> list[torch.Tensor]:
    """The constants as the compiler should see them: fakes of static shape in Dynamo's fake mode. Left real, AOT
    autograd would give them symbolic sizes that Dynamo has no source for, and a guard on one (a broadcast compares
    sizes) would break Dynamo's guards."""
    fake_mode = torch._guards.detect_fake_mode(list(example_inputs))
    return constants if fake_mode is None else [fake_mode.from_tensor(c, static_shapes=True) for c in constants]


def _constants_as_inputs(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """Tensors a pass made at compile time (insert_fp8's quantised weights, fuse_projections' fused ones) become
    trailing graph inputs: AOT autograd takes a Dynamo graph's attributes only from Dynamo's own list. The copy keeps
    what Dynamo told AOT autograd (each input's source, which are static) and marks the new inputs static too, so
    that CUDA graphs (mode="reduce-overhead") read the parameters and these tensors in place instead of copying
    every one of them into the graph's own buffers at each replay."""
    if not any(n.op == "get_attr" and n.meta.get("moecompile_constant") for n in gm.graph.nodes):
        return gm, []
    graph = fx.Graph()  # a copy: Dynamo reads its own graph's placeholders after the backend returns
    graph.output(graph.graph_copy(gm.graph, {}))
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    constants = []
    for node in [n for n in graph.nodes if n.op == "get_attr" and n.meta.get("moecompile_constant")]:
        with graph.inserting_after(last):
            last = graph.placeholder(node.target)
        constants.append(getattr(gm, node.target))
        last.meta["val"] = node.meta["val"]
        last.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}  # made once, never replaced
        last._dynamo_source = None
        node.replace_all_uses_with(last)
        graph.erase_node(node)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    return copy, constants


def compile(model, *, fullgraph: bool = False, dynamic: bool | None = None, **options):
    """torch.compile(model, backend="moecompile", options=options), without going through the entry point.

    Options (see OPTIONS): inductor, mode, inductor_config, fuse, direct_experts, fuse_projections, gqa_attention,
    decode_attention, decode_matvec, capacity_factor, print_graph, fp8, fp8_linears, expert_parallel. A Hugging Face
    FineGrainedFP8 model's FP8 modules are first put on moecompile's FP8 ops
    (moecompile.integrations.finegrained_fp8.enable)."""
    from moecompile.integrations import finegrained_fp8

    options = {**recorded_options(model), **options}
    resolve_options(options)  # fail here, not at the first call
    if isinstance(model, torch.nn.Module):
        finegrained_fp8.enable(model)
    return torch.compile(model, backend=moecompile_backend, fullgraph=fullgraph, dynamic=dynamic,
                         options=options or None)
