"""`moecompile quantize --fp8` of a moecompile checkpoint, streaming: the same folder as load + fp8.quantize + save
(bit for bit: the same per-expert block quantisation, names and config), written tensor by tensor.

The model is never built with weights: the checkpoint's headers are checked against its module tree on the meta
device, each expert weight [E, R, C] becomes float8_e4m3fn plus `<name>_scale_inv` [E, ceil(R/128), ceil(C/128)]
as it streams (moecompile.io.hf_fp8.FP8Reader), and every other tensor is copied as stored. Peak memory is about
one expert tensor, whatever the model size.
"""
from __future__ import annotations

from pathlib import Path

import torch

from moecompile.core.errors import MoECompileError
from moecompile.io import checkpoint, stream
from moecompile.io.hf_fp8 import FP8Reader, fp8_entries
from moecompile.ir import fp8

QUANTIZED = ("w_in", "w_out")  # the expert tensors that become FP8, as fp8.MoEExpertsFP8 holds them


def quantize_checkpoint(source: str | Path, out: str | Path, max_shard_size: str | int = checkpoint.DEFAULT_SHARD_SIZE,
                        progress: bool = True) -> int:
    """Write the moecompile checkpoint `source` with FP8 experts to `out`; returns how many MoE blocks were
    quantised. `out` appears complete or not at all."""
    source = Path(source)
    config, moe = checkpoint.read_moe_config(source)
    checkpoint.refuse_sharded(source, moe)
    done = [b["path"] for b in moe["blocks"] if "fp8" in b]
    if done:
        raise MoECompileError(f"experts already in FP8: {', '.join(done)}")
    out = checkpoint.check_output_dir(out)
    max_bytes = stream.parse_size(max_shard_size)
    plan = stream.copies(checkpoint.weight_files(source))
    blocks = [{**b, "fp8": dict(fp8.FORMAT)} for b in moe["blocks"]]
    with torch.device("meta"):  # the module tree alone: no memory
        skeleton = checkpoint.apply_layout(checkpoint.build_skeleton(config, source), moe["blocks"])
        checkpoint.check_fit(skeleton, {t.name: (t.shape, stream.ST_DTYPES[t.dtype]) for t in plan}, source)
        qconfig = fp8.quantization_config(checkpoint.apply_layout(skeleton, blocks))
    experts = {f"{b['path']}.experts.{name}" for b in blocks for name in QUANTIZED}
    plan = [q for t in plan for q in (fp8_entries(t) if t.name in experts else [t])]
    files = stream.shard(plan, max_bytes)
    with checkpoint.atomic_directory(out) as tmp:
        stream.write_weights(tmp, files, FP8Reader(stream.read_copy), "fp8", progress)
        checkpoint.write_moe_config(tmp, {**config, "quantization_config": qconfig}, {**moe, "blocks": blocks})
        checkpoint.copy_tokenizer(source, tmp)
        checkpoint.copy_generation_config(source, tmp)
    return len(blocks)
