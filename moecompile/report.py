"""What a model holds: its MoE blocks (or the FFNs a conversion would replace) and parameter counts.

MoE blocks are moecompile's MoEBlocks and Hugging Face's own MoE blocks (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3,
GPT-OSS, and the native folders `convert` writes): a block whose `experts` module holds the fused 3D expert weights
[E, ., .] that transformers 5 dispatches through its experts interface.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from moecompile.io import checkpoint
from moecompile.ir import knobs
from moecompile.ir.config import MoEConfig
from moecompile.ir.fp8 import is_fp8
from moecompile.ir.layout import moe_blocks


def parameter_counts(model: nn.Module) -> dict:
    """Total parameters, and those one token uses: all but the (experts - top_k) unselected experts per block
    (moecompile's and Hugging Face's); shared experts and routers are always active."""
    total = sum(p.numel() for p in model.parameters())  # parameters() counts tied weights once
    inactive = sum((b.config.num_experts - b.config.top_k) * b.config.params_per_expert() for _, b in moe_blocks(model))
    inactive += sum((b.experts - b.top_k) * b.params_per_expert for b in hf_moe_blocks(model))
    return {"total": total, "active_per_token": total - inactive}


class HFBlock:
    """One Hugging Face MoE block: its path, module, experts module, expert count and top-k."""

    def __init__(self, model: nn.Module, path: str, experts: nn.Module):
        self.path, self.experts_module = path, experts
        self.module = model.get_submodule(path)
        self.router = getattr(self.module, "gate", None) or getattr(self.module, "router", None)
        self.experts = experts.num_experts
        self.top_k = getattr(self.router, "top_k", None) or getattr(self.module, "top_k", None) or \
            model.config.num_experts_per_tok
        # the per-expert tensors: [E, ...] weights and biases
        self.expert_params = {n: p for n, p in experts.named_parameters(recurse=False) if p.shape[0] == self.experts}
        self.params_per_expert = sum(p.numel() for p in self.expert_params.values()) // self.experts
        down = experts.down_proj
        self.expert_size = down.shape[1] if getattr(experts, "is_transposed", False) else down.shape[2]
        self.gated = "gate_up_proj" in self.expert_params


def hf_moe_blocks(model: nn.Module) -> list[HFBlock]:
    """Every Hugging Face MoE block of model, in module order."""
    blocks = []
    for name, module in model.named_modules():
        down = getattr(module, "down_proj", None)
        if isinstance(down, nn.Parameter) and down.dim() == 3 and hasattr(module, "num_experts") and "." in name:
            blocks.append(HFBlock(model, name.rsplit(".", 1)[0], module))
    return blocks


def hf_block_rows(model: nn.Module) -> list[dict]:
    """block_rows of a Hugging Face MoE model: routing is transformers' (dropless); a capacity factor recorded by
    `convert` is the one moecompile.compile applies."""
    config = model.config
    record = getattr(config, "moecompile", None) or {}
    fp8 = getattr(config, "quantization_config", None) is not None
    return [{"path": b.path, "method": record.get("method", "native"), "experts": b.experts, "top_k": b.top_k,
             "expert_size": b.expert_size, "activation": getattr(config, "hidden_act", "?"), "gated": b.gated,
             "capacity_factor": record.get("capacity_factor", knobs.CAPACITY_FACTOR), "fp8": fp8,
             "params": sum(p.numel() for p in b.module.parameters()), "class": type(b.module).__name__}
            for b in hf_moe_blocks(model)]


def hf_probe_routing(model: nn.Module, tokens: int = 512, seed: int = 0,
                     input_ids: torch.Tensor | None = None) -> tuple[dict, int]:
    """moecompile.stats.probe_routing for a Hugging Face MoE model: ({block path: RoutingStats}, probe tokens) of
    one forward (eval, no grad) on input_ids, else on `tokens` random ids in rows of at most 128: each experts
    module's top-k choices as transformers hands them to it, and the router's softmax entropy. transformers drops
    no assignment; with a capacity factor recorded by `convert`, `dropped` counts those that moecompile.compile drops
    at it (every expert keeps at most MoEConfig's capacity of the batch's assignments)."""
    from moecompile.stats import RoutingStats

    if input_ids is None:
        config = model.config
        seq = min(tokens, 128, getattr(config, "max_position_embeddings", None) or 128)
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, config.vocab_size, (math.ceil(tokens / seq), seq), generator=gen)

    capacity_factor = (getattr(model.config, "moecompile", None) or {}).get("capacity_factor", knobs.CAPACITY_FACTOR)
    seen, hooks = {}, []
    for b in hf_moe_blocks(model):
        def on_experts(module, args, b=b):
            ids = args[1].reshape(-1)  # (hidden_states, top_k_index, top_k_weights)
            counts = torch.bincount(ids.clamp(max=b.experts), minlength=b.experts + 1)[:b.experts]
            kept = counts
            capacity = knobs.capacity(capacity_factor, ids.numel() // b.top_k, b.top_k, b.experts)
            if capacity is not None:
                kept = counts.clamp(max=capacity)
            seen.setdefault(b.path, {})["counts"] = kept
            seen[b.path]["dropped"] = (ids.numel() - kept.sum())

        def on_router(module, args, out, b=b):
            logits = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(logits) and logits.shape[-1] == b.experts:
                logp = torch.log_softmax(logits.float().reshape(-1, b.experts), -1)
                seen.setdefault(b.path, {})["entropy"] = -(logp.exp() * logp).sum(-1).mean()

        hooks.append(b.experts_module.register_forward_pre_hook(on_experts))
        if b.router is not None:
            hooks.append(b.router.register_forward_hook(on_router))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(input_ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    tops = {b.path: b.top_k for b in hf_moe_blocks(model)}
    stats = {path: RoutingStats(counts=s["counts"], dropped=s["dropped"], aux_loss=torch.zeros(()),
                                entropy=s.get("entropy", torch.tensor(float("nan"))), top_k=tops[path])
             for path, s in seen.items() if "counts" in s}
    return stats, input_ids.numel()


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
