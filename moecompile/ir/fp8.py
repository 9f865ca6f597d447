"""FP8 experts (module view): expert weights in float8_e4m3fn with 128 × 128 block scales, activations quantised
per token per 128 channels on the fly, router untouched (float32 logits and routing). Inference only.

    model = moecompile.quantize_fp8(model)      # every MoEBlock's experts -> MoEExpertsFP8, in place
    moecompile.save(model, "minilm-moe8-fp8")   # F8_E4M3 tensors + float32 scale_inv, quantization_config
    model = moecompile.load("minilm-moe8-fp8")  # rebuilt as FP8 from the moe section
    model = moecompile.ir.fp8.dequantize(model)    # back to MoEExperts (e.g. to train)

A block's forward becomes route -> quantize_fp8 -> dispatch (FP8 rows, their scales gathered beside them) ->
experts_fp8 -> combine. Scale conventions (DeepSeek-V3 / HF FineGrainedFP8: x ≈ x_fp8 * scale_inv,
scale_inv = amax / 448) are in moecompile/core/fp8_format.py.
"""
from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from moecompile.core.errors import MoECompileError
from moecompile.core.fp8_format import (
    ACT_GROUP,
    FP8,
    WEIGHT_BLOCK,
    cdiv,
    dequantize_blocks,
    dequantize_groups,
    quantize_blocks,
    quantize_groups,
)
from moecompile.ir import layout, ops
from moecompile.ir.block import MoEBlock, MoEExperts
from moecompile.ir.config import MoEConfig

__all__ = ["MoEExpertsFP8", "quantize", "dequantize", "quantize_weight", "quantization_config", "FORMAT",
           # the quantisation math (moecompile/core/fp8_format.py), for code that may not import kernels (passes)
           "quantize_blocks", "dequantize_blocks", "quantize_groups", "dequantize_groups"]

# recorded in each FP8 block's layout entry; load() accepts exactly this
FORMAT = {"dtype": "float8_e4m3fn", "weight_block_size": [WEIGHT_BLOCK, WEIGHT_BLOCK],
          "activation_group_size": ACT_GROUP}
QUANTIZED = ("w_in", "w_in_scale_inv", "w_out", "w_out_scale_inv")  # tensors whose dtype never follows .to(dtype)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R, C] expert weights -> (fp8 [E, R, C], scale_inv [E, ceil(R/128), ceil(C/128)]), one expert at a time
    (the float32 working copy of a whole layer would be 4x its bf16 size)."""
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    s = torch.empty(w.shape[0], cdiv(w.shape[1], WEIGHT_BLOCK), cdiv(w.shape[2], WEIGHT_BLOCK), device=w.device)
    for e in range(w.shape[0]):
        q[e], s[e] = quantize_blocks(w[e].detach(), WEIGHT_BLOCK)
    return q, s


def routed_fp8(x, expert_ids, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out, activation: str,
               gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts' rows [T * k, H], order) of tokens x [T, H] routed to expert_ids [T, k] over FP8 expert weights, with
    FP8 dispatch: the T tokens are quantised before the dispatch (MoEExpertsFP8.routed, HF's FineGrainedFP8 experts
    in moecompile.integrations.finegrained_fp8)."""
    tokens_fp8, tokens_scale_inv = ops.quantize_fp8(x, ACT_GROUP)
    rows, order, offsets = ops.dispatch(tokens_fp8, expert_ids, w_in.shape[0])
    rows_scale_inv = tokens_scale_inv.index_select(0, order // expert_ids.shape[-1])
    y = ops.experts_fp8(rows, rows_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                        activation, gated, _out_dtype(x))
    return y, order


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The experts' output dtype: autocast's when it is on (as for the unquantised experts), else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class MoEExpertsFP8(nn.Module):
    """MoEExperts with FP8 weights: w_in [E, F, H] and w_out [E, H, I] in float8_e4m3fn, w_in_scale_inv
    [E, ceil(F/128), ceil(H/128)] and w_out_scale_inv [E, ceil(H/128), ceil(I/128)] in float32; biases b_in [E, F],
    b_out [E, H] stay in the model's dtype. Same call as MoEExperts. Parameters, frozen: counted and saved like any
    weight; `model.to(dtype)` moves them between devices but keeps their dtypes."""

    def __init__(self, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out):
        super().__init__()
        self.w_in, self.w_in_scale_inv, self.b_in = _frozen(w_in), _frozen(w_in_scale_inv), _frozen(b_in)
        self.w_out, self.w_out_scale_inv, self.b_out = _frozen(w_out), _frozen(w_out_scale_inv), _frozen(b_out)

    @classmethod
    def quantize(cls, experts: MoEExperts) -> "MoEExpertsFP8":
        detach = (lambda t: None if t is None else t.detach())
        return cls(*quantize_weight(experts.w_in), detach(experts.b_in), *quantize_weight(experts.w_out),
                   detach(experts.b_out))

    @classmethod
    def empty(cls, config: MoEConfig) -> "MoEExpertsFP8":
        """The skeleton load() fills: shapes from config, float32 biases."""
        e, h, i, f = config.num_experts, config.hidden_size, config.expert_size, config.expert_in_features
        tiles = (lambda r, c: torch.ones(e, cdiv(r, WEIGHT_BLOCK), cdiv(c, WEIGHT_BLOCK)))
        return cls(torch.zeros(e, f, h, dtype=FP8), tiles(f, h), torch.zeros(e, f) if config.bias_in else None,
                   torch.zeros(e, h, i, dtype=FP8), tiles(h, i),
                   torch.zeros(e, h) if config.bias_out == "expert" else None)

    def dequantize(self, config: MoEConfig, dtype: torch.dtype = torch.float32) -> MoEExperts:
        with torch.device("meta"):
            experts = MoEExperts(config)
        experts.w_in = nn.Parameter(dequantize_blocks(self.w_in, self.w_in_scale_inv, WEIGHT_BLOCK, dtype))
        experts.w_out = nn.Parameter(dequantize_blocks(self.w_out, self.w_out_scale_inv, WEIGHT_BLOCK, dtype))
        for name in ("b_in", "b_out"):
            if getattr(self, name) is not None:
                setattr(experts, name, nn.Parameter(getattr(self, name).detach().to(dtype)))
        return experts

    def forward(self, rows, offsets, activation: str, gated: bool):
        x, x_scale_inv = ops.quantize_fp8(rows, ACT_GROUP)
        return self._experts_fp8(x, x_scale_inv, offsets, activation, gated, _out_dtype(rows))

    def routed(self, x, weights, expert_ids, activation: str, gated: bool) -> torch.Tensor:
        """MoEExperts.routed with FP8 dispatch: the T tokens are quantised before the dispatch instead of its T * k
        rows after it (the same numbers: the scales are per row), so the dispatch moves one byte per value instead
        of two and each row's scales are gathered beside it."""
        y, order = routed_fp8(x, expert_ids, self.w_in, self.w_in_scale_inv, self.b_in, self.w_out,
                              self.w_out_scale_inv, self.b_out, activation, gated)
        return ops.combine(y, order, weights)

    def _experts_fp8(self, x_fp8, x_scale_inv, offsets, activation: str, gated: bool, out_dtype: torch.dtype):
        return ops.experts_fp8(x_fp8, x_scale_inv, offsets, self.w_in, self.w_in_scale_inv, self.b_in, self.w_out,
                               self.w_out_scale_inv, self.b_out, activation, gated, out_dtype)

    def _apply(self, fn, recurse=True):
        # fn is a conversion such as t.to(device, dtype): apply it to an empty probe to learn the target device,
        # and move the FP8 weights and their float32 scales there without changing their dtype.
        order = list(self._parameters)
        kept = {name: self._parameters.pop(name) for name in QUANTIZED}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, p in kept.items():
                device = fn(p.data[:0]).device
                data = torch.empty_like(p.data, device=device) if p.is_meta else p.data.to(device)
                kept[name] = nn.Parameter(data, requires_grad=False)
            params = {**self._parameters, **kept}
            self._parameters.clear()
            self._parameters.update((name, params[name]) for name in order)
        return self

    def extra_repr(self) -> str:
        e, f, h = self.w_in.shape
        return f"experts={e}, in={h}, ffn_rows={f}, float8_e4m3fn, {WEIGHT_BLOCK}x{WEIGHT_BLOCK} block scales"


def _blocks(model: nn.Module) -> list[tuple[str, MoEBlock]]:
    blocks = layout.moe_blocks(model)
    if not blocks:
        raise MoECompileError(f"no MoE blocks in {type(model).__name__} to quantise: convert it with "
                              "moecompile.moeize first")
    return blocks


def quantize(model: nn.Module, progress: bool = False) -> nn.Module:
    """Quantise the experts of every MoEBlock in model to FP8, in place; returns model. The router, the shared
    bias and everything outside the blocks keep their dtype. Blocks already in FP8 are an error."""
    blocks = _blocks(model)
    done = [path or type(model).__name__ for path, b in blocks if isinstance(b.experts, MoEExpertsFP8)]
    if done:
        raise MoECompileError(f"experts already in FP8: {', '.join(done)}")
    for path, block in tqdm(blocks, desc="fp8", unit="block", disable=not progress):
        with torch.no_grad():
            block.experts = MoEExpertsFP8.quantize(block.experts)
        layout.annotate(model, path, fp8=dict(FORMAT))
    return model


def dequantize(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Turn every FP8 block's experts back into (trainable) MoEExperts in `dtype`, in place; returns model."""
    for path, block in _blocks(model):
        if isinstance(block.experts, MoEExpertsFP8):
            block.experts = block.experts.dequantize(block.config, dtype)
            layout.annotate(model, path, fp8=None)
    return model


def is_fp8(block: MoEBlock) -> bool:
    return isinstance(block.experts, MoEExpertsFP8)


def check_format(fmt, where: str) -> None:
    if fmt != FORMAT:
        raise MoECompileError(f"{where}: unsupported fp8 format {fmt!r}; this moecompile reads {FORMAT}")


def quantization_config(model: nn.Module) -> dict:
    """The HF FineGrainedFP8 `quantization_config` for a model whose FP8 tensors are the experts alone: every
    nn.Linear (attention, router, heads, ...) is listed as not converted, as transformers' loader expects."""
    keep = sorted(name for name, m in model.named_modules() if type(m) is nn.Linear)
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [WEIGHT_BLOCK, WEIGHT_BLOCK], "modules_to_not_convert": keep}
