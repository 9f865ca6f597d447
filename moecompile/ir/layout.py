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
from moecompile.errors import MoECompileError

LAYOUT_ATTR = "moe_layout"
FORMAT_VERSION = 1


def get_layout(model: nn.Module) -> list[dict]:
    return list(getattr(model, LAYOUT_ATTR, []) or [])


def record(model: nn.Module, path: str, config: MoEConfig, identity: list[str]) -> None:
    layout = [e for e in get_layout(model) if e["path"] != path]
    layout.append({"path": path, "config": config.to_dict(), "identity": list(identity)})
    object.__setattr__(model, LAYOUT_ATTR, layout)  # a plain attribute, not a submodule or buffer


def annotate(model: nn.Module, path: str, **fields) -> None:
    """Set (or, with None, remove) extra fields of the entry of the block at path, if the model records one."""
    entries = get_layout(model)
    for i, e in enumerate(entries):
        if e["path"] == path:
            entries[i] = {k: v for k, v in {**e, **fields}.items() if v is not None}
    object.__setattr__(model, LAYOUT_ATTR, entries)


def apply_layout(model: nn.Module, layout: list[dict]) -> nn.Module:
    """Put freshly initialised MoEBlocks (and Identities) where `layout` says: the skeleton that load() fills.
    An entry with an "fp8" field gets FP8 experts (moecompile.ir.fp8)."""
    from moecompile.ir import fp8  # fp8 records its blocks through this module

    for entry in layout:
        try:
            model.get_submodule(entry["path"])
            for p in entry.get("identity", []):
                model.get_submodule(p)
        except AttributeError as e:
            raise MoECompileError(f"MoE layout does not fit this model: {e}") from None
        block = MoEBlock(MoEConfig.from_dict(entry["config"]))
        if "fp8" in entry:
            fp8.check_format(entry["fp8"], f"MoE block {entry['path']}")
            block.experts = fp8.MoEExpertsFP8.empty(block.config)
        model.set_submodule(entry["path"], block)
        for p in entry.get("identity", []):
            model.set_submodule(p, nn.Identity())
    object.__setattr__(model, LAYOUT_ATTR, [dict(e) for e in layout])
    return model


def moe_blocks(model: nn.Module) -> list[tuple[str, MoEBlock]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoEBlock)]
