"""What a model holds: its MoE blocks (or the FFNs a conversion would replace) and parameter counts."""
from __future__ import annotations

import math
from pathlib import Path

from torch import nn

from moecompile.io import checkpoint
from moecompile.ir.config import MoEConfig
from moecompile.ir.fp8 import is_fp8
from moecompile.ir.layout import moe_blocks


def parameter_counts(model: nn.Module) -> dict:
    """Total parameters, and those one token uses: all but the (experts - top_k) unselected experts per block."""
    total = sum(p.numel() for p in model.parameters())  # parameters() counts tied weights once
    inactive = sum((b.config.num_experts - b.config.top_k) * b.config.params_per_expert() for _, b in moe_blocks(model))
    return {"total": total, "active_per_token": total - inactive}


def human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def block_rows(model: nn.Module) -> list[dict]:
    return [_row(path, block.config, is_fp8(block), sum(p.numel() for p in block.parameters()))
            for path, block in moe_blocks(model)]


def _row(path: str, c: MoEConfig, fp8: bool, params: int) -> dict:
    return {"path": path, "method": c.method, "experts": c.num_experts, "top_k": c.top_k,
            "expert_size": c.expert_size, "activation": c.activation, "gated": c.gated,
            "capacity_factor": c.capacity_factor, "fp8": fp8, "params": params}


def checkpoint_summary(directory) -> dict:
    """block_rows and parameter_counts of a saved checkpoint from its config and safetensors headers alone: no
    weights are read, so this costs the same for any model size. Tied weights are stored once, as counted above."""
    directory = Path(directory)
    _, moe = checkpoint.read_moe_config(directory)
    checkpoint.refuse_sharded(directory, moe)
    sizes = {name: math.prod(shape) for name, (_, shape, _) in
             checkpoint.tensor_headers(checkpoint.weight_files(directory)).items()}
    rows, inactive = [], 0
    for entry in moe["blocks"]:
        c = MoEConfig.from_dict(entry["config"])
        params = sum(n for name, n in sizes.items() if name.startswith(entry["path"] + "."))
        rows.append(_row(entry["path"], c, "fp8" in entry, params))
        inactive += (c.num_experts - c.top_k) * c.params_per_expert()
    total = sum(sizes.values())
    return {"blocks": rows, "total": total, "active_per_token": total - inactive}
