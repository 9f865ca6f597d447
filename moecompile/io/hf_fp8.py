"""FP8 checkpoints of Hugging Face MoE models (Mixtral, Qwen2/3-MoE, DeepSeek, ...) in transformers' own layout.

transformers 5 keeps each MoE layer's experts fused in memory (`mlp.experts.gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`) but reads and writes them per expert (`...experts.<e>.w1.weight` for Mixtral,
`...experts.<e>.gate_proj.weight` for Qwen/DeepSeek), merging at load time. Its FineGrainedFP8 format adds a float32
`<name>.weight_scale_inv` per 128 × 128 block beside each float8_e4m3fn `<name>.weight`, which its loader merges into
the FP8 experts' `gate_up_proj_scale_inv` / `down_proj_scale_inv` (or, without a GPU, dequantises). So
quantize_checkpoint() rewrites a model folder tensor by tensor, shard by shard: every per-expert weight becomes FP8
blocks plus scales, everything else is copied unchanged, and config.json gets the `quantization_config` with every
other linear layer listed in modules_to_not_convert. Gate and up are quantised separately, as transformers expects.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from moecompile.errors import MoECompileError
from moecompile.io import checkpoint
from moecompile.ir.fp8 import WEIGHT_BLOCK, quantization_config, quantize_blocks

EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.[^.]+\.weight$")  # one expert's projection, as HF 5 saves it
NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")  # weights: rewritten or never read


def _skeleton(config: dict, directory: Path) -> torch.nn.Module:
    """The model's module tree on the meta device (no memory): where its linear layers are."""
    with torch.device("meta"):
        return checkpoint.build_skeleton(config, directory)


def quantize_checkpoint(source: str | Path, out: str | Path, progress: bool = True) -> int:
    """Write an FP8 (FineGrainedFP8) copy of the HF MoE model folder `source` to `out`; returns how many expert
    weights were quantised."""
    source = Path(source)
    config = checkpoint.read_config(source)
    if "quantization_config" in config:
        method = (config["quantization_config"] or {}).get("quant_method")
        raise MoECompileError(f"{source} is quantised already ({method})")
    files = checkpoint.weight_files(source)
    qconfig = quantization_config(_skeleton(config, source))
    out = checkpoint.check_output_dir(out)
    quantized, added, total_size = 0, {}, 0
    with checkpoint.atomic_directory(out) as tmp:
        for path in tqdm(files, desc="fp8", unit="file", disable=not progress):
            tensors = checkpoint.read_tensors([path], progress=False)
            for key in [k for k, t in tensors.items() if EXPERT_WEIGHT.search(k) and t.dim() == 2]:
                tensors[key], scale = quantize_blocks(tensors[key], WEIGHT_BLOCK)
                tensors[f"{key}_scale_inv"] = scale
                added[f"{key}_scale_inv"] = path.name
                quantized += 1
            save_file(tensors, str(tmp / path.name), metadata={"format": "pt"})
            total_size += sum(t.nbytes for t in tensors.values())
        if not quantized:
            raise MoECompileError(f"no per-expert weights (<...>.experts.<e>.<proj>.weight) in {source}: not a "
                                  "Hugging Face MoE checkpoint")
        index = source / checkpoint.WEIGHTS_INDEX
        if index.is_file():
            data = json.loads(index.read_text())
            data["weight_map"].update(added)
            data.setdefault("metadata", {})["total_size"] = total_size
            (tmp / checkpoint.WEIGHTS_INDEX).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        checkpoint.write_config(tmp, {**config, "quantization_config": qconfig})
        for f in source.iterdir():
            if f.is_file() and f.name not in (checkpoint.CONFIG, checkpoint.WEIGHTS_INDEX) \
                    and not f.name.endswith(NOT_COPIED):
                shutil.copy2(f, tmp / f.name)
    return quantized
