"""Grouping an FFN's neurons into experts, and the MoE block those groups make."""
from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from moecompile.calibration.dense import ffn_hidden
from moecompile.core.errors import MoECompileError
from moecompile.ffn.build import build_block
from moecompile.ffn.kmeans import balanced_kmeans
from moecompile.ffn.match import DenseFFN
from moecompile.ir.block import MoEBlock
from moecompile.ir.config import MoEConfig


def contribution_features(ffn: DenseFFN, x: torch.Tensor, max_tokens: int = 4096) -> torch.Tensor:
    """Per neuron, |a_i| * ||w_out[:, i]|| over (up to max_tokens evenly spaced) calibration tokens: [I, T]."""
    step = max(1, x.shape[0] // max_tokens)
    a = ffn_hidden(ffn, x[::step][:max_tokens])
    return (a.abs() * ffn.w_out.float().norm(dim=0)).t().contiguous()


def weight_features(ffn: DenseFFN) -> torch.Tensor:
    """Per neuron, its input and output weights side by side: [I, in + H] (the uncalibrated split's features)."""
    i = ffn.intermediate_size
    rows = ffn.w_in.reshape(-1, i, ffn.hidden_size).permute(1, 0, 2).reshape(i, -1)
    return torch.cat([rows, ffn.w_out.t()], dim=1).float()


def _graph_partition(features: torch.Tensor, groups: int, seed: int, neighbours: int = 16) -> torch.Tensor:
    """Balanced partition of a k-nearest-neighbour co-activation graph by recursive Kernighan-Lin bisection
    (networkx); KL swaps pairs, so every part keeps the size it starts with."""
    import networkx as nx

    n = features.shape[0]
    z = F.normalize(features.float(), dim=1)
    sim = z @ z.t()
    sim.fill_diagonal_(-math.inf)
    top = sim.topk(min(neighbours, n - 1), dim=1) if n > 1 else None
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    if top is not None:
        for i, (js, ws) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
            graph.add_edges_from((i, j, {"weight": max(w, 0.0)}) for j, w in zip(js, ws))
    assign = torch.empty(n, dtype=torch.long)
    rng = random.Random(seed)

    def bisect(nodes: list[int], parts: int, first: int) -> None:
        if parts == 1:
            assign[nodes] = first
            return
        left = parts // 2
        cut = len(nodes) * left // parts
        order = sorted(nodes)
        rng.shuffle(order)
        a, b = nx.algorithms.community.kernighan_lin_bisection(
            graph.subgraph(order), partition=(set(order[:cut]), set(order[cut:])), weight="weight",
            seed=rng.randrange(2**31))
        if len(a) != cut:  # networkx may hand the two sides back in either order; the sizes tell them apart
            a, b = b, a
        bisect(sorted(a), left, first)
        bisect(sorted(b), parts - left, first + left)

    bisect(list(range(n)), groups, 0)
    return assign


def partition_neurons(features: torch.Tensor, groups: int, method: str, seed: int = 0) -> list[torch.Tensor]:
    """Split rows (neurons) into `groups` equal groups; returns each group's sorted neuron indices."""
    features = features.cpu()  # sequential bookkeeping (greedy assignment, networkx): on the CPU
    n = features.shape[0]
    if n % groups:
        raise MoECompileError(f"cannot split {n} neurons into {groups} equal experts")
    if method == "random":
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        return [g.sort().values for g in perm.reshape(groups, -1)]
    if method == "graph":
        assign = _graph_partition(features, groups, seed)
    else:  # kmeans, weights: spherical k-means with a balanced assignment
        assign = balanced_kmeans(features, groups, iters=20, seed=seed)
    return [torch.nonzero(assign == g).flatten() for g in range(groups)]


def split_block(ffn: DenseFFN, groups: list[torch.Tensor], shared: torch.Tensor | None, top_k: int,
                capacity_factor: float, compensation: bool) -> MoEBlock:
    """An MoEBlock whose experts are the given neuron groups of ffn (and an always-on expert of `shared`
    neurons); exact at top_k = len(groups) while the compensation is zero."""
    base = build_block(ffn, len(groups), top_k, capacity_factor, "split", groups=groups)
    h = ffn.hidden_size
    config = MoEConfig(**{**base.config.to_dict(), "router_bias": True, "compensation": compensation,
                          "shared_expert_size": 0 if shared is None else len(shared)})
    block = MoEBlock(config).to(dtype=torch.float32, device=ffn.w_in.device)
    _, unexpected = block.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected, unexpected
    if shared is not None:
        w_in = ffn.w_in.reshape(-1, ffn.intermediate_size, h)
        with torch.no_grad():
            block.shared.w_in[0] = w_in[:, shared].reshape(-1, h)
            block.shared.w_out[0] = ffn.w_out[:, shared]
            if block.shared.b_in is not None:
                block.shared.b_in[0] = ffn.b_in.reshape(-1, ffn.intermediate_size)[:, shared].reshape(-1)
    with torch.no_grad():
        block.router.weight.zero_()
        block.router.bias.zero_()
    return block.eval()
