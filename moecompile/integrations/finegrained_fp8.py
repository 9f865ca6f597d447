"""Hugging Face FineGrainedFP8 models on moecompile's FP8 ops: a native FP8 checkpoint runs offline and compiles.

    import moecompile
    from moecompile.integrations import finegrained_fp8
    finegrained_fp8.enable(model)          # moecompile.generate does this itself
    compiled = torch.compile(model, backend="moecompile")

transformers builds an FP8 checkpoint (`quantization_config: {"quant_method": "fp8", "weight_block_size": [128,
128]}`) from `FP8Linear` (weight [N, K] float8_e4m3fn, weight_scale_inv [N/128, K/128] float32) and `FP8Experts`
(gate_up_proj [E, 2I, H] / down_proj [E, H, I] float8_e4m3fn, `<name>_scale_inv` per 128 x 128 block, float32).
Their forwards call transformers' FP8 kernels, which it fetches from the Hugging Face Hub on first use; Dynamo
cannot trace that fetch, and an offline machine cannot run it. enable() puts moecompile's ops in their place, over
the checkpoint's own FP8 tensors (no dequantised copy, no requantisation):
- FP8Experts: "moecompile" in transformers' FP8 experts interface (ALL_FP8_EXPERTS_FUNCTIONS, the hook
  `set_experts_implementation` dispatches through): FP8 dispatch -> moecompile::experts_fp8 -> combine. In a
  compiled graph recognise_moe then turns the block into moecompile's routing and hands the FP8 weights and their
  scales to insert_fp8 (experts_fp8 after the dispatch, routed_experts_fp8 for decode-sized blocks).
- FP8Linear: transformers has no hook for its linear, so each module's class becomes a subclass whose forward is
  moecompile::linear_fp8 (same parameters, same state dict).
Modules in another format (per-tensor or other block sizes, static activation scales, UE8M0 scales, FP4) are left
as transformers runs them, and listed in enable()'s report.

to_native_fp8(model) makes that layout from an in-memory bf16 / float32 model (what from_pretrained builds from an
FP8 checkpoint), quantising one module at a time.
"""
from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from moecompile.core.errors import MoECompileError
from moecompile.core.fp8_format import WEIGHT_BLOCK
from moecompile.integrations import hf_experts
from moecompile.ir import ops
from moecompile.ir.fp8 import quantize_blocks, quantize_weight, routed_fp8

NAME = hf_experts.NAME
_SPEC_ATTR = "_moecompile_fp8_spec"
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")  # FP8Experts' quantised tensors (up_proj: no gate)


def _why_not(module: nn.Module, weights: tuple[str, ...]) -> str | None:
    """Why moecompile's FP8 ops cannot run an HF FP8 module as stored, or None."""
    block = getattr(module, "block_size", None)
    if block is None or list(block) != [WEIGHT_BLOCK, WEIGHT_BLOCK]:
        return f"weight_block_size {block}, moecompile's FP8 ops take [{WEIGHT_BLOCK}, {WEIGHT_BLOCK}]"
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return f"activation_scheme {module.activation_scheme!r} (static activation scales)"
    for name in weights:
        w, s = getattr(module, name), getattr(module, f"{name}_scale_inv")
        if w.dtype != torch.float8_e4m3fn or s.dtype != torch.float32:
            return f"{name} in {w.dtype} with {s.dtype} scales, expected float8_e4m3fn with float32"
        tiles = (*w.shape[:-2], *(-(-n // WEIGHT_BLOCK) for n in w.shape[-2:]))
        if tuple(s.shape) != tiles:  # e.g. gate_up_proj's scales when its halves are not whole blocks
            return f"{name}_scale_inv has shape {tuple(s.shape)}, not one scale per {WEIGHT_BLOCK}x{WEIGHT_BLOCK} block"
    return None


def experts_spec(module: nn.Module) -> dict:
    """activation and gating of an FP8Experts module (cached on it), checked once eagerly against its own gate."""
    spec = getattr(module, _SPEC_ATTR, None)
    if spec is not None:
        return spec
    gated = getattr(module, "has_gate", True)
    if getattr(module, "swiglu_alpha", None) is not None or getattr(module, "limit", None) is not None:
        raise MoECompileError(f"{type(module).__name__}: a clamped SwiGLU (swiglu_limit) in FP8 is not supported")
    why = _why_not(module, ("gate_up_proj" if gated else "up_proj", "down_proj"))
    if why:
        raise MoECompileError(f"{type(module).__name__}: {why}")
    spec = {"activation": hf_experts._activation(module), "gated": gated, "interleaved": False, "alpha": 1.702,
            "limit": 7.0}
    if not torch.compiler.is_compiling():
        hf_experts._verify(module, spec)
        setattr(module, _SPEC_ATTR, spec)
    return spec


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """FP8Experts forward on moecompile ops: FP8 dispatch -> experts_fp8 -> combine, over the stored FP8 weights."""
    spec = experts_spec(self)
    gated = spec["gated"]
    w_in, s_in = ((self.gate_up_proj, self.gate_up_proj_scale_inv) if gated
                  else (self.up_proj, self.up_proj_scale_inv))
    y, order = routed_fp8(hidden_states, top_k_index, w_in, s_in, None, self.down_proj, self.down_proj_scale_inv,
                          None, spec["activation"], gated)
    return ops.combine(y, order, top_k_weights)


def _linear_forward(self, input: torch.Tensor) -> torch.Tensor:
    return ops.linear_fp8(input, self.weight, self.weight_scale_inv, self.bias)


@functools.cache
def _linear_class(base: type) -> type:
    """base (transformers' FP8Linear) with moecompile::linear_fp8 as its forward."""
    return type(f"MoECompile{base.__name__}", (base,), {"forward": _linear_forward, "__module__": __name__})


def enable(model: nn.Module) -> dict:
    """Run model's FineGrainedFP8 linears and experts on moecompile's FP8 ops, in place (see the module docstring).
    Returns {"linears": [names], "experts": [names], "left": ["name: why"]}; a model without FP8 modules is
    untouched."""
    report, left_experts = {"linears": [], "experts": [], "left": []}, []
    hf = sys.modules.get("transformers.integrations.finegrained_fp8")  # imported wherever an FP8 module was built
    if hf is None:
        return report
    FP8Experts, FP8Linear = hf.FP8Experts, hf.FP8Linear  # noqa: N806 - transformers' class names
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear) and type(module).forward is not _linear_forward:
            why = _why_not(module, ("weight",)) or ("grouped linear" if hasattr(module, "n_groups") else None)
            if why:
                report["left"].append(f"{name}: {why}")
                continue
            module.__class__ = _linear_class(type(module))
            report["linears"].append(name)
        elif isinstance(module, FP8Experts):
            try:
                experts_spec(module)
            except MoECompileError as e:
                left_experts.append(str(e))
                continue
            report["experts"].append(name)
    if report["experts"] and left_experts:  # one experts implementation serves the whole model
        raise MoECompileError("moecompile runs all of a model's FP8 experts or none: " + "; ".join(left_experts))
    report["left"] += left_experts
    if report["experts"]:
        hf.ALL_FP8_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
        model.set_experts_implementation(NAME)
    return report


def quantised_weights(module: nn.Module) -> tuple[str, ...]:
    """Names of the FP8 weights of a transformers FP8 module (each beside its `<name>_scale_inv`), () for others."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    if isinstance(module, FP8Experts):
        return tuple(w for w in EXPERT_WEIGHTS if getattr(module, w, None) is not None)
    return ("weight",) if isinstance(module, FP8Linear) else ()


def _refusal(name: str, old: nn.Module, new: nn.Module) -> str | None:
    """Why the FP8 module transformers made for `name` cannot hold the old module's weights, or None."""
    if getattr(new, "intermediate_dim", WEIGHT_BLOCK) % WEIGHT_BLOCK:
        return (f"{name}: expert intermediate size {new.intermediate_dim} is not a multiple of {WEIGHT_BLOCK} "
                f"(gate_up_proj's gate and up halves would share FP8 scale blocks)")
    for w in quantised_weights(new):
        theirs = getattr(old, w, None)
        if not isinstance(theirs, torch.Tensor) or theirs.shape != getattr(new, w).shape:
            return f"{name}: {type(old).__name__}.{w} is not the [{', '.join(map(str, getattr(new, w).shape))}] " \
                   f"weight transformers' {type(new).__name__} stores"
    if hasattr(new, "n_groups"):
        return f"{name}: a grouped linear"
    return _why_not(new, quantised_weights(new))


def to_native_fp8(model: nn.Module, fill=None) -> nn.Module:
    """Convert an HF model in place to transformers' FineGrainedFP8 layout, as from_pretrained builds it from an FP8
    checkpoint: its quantizer swaps in FP8Linear / FP8Experts (lm_head and transformers' other skipped modules stay)
    and sets config.quantization_config; each module's weights are then block-quantised with moecompile.ir.fp8 and
    its unquantised module dropped, one module at a time (peak: the model plus one module's FP8 tensors).
    `fill(name, module)`, if given, is called on each unquantised module first: it may materialise a module built on
    the meta device (so a model never exists whole in bf16). Raises MoECompileError, the model unchanged, for a
    module the layout cannot hold. Run it with enable() (moecompile.compile / generate call it)."""
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    for name, module in model.named_modules():
        if name.endswith(".experts") and getattr(module, "has_bias", False):
            raise MoECompileError(f"{name}: transformers' FP8 experts hold no biases")
    originals = dict(model.named_modules())
    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(), pre_quantized=True)
    quantizer.preprocess_model(model)  # FP8 modules on the meta device in place of the converted ones
    swapped = [(name, originals[name], new) for name, new in model.named_modules()
               if new is not originals.get(name, new) and quantised_weights(new)]
    why = next(filter(None, (_refusal(name, old, new) for name, old, new in swapped)), None)
    if why:
        for name, old, _ in swapped:
            model.set_submodule(name, old)
        quantizer.remove_quantization_config(model)
        raise MoECompileError(f"cannot convert to transformers' FP8 layout: {why}")
    del originals
    with torch.no_grad():
        while swapped:
            name, old, new = swapped.pop(0)
            if fill is not None:
                fill(name, old)
            for w in quantised_weights(new):
                weight = getattr(old, w).detach()
                q, s = (quantize_weight if weight.dim() == 3 else quantize_blocks)(weight)  # experts one by one
                setattr(new, w, nn.Parameter(q, requires_grad=False))
                setattr(new, f"{w}_scale_inv", nn.Parameter(s, requires_grad=False))
            if getattr(new, "bias", None) is not None:
                new.bias = nn.Parameter(old.bias.detach(), requires_grad=False)
            del old  # its unquantised weights go with it
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    return model
