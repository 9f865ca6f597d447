"""Calibrated neuron split (MoEfication-style): dense FFN -> MoE block from activations on real text.

    moecompile convert MODEL --method split --calib stdlib --experts 16 --top-k 4 --shared-experts 1 \\
        --distill-steps 400

Per FFN, on the FFN inputs that calibration text produces in the dense model:
1. shared expert (optional): the neurons with the largest mean output contribution |a_i| * ||w_out[:, i]||
   become one always-on expert (CMoE); `top_k` counts it, so FLOPs stay top_k / experts of the dense FFN.
2. partition: the other neurons go into equal groups by co-activation, either balanced spherical k-means on
   each neuron's contribution pattern over the calibration tokens ("kmeans") or recursive Kernighan-Lin
   bisection of a k-nearest-neighbour co-activation graph ("graph", networkx); "random" and "weights"
   (k-means on the neurons' weights, the uncalibrated split) are the baselines.
3. compensation: each expert's mean output over the tokens that do not select it, added when it is skipped
   (G-MoEfication); zero at top_k = experts, so the split stays exact there.
4. router: least squares (ridge) from the FFN input to each expert's deviation from its compensation,
   ||out_e - comp_e||, i.e. the error its absence would cause (D2DMoE's norm predictor); softmax top-k of a
   linear predictor is top-k of the prediction. `router_steps` then trains it to rank experts by that target.
5. distillation (`distill_steps`): Adam on every block parameter (router through the straight-through unit
   gates, experts, shared expert, compensation) against the dense FFN's outputs on the calibration inputs,
   the top_k drawn per step from `distill_top_k` so one checkpoint serves several k.

The result is an ordinary MoEBlock (shared_expert_size, router_bias, compensation are MoEConfig options), saved
and reloaded by moecompile.save / load.
"""
from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from . import layout, ops
from .block import MoEBlock
from .config import MoEConfig
from .convert import DenseFFN, balanced_kmeans, build_block, find_dense_ffns, parse_layers
from .errors import MoECompileError
from .kernels.activations import expert_activation

log = logging.getLogger("moecompile")

PARTITIONS = ("kmeans", "graph", "random", "weights")


@dataclass
class CalibConfig:
    """How `calibrate` builds each block. top_k and distill_top_k count the shared experts too."""
    experts: int = 16  # expert-sized groups of neurons per FFN, shared ones included
    top_k: int = 4  # active experts per token, shared ones included
    shared_experts: int = 0  # how many of the experts are always on
    partition: str = "kmeans"
    compensation: bool = True
    router_steps: int = 0
    distill_steps: int = 0
    distill_top_k: tuple[int, ...] = ()  # top_k values drawn during distillation (default: (top_k,))
    lr: float = 1e-3
    batch_tokens: int = 1024
    ridge: float = 1e-3  # router least squares: relative ridge on the input covariance
    capacity_factor: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.partition not in PARTITIONS:
            raise MoECompileError(f"unknown partition {self.partition!r}; expected one of {', '.join(PARTITIONS)}")
        if not 0 <= self.shared_experts < self.experts:
            raise MoECompileError(f"shared experts must be between 0 and experts - 1 ({self.experts - 1}), "
                                  f"got {self.shared_experts}")
        if not self.shared_experts < self.top_k <= self.experts and not (
                self.shared_experts and self.top_k == self.shared_experts):
            raise MoECompileError(f"top_k must be between {max(self.shared_experts, 1)} and experts "
                                  f"({self.experts}) with {self.shared_experts} shared, got {self.top_k}")
        for k in self.distill_top_k:
            if not self.shared_experts < k <= self.experts:
                raise MoECompileError(f"distillation top_k {k} must be between {self.shared_experts + 1} and "
                                      f"{self.experts}")
        if self.router_steps < 0 or self.distill_steps < 0:
            raise MoECompileError("router and distillation steps must be >= 0")

    @property
    def routed_experts(self) -> int:
        return self.experts - self.shared_experts

    def routed_k(self, top_k: int) -> int:
        return top_k - self.shared_experts


# ------------------------------------------------------------------------------------------ the dense FFN


def ffn_hidden(ffn: DenseFFN, x: torch.Tensor) -> torch.Tensor:
    """The dense FFN's hidden activations [N, I] (gate * up for gated FFNs)."""
    h = F.linear(x, ffn.w_in.float(), ffn.b_in.float() if ffn.b_in is not None else None)
    return expert_activation(ffn.match.activation, ffn.match.gated, h)


def ffn_output(ffn: DenseFFN, x: torch.Tensor) -> torch.Tensor:
    return F.linear(ffn_hidden(ffn, x), ffn.w_out.float(), ffn.b_out.float() if ffn.b_out is not None else None)


def _chunks(n: int, size: int = 4096):
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


# ------------------------------------------------------------------------------------------ partitioning


def contribution_features(ffn: DenseFFN, x: torch.Tensor, max_tokens: int = 4096) -> torch.Tensor:
    """Per neuron, |a_i| * ||w_out[:, i]|| over (up to max_tokens evenly spaced) calibration tokens: [I, T]."""
    step = max(1, x.shape[0] // max_tokens)
    a = ffn_hidden(ffn, x[::step][:max_tokens])
    return (a.abs() * ffn.w_out.float().norm(dim=0)).t().contiguous()


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
        bisect(sorted(a), left, first)
        bisect(sorted(b), parts - left, first + left)

    bisect(list(range(n)), groups, 0)
    return assign


def partition_neurons(features: torch.Tensor, groups: int, method: str, seed: int = 0) -> list[torch.Tensor]:
    """Split rows (neurons) into `groups` equal groups; returns each group's sorted neuron indices."""
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


# ------------------------------------------------------------------------------------------ block building


def split_block(ffn: DenseFFN, groups: list[torch.Tensor], shared: torch.Tensor | None, top_k: int,
                capacity_factor: float, compensation: bool) -> MoEBlock:
    """An MoEBlock whose experts are the given neuron groups of ffn (and an always-on expert of `shared`
    neurons); exact at top_k = len(groups) while the compensation is zero."""
    base = build_block(ffn, len(groups), top_k, capacity_factor, "split", groups=groups)
    h = ffn.hidden_size
    config = MoEConfig(**{**base.config.to_dict(), "router_bias": True, "compensation": compensation,
                          "shared_expert_size": 0 if shared is None else len(shared)})
    block = MoEBlock(config).to(dtype=torch.float32)
    missing, unexpected = block.load_state_dict(base.state_dict(), strict=False)
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
    return block


@torch.no_grad()
def expert_outputs(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """Every routed expert's output on every token: [N, E, H] (no shared expert, compensation or bias)."""
    ex, c = block.experts, block.config
    h = torch.einsum("th,efh->tef", x, ex.w_in.float())
    if ex.b_in is not None:
        h = h + ex.b_in.float()
    out = torch.einsum("tei,ehi->teh", expert_activation(c.activation, c.gated, h), ex.w_out.float())
    if ex.b_out is not None:
        out = out + ex.b_out.float()
    return out


def _selection(logits: torch.Tensor, k: int) -> torch.Tensor:
    """0/1 [N, E]: the top-k experts by router logit."""
    return torch.zeros_like(logits).scatter(1, logits.topk(k, dim=1).indices, 1.0)


@torch.no_grad()
def fit_router_and_compensation(block: MoEBlock, x: torch.Tensor, top_k: int, ridge: float,
                                rounds: int = 2) -> None:
    """Least-squares router and conditional-mean compensation, alternated (each depends on the other):
    compensation[e] = mean output of expert e over tokens that skip it; router -> ||out_e - compensation[e]||."""
    e = block.config.num_experts
    n, h = x.shape
    x1 = torch.cat([x.float(), x.new_ones(n, 1)], 1)
    gram = x1.t() @ x1
    gram += ridge * gram.diagonal()[:-1].mean() * torch.eye(h + 1)  # relative ridge, none on the intercept
    target = torch.empty(n, e)
    sums = torch.zeros(e, h)
    counts = torch.zeros(e)
    logits = None
    for _ in range(rounds):
        comp = block.compensation.float() if block.compensation is not None else torch.zeros(e, h)
        sums.zero_()
        counts.zero_()
        for s in _chunks(n):
            out = expert_outputs(block, x[s])
            target[s] = (out - comp).norm(dim=-1)
            if logits is not None and block.compensation is not None:
                skipped = 1.0 - _selection(logits[s], top_k)
                sums += torch.einsum("te,teh->eh", skipped, out)
                counts += skipped.sum(0)
            elif block.compensation is not None:  # first round: plain mean
                sums += out.sum(0)
                counts += out.shape[0]
        if block.compensation is not None:
            block.compensation.copy_(sums / counts.clamp_min(1).unsqueeze(1))
            for s in _chunks(n):  # the target is the deviation from the compensation just fitted
                target[s] = (expert_outputs(block, x[s]) - block.compensation.float()).norm(dim=-1)
        w = torch.linalg.solve(gram, x1.t() @ target)
        block.router.weight.copy_(w[:h].t())
        block.router.bias.copy_(w[h])
        logits = block.router_logits(x)


def masked_forward(block: MoEBlock, x: torch.Tensor, top_k: int) -> torch.Tensor:
    """MoEBlock.forward (dropless, eval) computed densely: every expert on every token, masked by the routing
    weights. The same function as the block's (a test checks it), 4-8x faster to train on CPU than the grouped
    reference kernels."""
    c, ex = block.config, block.experts
    e = c.num_experts
    n = x.shape[0]
    out = block._shared_out(x)
    if top_k > 0:
        weights, ids = ops.route(block.router_logits(x), top_k, 0.0, c.renormalize)
        if c.gate_weighting == "unit":
            weights = torch.where(ids < e, weights - weights.detach() + 1.0, 0.0)
        mask = x.new_zeros(n, e + 1).scatter(1, ids, weights.to(x.dtype))[:, :e]
        h = torch.einsum("th,efh->tef", x, ex.w_in)
        if ex.b_in is not None:
            h = h + ex.b_in
        a = expert_activation(c.activation, c.gated, h) * mask.unsqueeze(-1)
        out = out + torch.einsum("tei,ehi->th", a, ex.w_out)
        if ex.b_out is not None:
            out = out + mask @ ex.b_out
        out = out + block._compensation_out(x, ids)
    else:
        out = out + block._compensation_out(x, None)
    if block.bias is not None:
        out = out + block.bias
    return out


def _token_weights(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token loss weights: the error relative to the token's residual-stream scale, so that a few tokens with
    huge FFN outputs (BERT's [CLS] in layer 0) do not drown the rest."""
    return 1.0 / (y.float().pow(2).sum(1) + x.float().pow(2).sum(1)).clamp_min(1e-6)


def relative_error(block: MoEBlock, ffn_x: torch.Tensor, y: torch.Tensor, top_k: int) -> float:
    """||block(x) - y|| / ||y|| over all tokens, computed with the block's own forward."""
    with torch.no_grad():
        num = den = 0.0
        for s in _chunks(ffn_x.shape[0]):
            out = block(ffn_x[s], top_k=top_k)
            num += (out.float() - y[s]).pow(2).sum().item()
            den += y[s].pow(2).sum().item()
    return math.sqrt(num / max(den, 1e-30))


def train_router(block: MoEBlock, x: torch.Tensor, steps: int, lr: float, batch: int, seed: int,
                 progress: bool = True, desc: str = "router") -> float:
    """Train the router alone to rank experts by the error their absence causes: cross-entropy between the
    router's softmax and softmax(target / T), target = ||out_e - compensation[e]||, T its mean spread."""
    if steps <= 0:
        return float("nan")
    params = [p for p in block.router.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    comp = block.compensation.detach().float() if block.compensation is not None else 0.0
    loss = torch.zeros(())
    for _ in tqdm(range(steps), desc=desc, unit="step", disable=not progress, leave=False):
        idx = torch.randint(x.shape[0], (min(batch, x.shape[0]),), generator=gen)
        xb = x[idx]
        target = (expert_outputs(block, xb) - comp).norm(dim=-1)
        temp = target.std(dim=1, keepdim=True).clamp_min(1e-6)
        loss = torch.sum(-torch.softmax(target / temp, 1) * torch.log_softmax(block.router_logits(xb), 1), 1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss)


def distill(block: MoEBlock, x: torch.Tensor, y: torch.Tensor, steps: int, top_ks: tuple[int, ...], lr: float,
            batch: int, seed: int, progress: bool = True, desc: str = "distill") -> float:
    """Adam on every parameter of the block against the dense outputs y, top_k cycling through top_ks."""
    if steps <= 0:
        return float("nan")
    block.train()
    weights = _token_weights(x, y)
    opt = torch.optim.Adam(block.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for step in tqdm(range(steps), desc=desc, unit="step", disable=not progress, leave=False):
        idx = torch.randint(x.shape[0], (min(batch, x.shape[0]),), generator=gen)
        out = masked_forward(block, x[idx], top_ks[step % len(top_ks)])
        loss = ((out - y[idx]).pow(2).sum(1) * weights[idx]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    block.eval()
    return float(loss)


def with_config(block: MoEBlock, **changes) -> MoEBlock:
    """A copy of block with config fields changed; parameters that keep their shapes are carried over."""
    new = MoEBlock(MoEConfig(**{**block.config.to_dict(), **changes})).to(dtype=torch.float32)
    own = new.state_dict()
    new.load_state_dict({k: v for k, v in block.state_dict().items() if k in own and own[k].shape == v.shape},
                        strict=False)
    return new.eval()


@torch.no_grad()
def fit_linear_shared(block: MoEBlock, x: torch.Tensor, y: torch.Tensor, top_k: int, rank: int) -> MoEBlock:
    """Give the block an always-on linear expert of `rank` (2 * rank * H multiply-adds, as many as `rank`
    neurons): reduced-rank least squares of what the routed top_k experts miss, y - block(x). Most of a GELU
    FFN's output is linear in its input; the top-k experts keep the nonlinear part of the selected neurons."""
    n, h = x.shape
    residual = torch.empty(n, h)
    for s in _chunks(n):
        residual[s] = y[s] - block(x[s], top_k=top_k).float()
    x_mean, r_mean = x.float().mean(0), residual.mean(0)
    xc = x.float() - x_mean
    gram = xc.t() @ xc
    gram += 1e-6 * gram.diagonal().mean() * torch.eye(h)
    coef = torch.linalg.solve(gram, xc.t() @ (residual - r_mean))  # [H, H]: full-rank fit
    _, _, vh = torch.linalg.svd(xc @ coef, full_matrices=False)  # principal directions of the fitted values
    v = vh[:rank]  # [r, H]
    # the intercept goes to the block's output bias (made if the dense FFN had none)
    new = with_config(block, shared_expert_size=rank, shared_linear=True, bias_out="shared")
    new.shared.w_in[0] = (coef @ v.t()).t()  # x -> r coordinates
    new.shared.w_out[0] = v.t()  # back to H
    if new.shared.b_in is not None:
        new.shared.b_in.zero_()
    new.bias += r_mean - x_mean @ coef @ v.t() @ v
    return new
