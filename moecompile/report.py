"""What a model holds: its MoE blocks (or the FFNs a conversion would replace) and parameter counts."""
from __future__ import annotations

from torch import nn

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
    rows = []
    for path, block in moe_blocks(model):
        c = block.config
        rows.append({"path": path, "method": c.method, "experts": c.num_experts, "top_k": c.top_k,
                     "expert_size": c.expert_size, "activation": c.activation, "gated": c.gated,
                     "capacity_factor": c.capacity_factor, "fp8": is_fp8(block),
                     "params": sum(p.numel() for p in block.parameters())})
    return rows
