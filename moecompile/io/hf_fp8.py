"""FP8 checkpoints of Hugging Face MoE models (Mixtral, Qwen2/3-MoE, DeepSeek, ...) in transformers' own layout,
written streaming.

transformers 5 keeps each MoE layer's experts fused in memory (`mlp.experts.gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`) but reads and writes them per expert (`...experts.<e>.w1.weight` for Mixtral,
`...experts.<e>.gate_proj.weight` for Qwen/DeepSeek), merging at load time. Its FineGrainedFP8 format adds a float32
`<name>.weight_scale_inv` per 128 × 128 block beside each float8_e4m3fn `<name>.weight`, which its loader merges into
the FP8 experts' `gate_up_proj_scale_inv` / `down_proj_scale_inv` (or, without a GPU, dequantises). So
quantize_checkpoint() rewrites a model folder tensor by tensor: every per-expert weight becomes FP8 blocks plus
scales, everything else is copied unchanged, and config.json gets the `quantization_config` with every other linear
layer listed in modules_to_not_convert. Gate and up are quantised separately, as transformers expects. Nothing is
held beyond a tensor or two (moecompile.io.stream): memory stays flat whatever the model size.
"""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from moecompile.core.errors import MoECompileError
from moecompile.core.fp8_format import cdiv
from moecompile.io import checkpoint, stream
from moecompile.ir.fp8 import WEIGHT_BLOCK, quantization_config, quantize_weight

EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.[^.]+\.weight$")  # one expert's projection, as HF 5 saves it
NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")  # weights: rewritten or never read


@dataclass
class FP8Entry(stream.Entry):
    """The float8_e4m3fn weight, or its float32 block scales, of the unquantised tensor `base`."""
    base: stream.Entry | None = None
    scale: bool = False


def fp8_entries(base: stream.Entry) -> list[FP8Entry]:
    """base [..., R, C] -> its FP8 weight (same name) and `<name>_scale_inv` [..., ceil(R/128), ceil(C/128)]."""
    *lead, r, c = base.shape
    return [FP8Entry(base.name, base.shape, "F8_E4M3", base=base),
            FP8Entry(f"{base.name}_scale_inv", (*lead, cdiv(r, WEIGHT_BLOCK), cdiv(c, WEIGHT_BLOCK)), "F32", base=base,
                     scale=True)]


class FP8Reader:
    """Reads the entries of a plan: FP8Entry ones quantised from their base tensor (read through `read`, which gives
    every other entry too). A base read twice in a row as the same tensor object is quantised once."""

    def __init__(self, read: Callable[[stream.Entry], torch.Tensor]):
        self.read, self.last = read, None

    def __call__(self, t: stream.Entry) -> torch.Tensor:
        if not isinstance(t, FP8Entry):
            return self.read(t)
        w = self.read(t.base)
        if self.last is None or self.last[0] is not w:
            self.last = None  # free the previous quantisation first
            self.last = (w, quantize_weight(w if w.dim() == 3 else w.unsqueeze(0)))  # per expert, as fp8.quantize
        q, s = self.last[1]
        out = s if t.scale else q
        return out if w.dim() == 3 else out[0]


def hf_quantization_config(config: dict, directory: Path) -> dict:
    """The FineGrainedFP8 quantization_config of the HF MoE model config.json describes, from its module tree on the
    meta device (no memory): every linear layer but the experts stays unquantised."""
    with torch.device("meta"):
        return quantization_config(checkpoint.build_skeleton(config, directory))


def quantize_checkpoint(source: str | Path, out: str | Path, progress: bool = True) -> int:
    """Write an FP8 (FineGrainedFP8) copy of the HF MoE model folder `source` to `out`, streaming, in the source's
    files; returns how many expert weights were quantised."""
    source = Path(source)
    config = checkpoint.read_config(source)
    if "quantization_config" in config:
        method = (config["quantization_config"] or {}).get("quant_method")
        raise MoECompileError(f"{source} is quantised already ({method})")
    out = checkpoint.check_output_dir(out)
    files: dict[str, list[stream.Entry]] = {}  # output file -> entries: the source's files, the same names
    quantized = 0
    for t in stream.copies(checkpoint.weight_files(source)):
        expert = EXPERT_WEIGHT.search(t.name) and len(t.shape) == 2
        files.setdefault(t.path.name, []).extend(fp8_entries(t) if expert else [t])
        quantized += bool(expert)
    if not quantized:
        raise MoECompileError(f"no per-expert weights (<...>.experts.<e>.<proj>.weight) in {source}: not a "
                              "Hugging Face MoE checkpoint")
    qconfig = hf_quantization_config(config, source)
    with checkpoint.atomic_directory(out) as tmp:
        stream.write_weights(tmp, list(files.items()), FP8Reader(stream.read_copy), "fp8", progress)
        checkpoint.write_config(tmp, {**config, "quantization_config": qconfig})
        for f in source.iterdir():
            if f.is_file() and f.name not in (checkpoint.CONFIG, checkpoint.WEIGHTS_INDEX) \
                    and not f.name.endswith(NOT_COPIED):
                shutil.copy2(f, tmp / f.name)
    return quantized
