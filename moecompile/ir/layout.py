"""Where the MoE blocks sit in a converted model: the record that save/load and inspect read.

A converted model carries `model.moe_layout`, a list of entries
    {"path": "transformer.h.0.mlp", "config": MoEConfig.to_dict(), "identity": ["..."]}
`path` is the submodule replaced by an MoEBlock; `identity` lists submodules replaced by nn.Identity because the
block absorbed them (BERT's output.dense, whose module also holds the residual LayerNorm).
"""
from __future__ import annotations

from torch import nn

from moecompile.ir.block import MoEBlock
from moecompile.ir.config import MoEConfig

LAYOUT_ATTR = "moe_layout"
FORMAT_VERSION = 2  # 2: config.json under model_type "moecompile" (moecompile.io.checkpoint)


def get_layout(model: nn.Module) -> list[dict]:
    return list(getattr(model, LAYOUT_ATTR, []) or [])


def entry(path: str, config: MoEConfig, identity: list[str]) -> dict:
    """The layout entry of one block (the streaming split writes these without building a model)."""
    return {"path": path, "config": config.to_dict(), "identity": list(identity)}


def record(model: nn.Module, path: str, config: MoEConfig, identity: list[str]) -> None:
    layout = [e for e in get_layout(model) if e["path"] != path]
    layout.append(entry(path, config, identity))
    object.__setattr__(model, LAYOUT_ATTR, layout)  # a plain attribute, not a submodule or buffer


def annotate(model: nn.Module, path: str, **fields) -> None:
    """Set (or, with None, remove) extra fields of the entry of the block at path, if the model records one."""
    entries = get_layout(model)
    for i, e in enumerate(entries):
        if e["path"] == path:
            entries[i] = {k: v for k, v in {**e, **fields}.items() if v is not None}
    object.__setattr__(model, LAYOUT_ATTR, entries)


def moe_blocks(model: nn.Module) -> list[tuple[str, MoEBlock]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoEBlock)]
