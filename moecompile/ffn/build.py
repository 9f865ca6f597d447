"""An MoEBlock built from a dense FFN, and the checks of the knobs that build it.

Expert construction (`method`):
- "upcycle": every expert a copy of the dense FFN (optionally with noise). Exactly the dense output at init for
  any top_k when no token is dropped, since the renormalised top-k weights sum to 1.
- "split": the hidden neurons partitioned into `experts` balanced groups by k-means on the neurons' weights;
  every selected expert has weight 1 and the output bias is added once, so top_k = experts is exactly dense.
  The router starts at each group's mean input weight, a heuristic; calibrated routers are built elsewhere.
"""
from __future__ import annotations

import torch

from moecompile.ffn.kmeans import neuron_groups
from moecompile.ffn.match import DenseFFN
from moecompile.ir.block import MoEBlock
from moecompile.ir.config import MoEConfig
from moecompile.ir.knobs import check_experts, check_method, check_split, check_top_k

ROUTER_STD = 0.02  # upcycled routers: small, so every expert starts near an even share of the tokens


def ffn_seed(seed: int, index: int) -> int:
    """The seed of everything random about the FFN numbered `index` (in model order, as --layers counts): it depends
    on (seed, index) alone, not on which other FFNs are converted nor on the order they are written in."""
    return seed * 1_000_003 + index


def upcycle_router(seed: int, index: int, experts: int, hidden: int, std: float = ROUTER_STD) -> torch.Tensor:
    """The router weight [experts, hidden] (float32) of an upcycled FFN, normal(0, std): moeize and the streaming
    native upcycle both draw it here, so their outputs are bit-identical."""
    g = torch.Generator().manual_seed(ffn_seed(seed, index))
    return torch.randn((experts, hidden), generator=g, dtype=torch.float32) * std


def upcycle_copy(w: torch.Tensor, seed: int, index: int, proj: int, expert: int, noise: float) -> torch.Tensor:
    """Expert `expert`'s copy of the dense projection w [out, in] (proj: 0 the first or gate projection, 1 up,
    2 down) plus normal noise of noise * std(w), which breaks the symmetry between the copies; w itself at noise 0."""
    if noise <= 0:
        return w
    g = torch.Generator().manual_seed((ffn_seed(seed, index) * 3 + proj) * 4099 + expert + 1)
    wf = w.float()
    return (wf + torch.randn(wf.shape, generator=g) * (noise * wf.std())).to(w.dtype)


def block_config(ffn: DenseFFN, experts: int, top_k: int, capacity_factor: float, method: str,
                 groups: list[torch.Tensor] | None = None) -> MoEConfig:
    """The MoEConfig of the block build_block makes from this FFN: its shapes only, so the streaming split plans its
    output from a DenseFFN of meta tensors before reading any weight."""
    common = dict(hidden_size=ffn.hidden_size, num_experts=experts, top_k=top_k, capacity_factor=capacity_factor,
                  activation=ffn.match.activation, gated=ffn.match.gated, bias_in=ffn.b_in is not None,
                  dropout=ffn.dropout, method=method)
    if method == "upcycle":
        return MoEConfig(expert_size=ffn.intermediate_size, bias_out="expert" if ffn.b_out is not None else "none",
                         **common)
    # given groups may leave neurons out (a calibrated split's shared expert holds them)
    size = ffn.intermediate_size // experts if groups is None else len(groups[0])
    return MoEConfig(expert_size=size, bias_out="shared" if ffn.b_out is not None else "none", gate_weighting="unit",
                     **common)


def build_block(ffn: DenseFFN, experts: int, top_k: int, capacity_factor: float, method: str,
                noise: float = 0.0, seed: int = 0, groups: list[torch.Tensor] | None = None,
                index: int = 0) -> MoEBlock:
    """An MoEBlock equivalent to the dense FFN (at init, see the module docstring). `groups` (split only): the
    neuron indices of each expert, instead of the weight k-means (calibration passes co-activation groups).
    `index`: the FFN's number in the model, which with `seed` draws its router, noise and k-means (ffn_seed).
    The arguments are checked where they enter: check_options and check_ffns."""
    gated = ffn.match.gated
    h, i = ffn.hidden_size, ffn.intermediate_size
    config = block_config(ffn, experts, top_k, capacity_factor, method, groups)
    block = MoEBlock(config).to(dtype=ffn.w_in.dtype, device=ffn.w_in.device)
    if method == "upcycle":
        # the first projection's rows: (gate, up) when gated, else one projection
        parts = [(0, ffn.w_in[:i]), (1, ffn.w_in[i:])] if gated else [(0, ffn.w_in)]
        with torch.no_grad():
            ex = block.experts
            for e in range(experts):
                ex.w_in[e] = torch.cat([upcycle_copy(w, seed, index, proj, e, noise) for proj, w in parts])
                ex.w_out[e] = upcycle_copy(ffn.w_out, seed, index, 2, e, noise)
            if ex.b_in is not None:
                ex.b_in.copy_(ffn.b_in.expand_as(ex.b_in))
            if ex.b_out is not None:
                ex.b_out.copy_(ffn.b_out.expand_as(ex.b_out))
            block.router.weight.copy_(upcycle_router(seed, index, experts, h))
        return block
    if groups is None:
        groups = neuron_groups(ffn, experts, ffn_seed(seed, index))
    w_in = ffn.w_in.reshape(-1, i, h)  # [1 or 2 (gate, up), I, H]
    with torch.no_grad():
        ex = block.experts
        for e, idx in enumerate(groups):
            ex.w_in[e] = w_in[:, idx].reshape(-1, h)
            ex.w_out[e] = ffn.w_out[:, idx]
            if ex.b_in is not None:
                ex.b_in[e] = ffn.b_in.reshape(-1, i)[:, idx].reshape(-1)
            block.router.weight[e] = w_in[0, idx].float().mean(0)
        if block.bias is not None:
            block.bias.copy_(ffn.b_out)
    return block


def check_options(experts, top_k, method: str) -> None:
    """A conversion's knobs, checked where they enter (moeize() and the graph pass), before the model is captured."""
    check_experts(experts)
    check_top_k(top_k, experts)
    check_method(method)


def check_ffns(ffns: list[DenseFFN], experts: int, method: str) -> None:
    """What the chosen FFNs require of the knobs (a split divides each FFN evenly), checked before any is replaced."""
    if method == "split":
        for ffn in ffns:
            check_split(ffn.intermediate_size, experts, ffn.owner)
