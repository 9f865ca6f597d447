"""Routing statistics of MoE blocks: tokens per expert, dropped assignments, aux loss, router entropy.

    moecompile.track_routing(model)            # every MoEBlock records its routing from now on
    model(batch)
    stats = moecompile.routing_stats(model)    # {block path: RoutingStats} of each block's last forward
    stats["transformer.h.0.mlp"].counts        # kept assignments per expert: int64 tensor [E]

Blocks keep detached tensors on their own device, so recording adds a few tiny kernels and no host sync; the
sync happens only where a value is read as a Python number (`summary()`, `as_floats`). Recording is skipped
while torch.export traces a block (the attribute would keep fake tensors) and works under torch.compile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moecompile.core.errors import MoECompileError
from moecompile.ir.layout import moe_blocks


@dataclass(frozen=True)
class RoutingStats:
    """One block's routing in one forward. counts.sum() + dropped == tokens * top_k."""

    counts: Tensor  # [E] int64: assignments each expert processed
    dropped: Tensor  # [] int64: assignments dropped by the capacity limit
    aux_loss: Tensor  # [] float32: the block's aux loss (load balancing + z-loss, scaled by their coefficients)
    entropy: Tensor  # [] float32: mean over tokens of the router softmax's entropy, nats (max log E)
    top_k: int

    @property
    def num_experts(self) -> int:
        return self.counts.numel()

    @property
    def assignments(self) -> Tensor:
        """tokens * top_k, as a device tensor."""
        return self.counts.sum() + self.dropped

    def metrics(self, per_expert: bool = True) -> dict[str, Tensor]:
        """0-d float tensors (no host sync): tokens, dropped_frac, aux_loss, entropy, load_max and load_min
        (the busiest / idlest expert's share relative to an even split: 1 = balanced), and with per_expert
        each expert's share of the assignments, `load/<e>` (they sum to 1 - dropped_frac)."""
        total = self.assignments.clamp(min=1).float()
        share = self.counts.float() / total
        out = {"tokens": self.assignments.float() / self.top_k, "dropped_frac": self.dropped.float() / total,
               "aux_loss": self.aux_loss, "entropy": self.entropy,
               "load_max": share.max() * self.num_experts, "load_min": share.min() * self.num_experts}
        if per_expert:
            out.update({f"load/{e}": share[e] for e in range(self.num_experts)})
        return out

    def summary(self) -> dict[str, float]:
        """metrics() without the per-expert shares, as Python floats (one host sync)."""
        return as_floats(self.metrics(per_expert=False))


class track_routing:  # noqa: N801 - used like a function, and as a context manager that restores on exit
    """Turn routing statistics on (or off) for every MoEBlock of model.

    `moecompile.track_routing(model)` takes effect at once; `with moecompile.track_routing(model): ...`
    also restores each block's previous setting on exit."""

    def __init__(self, model: nn.Module, enabled: bool = True):
        blocks = [b for _, b in moe_blocks(model)]
        if not blocks:
            raise MoECompileError(f"no MoE blocks in {type(model).__name__}: convert it with moecompile.moeize first")
        self._previous = [(b, b.track_routing) for b in blocks]
        for b in blocks:
            b.track_routing = enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for block, was in self._previous:
            block.track_routing = was


def routing_stats(model: nn.Module) -> dict[str, RoutingStats]:
    """{block path: RoutingStats} of each MoEBlock's last forward since tracking was turned on."""
    blocks = moe_blocks(model)
    if not blocks:
        raise MoECompileError(f"no MoE blocks in {type(model).__name__}: convert it with moecompile.moeize first")
    if not any(b.track_routing or b.routing is not None for _, b in blocks):
        raise MoECompileError("routing statistics are off: call moecompile.track_routing(model) before the forward")
    return {path: RoutingStats(**b.routing) for path, b in blocks if b.routing is not None}


def routing_metrics(model: nn.Module, prefix: str = "moe", per_expert: bool = True) -> dict[str, Tensor]:
    """Flat metric names -> 0-d tensors, for loggers: `<prefix>/<block path>/<metric>` for every block (see
    RoutingStats.metrics; a bare MoEBlock's path is "block") plus model-wide `<prefix>/aux_loss` (sum),
    `<prefix>/dropped_frac` and `<prefix>/entropy` (mean over blocks)."""
    stats = routing_stats(model)
    out = {}
    for path, s in stats.items():
        out.update({f"{prefix}/{path or 'block'}/{k}": v for k, v in s.metrics(per_expert).items()})
    if stats:
        device = next(iter(stats.values())).counts.device
        dropped = sum(s.dropped.to(device) for s in stats.values())
        assignments = sum(s.assignments.to(device) for s in stats.values())
        out[f"{prefix}/aux_loss"] = sum(s.aux_loss.to(device) for s in stats.values())
        out[f"{prefix}/dropped_frac"] = dropped.float() / assignments.clamp(min=1).float()
        out[f"{prefix}/entropy"] = sum(s.entropy.to(device) for s in stats.values()) / len(stats)
    return out


def as_floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """Tensors -> Python floats with one host transfer."""
    if not metrics:
        return {}
    device = next(iter(metrics.values())).device
    values = torch.stack([v.detach().float().to(device) for v in metrics.values()]).tolist()
    return dict(zip(metrics, values))


def probe_routing(model: nn.Module, tokens: int = 512, seed: int = 0,
                  input_ids: Tensor | None = None) -> tuple[dict[str, RoutingStats], int]:
    """Run model (eval, no grad) once on a probe batch and return its routing statistics and the token count.

    The probe is `input_ids` [batch, seq] when given (e.g. tokenized text), else `tokens` uniformly random ids
    from the vocabulary in rows of at most 128 (and at most the model's positions), rounded up to whole rows."""
    from moecompile.passes.capture import example_inputs

    (example,), kwargs = example_inputs(model)  # checks the model takes token ids; use_cache off
    if input_ids is None:
        if tokens < 1:
            raise MoECompileError(f"probe tokens must be >= 1, got {tokens}")
        config = model.config
        positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or 128
        seq = min(tokens, 128, positions)
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, config.vocab_size, (math.ceil(tokens / seq), seq), generator=gen)
    for _, block in moe_blocks(model):
        block.routing = None  # only this forward's statistics
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), track_routing(model):
            model(input_ids.to(example.device), **kwargs)
    finally:
        model.train(was_training)
    return routing_stats(model), input_ids.numel()
