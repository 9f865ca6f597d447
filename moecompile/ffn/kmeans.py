"""Balanced k-means over an FFN's neurons: the expert groups of a split."""
from __future__ import annotations

import torch

from moecompile.ffn.match import DenseFFN


def balanced_kmeans(features: torch.Tensor, clusters: int, iters: int = 10, seed: int = 0) -> torch.Tensor:
    """Assign rows to `clusters` equal-size groups by spherical k-means with a greedy balanced assignment.
    Returns the group index per row. Deterministic for a given seed."""
    n = features.shape[0]
    size = n // clusters
    x = features.to(torch.float32, copy=True)
    torch.nn.functional.normalize(x, dim=1, out=x)  # in place: one float32 copy of the features at a time
    gen = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(n, generator=gen)[:clusters]]
    assign = torch.empty(n, dtype=torch.long)
    for _ in range(iters):
        scores = x @ centroids.t()
        top2 = scores.topk(min(2, clusters), dim=1).values
        confidence = top2[:, 0] - (top2[:, 1] if clusters > 1 else 0)
        room = torch.full((clusters,), size, dtype=torch.long)
        for i in torch.argsort(confidence, descending=True, stable=True).tolist():
            e = int(torch.where(room > 0, scores[i], float("-inf")).argmax())
            assign[i] = e
            room[e] -= 1
        new = torch.stack([x[assign == e].mean(0) for e in range(clusters)])
        new = torch.nn.functional.normalize(new, dim=1)
        if torch.allclose(new, centroids):
            break
        centroids = new
    return assign


def neuron_groups(ffn: DenseFFN, experts: int, seed: int) -> list[torch.Tensor]:
    i = ffn.intermediate_size
    # per neuron: its gate|up rows, then its output column (the rows' copy is freed once concatenated)
    features = torch.cat([ffn.w_in.reshape(-1, i, ffn.hidden_size).permute(1, 0, 2).reshape(i, -1), ffn.w_out.t()],
                         dim=1)
    assign = balanced_kmeans(features, experts, seed=seed)
    return [torch.nonzero(assign == e).flatten() for e in range(experts)]
