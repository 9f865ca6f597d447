"""Calibrated neuron split (MoEfication-style): dense FFNs -> MoE blocks from their activations on real text.

Per FFN: shared expert, co-activation partition, least-squares router and compensation, layer-wise distillation;
then end-to-end distillation of all blocks. The recipe and its measurements: docs/calibrated-split.md and
bench/results/calibrated-split.md. The result is an ordinary MoEBlock, saved and reloaded by moecompile.save / load.
"""
from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from moecompile.calibration.config import CalibConfig
from moecompile.calibration.dense import chunks, ffn_output
from moecompile.calibration.distill import distill, train_router
from moecompile.calibration.e2e import Judge, distill_end_to_end
from moecompile.calibration.evaluate import relative_error
from moecompile.calibration.partition import contribution_features, partition_neurons, split_block, weight_features
from moecompile.calibration.router import fit_router_and_compensation
from moecompile.calibration.shared import fit_linear_shared
from moecompile.calibration.tokens import collect_ffn_inputs
from moecompile.core.errors import MoECompileError
from moecompile.ffn.layers import parse_layers
from moecompile.ffn.match import DenseFFN
from moecompile.ir import layout
from moecompile.ir.block import MoEBlock
from moecompile.ir.knobs import check_split
from moecompile.passes.find_ffn import find_dense_ffns

FIT_TOKENS = 40000  # at most about this many calibration tokens for the least-squares fits and error stats


def calibrated_block(ffn: DenseFFN, x: torch.Tensor, cfg: CalibConfig, seed: int,
                     progress: bool = True, desc: str = "", y: torch.Tensor | None = None) -> tuple[MoEBlock, dict]:
    """One FFN -> calibrated MoEBlock, and its numbers. y: the dense FFN's outputs on x if already known (computed
    here otherwise)."""
    x = x.float()
    if y is None:
        y = torch.cat([ffn_output(ffn, x[s]) for s in chunks(x.shape[0])])
    i = ffn.intermediate_size
    check_split(i, cfg.experts)
    size = i // cfg.experts
    routed_k = cfg.routed_k(cfg.top_k)
    features = weight_features(ffn) if cfg.partition == "weights" else contribution_features(ffn, x)
    shared = None
    rest = torch.arange(i, device=features.device)
    if cfg.shared_experts and cfg.shared_kind == "neurons":  # the most active neurons, always on
        shared = features.mean(1).topk(cfg.shared_experts * size).indices.sort().values
        keep = torch.ones(i, dtype=torch.bool, device=features.device)
        keep[shared] = False
        rest = rest[keep]
    groups = [rest[g.to(rest.device)]
              for g in partition_neurons(features[rest], cfg.routed_experts, cfg.partition, seed)]
    block = split_block(ffn, groups, shared, max(routed_k, 1), cfg.capacity_factor, cfg.compensation)
    # the least-squares fits and the error stats need far fewer tokens than distillation: an evenly spaced subset
    step = max(1, x.shape[0] // FIT_TOKENS)
    xs, ys = x[::step], y[::step]
    fit_router_and_compensation(block, xs, max(routed_k, 1), cfg.ridge)
    if cfg.shared_experts and cfg.shared_kind == "linear":
        block = fit_linear_shared(block, xs, ys, routed_k, cfg.shared_experts * size)
    if cfg.router_steps:
        train_router(block, x, cfg.router_steps, cfg.lr, cfg.batch_tokens, seed, progress, f"router {desc}")
    ks = tuple(cfg.routed_k(k) for k in (cfg.distill_top_k or (cfg.top_k,)))
    before = relative_error(block, xs, ys, max(routed_k, 1))
    distill(block, x, y, cfg.distill_steps, ks, cfg.lr, cfg.batch_tokens, seed, progress, f"distill {desc}",
            cfg.use_bf16(x.device))
    block.config.top_k = routed_k if routed_k > 0 else 1
    stats = {"groups": [g.tolist() for g in groups], "shared": shared.tolist() if shared is not None else [],
             "calib_relative_error_before_distill": before,
             "calib_relative_error": relative_error(block, xs, ys, routed_k)}
    return block.eval(), stats


def calibrate_model(model: nn.Module, batches: list[dict], cfg: CalibConfig, layers=None,
                    progress: bool = True, judge: Judge | None = None) -> list[dict]:
    """Replace the model's FFNs (those `layers` selects) by calibrated MoE blocks, in place; returns per-layer
    stats. FFN inputs (and, for `e2e_steps`, the dense last hidden states) come from one forward pass of the
    dense model over the calibration batches. `judge` (made from the dense model): held-out text the end-to-end
    stage is scored on (distill_end_to_end)."""
    model.eval()
    found, skipped = find_dense_ffns(model)
    if not found:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise MoECompileError(f"no FFN found in {type(model).__name__}{why}")
    chosen = [found[i] for i in parse_layers(layers, len(found))]
    targets = [] if cfg.e2e_steps else None
    # the FFN's output is its down projection's (BERT: output.dense) or its own module's: kept from the same pass
    out_path = {f.owner: f.identity[0] if f.identity else f.owner for f in chosen}
    inputs, outputs = collect_ffn_inputs(model, [f.owner for f in chosen], batches, progress, final=targets,
                                         outputs=tuple(out_path.values()))
    rows = []
    for n, ffn in enumerate(tqdm(chosen, desc="calibrate", unit="layer", disable=not progress)):
        x, y = inputs.pop(ffn.owner), outputs.pop(out_path[ffn.owner], None)
        if y is not None and (y.shape != x.shape or (y[:256] - (probe := ffn_output(ffn, x[:256]))).abs().max()
                              > 1e-4 * probe.abs().max()):
            y = None  # that module's output is more than the FFN's: calibrated_block computes it
        block, stats = calibrated_block(ffn, x, cfg, cfg.seed + n, progress, ffn.owner, y)
        model.set_submodule(ffn.owner, block)
        for path in ffn.identity:
            model.set_submodule(path, nn.Identity())
        layout.record(model, ffn.owner, block.config, ffn.identity)
        rows.append({"path": ffn.owner, **stats})
    if cfg.e2e_steps:
        distill_end_to_end(model, batches, targets, cfg.e2e_steps, cfg.e2e_lr, cfg.seed, progress,
                           cfg.use_bf16(next(model.parameters()).device), cfg.e2e_frozen_fraction, judge=judge)
        model.eval()
    return rows
