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
6. end-to-end distillation (`e2e_steps`), after every FFN is converted: Adam on all blocks at once (but the
   first `e2e_frozen_fraction` of them) against the dense model's last hidden state on the calibration sentences,
   loss (1 - cosine of the mean-pooled states) + (1 - mean per-token cosine), i.e. the quality metric itself; it
   corrects the error that layer-wise distillation lets compound through the layers. The model layers in front
   of the first trained block run once per calibration batch; later steps on that batch reuse their output.
Both distillation stages run their MoE blocks under bfloat16 autocast where bf16 is native (`native_bf16`; `bf16`
forces it on or off); the compensation / router fits and the error stats use at most ~FIT_TOKENS tokens.

The result is an ordinary MoEBlock (shared_expert_size, router_bias, compensation are MoEConfig options), saved
and reloaded by moecompile.save / load.
"""
from __future__ import annotations

import functools
import logging
import math
import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from moecompile.ir import layout
from moecompile.ir import ops
from moecompile.ir.block import MoEBlock
from moecompile.ir.config import MoEConfig
from moecompile.conversion.moeize import DenseFFN, balanced_kmeans, build_block, find_dense_ffns, parse_layers
from moecompile.errors import MoECompileError
from moecompile.ir.activations import expert_activation

log = logging.getLogger("moecompile")

PARTITIONS = ("kmeans", "graph", "random", "weights")
FIT_TOKENS = 40000  # at most about this many calibration tokens for the least-squares fits and error stats
_ADAM = {"fused": True}  # one Adam kernel for all parameters (measured on CPU: 0-5% faster end-to-end steps)


@dataclass
class CalibConfig:
    """How `calibrate` builds each block. top_k and distill_top_k count the shared experts too."""
    experts: int = 16  # expert-sized groups of neurons per FFN, shared ones included
    top_k: int = 4  # active experts per token, shared ones included
    shared_experts: int = 0  # always-on expert-equivalents (top_k counts them)
    shared_kind: str = "neurons"  # "neurons": the most active neurons; "linear": a linear map of that rank
    partition: str = "kmeans"
    compensation: bool = True
    router_steps: int = 0
    distill_steps: int = 0
    distill_top_k: tuple[int, ...] = ()  # top_k values drawn during distillation (default: (top_k,))
    lr: float = 1e-3
    batch_tokens: int = 1024
    ridge: float = 1e-3  # router least squares: relative ridge on the input covariance
    e2e_steps: int = 0  # end-to-end steps (one calibration batch of sentences each) after the layer-wise stage
    e2e_lr: float = 3e-4
    e2e_frozen_fraction: float = 1 / 3  # the end-to-end stage leaves the first third of the blocks as they are
    bf16: bool | None = None  # distillation matmuls in bfloat16 autocast (weights and losses stay float32);
    # None: where bfloat16 is native (native_bf16)
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
        if self.shared_kind not in ("neurons", "linear"):
            raise MoECompileError(f"shared_kind must be 'neurons' or 'linear', got {self.shared_kind!r}")
        if self.router_steps < 0 or self.distill_steps < 0 or self.e2e_steps < 0:
            raise MoECompileError("router and distillation steps must be >= 0")
        if not 0 <= self.e2e_frozen_fraction < 1:
            raise MoECompileError(f"e2e_frozen_fraction must be in [0, 1), got {self.e2e_frozen_fraction}")

    def use_bf16(self, device: torch.device) -> bool:
        """Whether the distillation stages run under bfloat16 autocast on device (`bf16`, or where it is native)."""
        return native_bf16(device) if self.bf16 is None else self.bf16

    @property
    def routed_experts(self) -> int:  # a linear shared expert takes no neurons away from the routed ones
        return self.experts - (self.shared_experts if self.shared_kind == "neurons" else 0)

    def routed_k(self, top_k: int) -> int:
        return top_k - self.shared_experts


def default_shared_experts(top_k: int) -> int:
    """The recipe's shared experts for a top_k (measured on MiniLM, bench/results/calibrated-split.md): half of
    the active experts always on, but at most 2 routed beyond top_k 4 (2 at top_k 4, 6 at top_k 8, where 4 gave
    0.979 and 6 gave 0.980; 1 at top_k 2 or 3, none at top_k 1)."""
    return max(top_k // 2, top_k - 2)


def native_bf16(device: torch.device) -> bool:
    """Whether bfloat16 matmuls are native here (CUDA with bf16, a CPU with AVX512-BF16 or AMX), i.e. faster than
    float32: there the distillation stages run under bfloat16 autocast (measured on a 2-core AMX CPU: layer-wise
    steps 1.55x faster, end-to-end steps 1.3x, the same quality)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and any(getattr(torch.cpu, name, lambda: False)()
                                        for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


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
        if len(a) != cut:  # networkx may hand the two sides back in either order; the sizes tell them apart
            a, b = b, a
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
    return block.eval()


@torch.no_grad()
def expert_activations(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """Every routed expert's hidden activations on every token: [N, E, I]."""
    ex, c = block.experts, block.config
    h = torch.einsum("th,efh->tef", x, ex.w_in.float())
    if ex.b_in is not None:
        h = h + ex.b_in.float()
    return expert_activation(c.activation, c.gated, h)


@torch.no_grad()
def expert_outputs(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """Every routed expert's output on every token: [N, E, H] (no shared expert, compensation or bias)."""
    ex = block.experts
    out = torch.einsum("tei,ehi->teh", expert_activations(block, x), ex.w_out.float())
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
    compensation[e] = mean output of expert e over tokens that skip it; router -> ||out_e - compensation[e]||.
    Computed from the experts' activations a_e [I] rather than their outputs w_out_e a_e + b_out_e [H]: with
    w_out_e = Q_e R_e, ||out_e - c|| = ||(R_e a_e + Q_e^T d) , (I - Q_e Q_e^T) d|| for d = b_out_e - c, so
    the fits never build the [N, E, H] outputs (4x smaller products and memory at MiniLM's H = 4 I)."""
    e = block.config.num_experts
    n, h = x.shape
    x1 = torch.cat([x.float(), x.new_ones(n, 1)], 1)
    gram = x1.t() @ x1
    gram += ridge * gram.diagonal()[:-1].mean() * torch.eye(h + 1)  # relative ridge, none on the intercept
    a = torch.cat([expert_activations(block, x[s]) for s in _chunks(n, 1024)])  # [N, E, I]
    w_out = block.experts.w_out.float()  # [E, H, I]
    b_out = block.experts.b_out.float() if block.experts.b_out is not None else torch.zeros(e, h)
    q, r = torch.linalg.qr(w_out)  # [E, H, K], [E, K, I]
    ra = torch.einsum("eki,tei->tek", r, a)
    logits = None
    for _ in range(rounds):
        if block.compensation is not None:
            if logits is None:  # first round: plain mean
                sums, counts = a.sum(0), torch.full((e,), float(n))
            else:
                skipped = 1.0 - _selection(logits, top_k)
                sums, counts = torch.einsum("te,tei->ei", skipped, a), skipped.sum(0)
            mean_a = sums / counts.clamp_min(1).unsqueeze(1)
            block.compensation.copy_(torch.einsum("ehi,ei->eh", w_out, mean_a)
                                     + b_out * (counts > 0).unsqueeze(1))
        d = b_out - (block.compensation.float() if block.compensation is not None else 0.0)  # [E, H]
        qd = torch.einsum("ehk,eh->ek", q, d)
        outside = (d - torch.einsum("ehk,ek->eh", q, qd)).pow(2).sum(1)  # the part of d w_out_e cannot reach
        target = torch.empty(n, e)
        for s in _chunks(n):
            target[s] = ((ra[s] + qd).pow(2).sum(-1) + outside).sqrt()
        w = torch.linalg.solve(gram, x1.t() @ target)
        block.router.weight.copy_(w[:h].t())
        block.router.bias.copy_(w[h])
        logits = block.router_logits(x)


def masked_forward(block: MoEBlock, x: torch.Tensor, top_k: int, routed=None) -> torch.Tensor:
    """MoEBlock.forward (dropless, eval) as distillation trains it: the same function as the block's (a test checks
    it), 4-8x faster to train on CPU than the grouped reference kernels. `routed` runs the routed experts; by
    default, at most a quarter of the experts per token: each expert's tokens gathered and run alone
    (_routed_sparse); more: every expert on every token, masked by the routing weights (_routed_dense)."""
    c = block.config
    e = c.num_experts
    out = block._shared_out(x)
    if top_k > 0:
        weights, ids = ops.route(block.router_logits(x), top_k, 0.0, c.renormalize)
        if c.gate_weighting == "unit":
            weights = torch.where(ids < e, weights - weights.detach() + 1.0, 0.0)
        routed = routed or (_routed_sparse if 4 * top_k <= e else _routed_dense)
        out = routed(block, x, weights, ids, out)
        out = out + block._compensation_out(x, ids)
    else:
        out = out + block._compensation_out(x, None)
    if block.bias is not None:
        out = out + block.bias
    return out


def _routed_dense(block: MoEBlock, x, weights, ids, out):
    """out + the routed experts' weighted outputs, every expert computed on every token and masked."""
    c, ex = block.config, block.experts
    mask = x.new_zeros(x.shape[0], c.num_experts + 1).scatter(1, ids, weights.to(x.dtype))[:, :c.num_experts]
    h = torch.einsum("th,efh->tef", x, ex.w_in)
    if ex.b_in is not None:
        h = h + ex.b_in
    a = expert_activation(c.activation, c.gated, h) * mask.unsqueeze(-1)
    out = out + torch.einsum("tei,ehi->th", a, ex.w_out)
    if ex.b_out is not None:
        out = out + mask @ ex.b_out
    return out


def _routed_sparse(block: MoEBlock, x, weights, ids, out):
    """_routed_dense computing only the chosen experts: tokens sorted by expert, one matmul pair per expert. A
    layer-wise step of MiniLM's recipes on a 2-core AVX2 CPU (bench/distill_step_time.py): 2 of 10 routed experts
    (top_k 8) 45 -> 29 ms, 2 of 14 (top_k 4) 52 -> 21 ms; at 5 of 10 no faster than dense (49 ms both)."""
    c, ex = block.config, block.experts
    top_k = ids.shape[1]
    order = torch.argsort(ids.reshape(-1), stable=True)
    counts = torch.bincount(ids.reshape(-1), minlength=c.num_experts + 1)[:c.num_experts].tolist()
    kept = order[:sum(counts)]  # (dropped assignments, id E, sort last)
    tokens = kept // top_k
    rows = x.index_select(0, tokens).split(counts)
    outs = []
    for e, xe in enumerate(rows):
        if xe.shape[0]:
            h = F.linear(xe, ex.w_in[e], ex.b_in[e] if ex.b_in is not None else None)
            outs.append(F.linear(expert_activation(c.activation, c.gated, h), ex.w_out[e],
                                 ex.b_out[e] if ex.b_out is not None else None))
    if not outs:
        return out
    y = torch.cat(outs) * weights.reshape(-1).index_select(0, kept).unsqueeze(-1).to(outs[0].dtype)
    return out.index_add(0, tokens, y.to(out.dtype))


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
    opt = torch.optim.Adam(params, lr=lr, **_ADAM)
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
    return float(loss.detach())


def _one_cycle(opt: torch.optim.Optimizer, lr: float, steps: int):
    """One-cycle learning rate, 10% warm-up (15% at exactly 10 steps, where OneCycleLR's warm-up would end at step 0
    and it divides by zero)."""
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.15 if steps == 10
                                               else 0.1)


def distill(block: MoEBlock, x: torch.Tensor, y: torch.Tensor, steps: int, top_ks: tuple[int, ...], lr: float,
            batch: int, seed: int, progress: bool = True, desc: str = "distill", bf16: bool = False) -> float:
    """Adam on every parameter of the block against the dense outputs y, top_k cycling through top_ks."""
    if steps <= 0:
        return float("nan")
    weights = _token_weights(x, y)  # the block stays in eval mode: masked_forward has no dropout or jitter
    opt = torch.optim.Adam(block.parameters(), lr=lr, **_ADAM)
    sched = _one_cycle(opt, lr, steps)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for step in tqdm(range(steps), desc=desc, unit="step", disable=not progress, leave=False):
        idx = torch.randint(x.shape[0], (min(batch, x.shape[0]),), generator=gen)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            out = masked_forward(block, x[idx], top_ks[step % len(top_ks)])
        loss = ((out.float() - y[idx]).pow(2).sum(1) * weights[idx]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return float(loss.detach())


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


# ------------------------------------------------------------------------------------------ whole model


class ByteTokenizer:
    """Fallback for models without tokenizer files (--random-init configs): UTF-8 bytes modulo the vocabulary."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, texts: list[str], max_length: int) -> dict:
        rows = [[b % self.vocab_size for b in t.encode()[:max_length]] or [0] for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return {"input_ids": ids, "attention_mask": mask}


def load_tokenizer(directory, model: nn.Module):
    if directory is not None:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(directory)
            return lambda texts, max_length: dict(tok(texts, padding=True, truncation=True, max_length=max_length,
                                                      return_tensors="pt"))
        except Exception:  # noqa: BLE001 - no tokenizer files: fall back below
            pass
    log.warning("no tokenizer for this model: calibrating on UTF-8 bytes as token ids")
    return ByteTokenizer(model.config.vocab_size)


def token_batches(tokenize, texts: list[str], tokens: int, max_length: int = 128, batch: int = 32,
                  seed: int = 0) -> list[dict]:
    """Batches holding about `tokens` real tokens from texts (shuffled with seed), grouped by length so that
    little compute goes to padding."""
    order = list(texts)
    random.Random(seed).shuffle(order)
    chosen, count = [], 0
    for start in range(0, len(order), 256):
        part = order[start:start + 256]
        lengths = tokenize(part, max_length)["attention_mask"].sum(1).tolist()
        for text, n in zip(part, lengths):
            chosen.append((n, text))
            count += n
            if count >= tokens:
                break
        if count >= tokens:
            break
    chosen.sort(key=lambda p: p[0])
    texts = [t for _, t in chosen]
    return [tokenize(texts[i:i + batch], max_length) for i in range(0, len(texts), batch)]


def _model_kwargs(model: nn.Module, enc: dict) -> dict:
    kwargs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    if "use_cache" in getattr(model.forward, "__code__", type("", (), {"co_varnames": ()})).co_varnames:
        kwargs["use_cache"] = False
    return kwargs


def _last_hidden(model: nn.Module, enc: dict) -> torch.Tensor:
    """The model's last hidden state [B, T, H] (after a decoder's final norm)."""
    return model(**_model_kwargs(model, enc), output_hidden_states=True).hidden_states[-1].float()


@torch.no_grad()
def collect_ffn_inputs(model: nn.Module, owners: list[str], batches: list[dict], progress: bool = True,
                       final: list | None = None, outputs: tuple[str, ...] = ()):
    """The input of each FFN module (real tokens only, padding dropped) over the batches: {owner: [N, H]}; the
    model's last hidden state per batch is appended to `final` if given. With `outputs` (module paths), also the
    tensor output of those modules: ({owner: [N, H]}, {path: [N, H]}) (a path missing from the second dict gave
    no tensor). Each is written into one preallocated float32 buffer (no concatenation: half the peak memory)."""
    total = sum(int(enc["attention_mask"].sum()) for enc in batches)
    store: dict[tuple[str, str], torch.Tensor] = {}
    at = {"row": 0, "mask": None}

    def keep(key, t):
        if not isinstance(t, torch.Tensor):
            return
        t = t[at["mask"]]
        if key not in store:
            store[key] = torch.empty(total, t.shape[-1])
        store[key][at["row"]:at["row"] + t.shape[0]] = t

    hooks = [model.get_submodule(o).register_forward_pre_hook(lambda m, args, o=o: keep((o, "in"), args[0]))
             for o in owners]
    hooks += [model.get_submodule(p).register_forward_hook(lambda m, args, out, p=p: keep((p, "out"), out))
              for p in outputs]
    try:
        for enc in tqdm(batches, desc="calibration forward", unit="batch", disable=not progress):
            at["mask"] = enc["attention_mask"].bool()
            if final is None:
                model(**_model_kwargs(model, enc))
            else:
                final.append(_last_hidden(model, enc))
            at["row"] += int(at["mask"].sum())
    finally:
        for h in hooks:
            h.remove()
    inputs = {o: store[(o, "in")] for o in owners}
    return (inputs, {p: store[(p, "out")] for p in outputs if (p, "out") in store}) if outputs else inputs


def _embedding_loss(h: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(1 - cosine of mean-pooled states) + (1 - mean per-token cosine) over the real tokens."""
    m = mask.unsqueeze(-1).float()
    pooled = F.cosine_similarity((h * m).sum(1), (target * m).sum(1), dim=-1).mean()
    tokens = F.cosine_similarity(h[mask], target[mask], dim=-1).mean()
    return 2.0 - pooled - tokens


def _frozen_layers(model: nn.Module, trained: MoEBlock, frozen: list[MoEBlock]) -> list[nn.Module]:
    """The layers (items of the model's layer list) in front of the one holding `trained`, if they hold all the
    `frozen` blocks: nothing in them changes while the blocks after them train; [] if there is no such list."""
    path = next(n for n, m in model.named_modules() if m is trained)
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and path.startswith(n + ".")]
    if not lists:
        return []
    name, layer_list = max(lists, key=lambda nm: len(nm[0]))
    index = int(path[len(name) + 1:].split(".")[0])
    layers = list(layer_list)[:index]
    inside = {id(m) for layer in layers for m in layer.modules()}
    return layers if layers and all(id(b) in inside for b in frozen) else []


class _FrozenPrefix:
    """Skips the frozen first layers in end-to-end distillation: the first step on a batch runs them (without
    autograd) and keeps the last one's output, later steps on that batch return it from every frozen layer (the
    next layer only sees the last one's). Same numbers as running them; on MiniLM with 2 of its 6 layers frozen,
    0.245 -> 0.219 s per step when 3 of 4 steps draw a batch seen before (bench/e2e_step_time.py, 2-core AVX2 CPU,
    float32)."""

    def __init__(self, layers: list[nn.Module]):
        self.layers, self.cache, self.batch = layers, {}, None
        self.saved = [layer.__dict__.get("forward") for layer in layers]
        for layer in layers:
            layer.forward = functools.partial(self._forward, layer, layer.forward)

    def _forward(self, layer, forward, *args, **kwargs):
        if self.batch in self.cache:
            return self.cache[self.batch]
        with torch.no_grad():
            out = forward(*args, **kwargs)
        if layer is self.layers[-1]:
            self.cache[self.batch] = torch.utils._pytree.tree_map(
                lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
        return out

    def restore(self):
        for layer, forward in zip(self.layers, self.saved):
            del layer.forward
            if forward is not None:
                layer.forward = forward


def distill_end_to_end(model: nn.Module, batches: list[dict], targets: list[torch.Tensor], steps: int, lr: float,
                       seed: int, progress: bool = True, bf16: bool = False, frozen_fraction: float = 0.0,
                       cache_frozen: bool = True) -> float:
    """Adam on the parameters of the MoEBlocks at once (the rest of the model frozen, and the first
    `frozen_fraction` of the blocks in model order) so the converted model's last hidden state matches the dense
    model's (`targets`, one per batch); one random batch per step. `cache_frozen`: the layers in front of the
    first trained block run once per batch (_FrozenPrefix)."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if steps <= 0 or not blocks or not batches:
        return float("nan")
    frozen = {p: p.requires_grad for p in model.parameters()}
    # the first blocks keep their layer-wise result: the backward pass stops above them (measured on MiniLM, a third
    # of the blocks: 10% faster steps for -0.0004 mean cosine, bench/results/calibrated-split.md)
    first = int(len(blocks) * frozen_fraction)
    params = [p for b in blocks[first:] for p in b.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)

    def forward(b, x, top_k=None, capacity_factor=None):
        # the dense masked computation: same function, several times faster to train on CPU; bfloat16 autocast on
        # the blocks only (measured: 23% faster steps; autocast over the whole model was no faster than float32)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            return masked_forward(b, x.reshape(-1, x.shape[-1]), b.config.top_k).reshape(x.shape).to(x.dtype)

    for b in blocks:
        b.forward = functools.partial(forward, b)
    layers = _frozen_layers(model, blocks[first], blocks[:first]) if cache_frozen and 0 < first < len(blocks) else []
    prefix = _FrozenPrefix(layers) if layers else None
    opt = torch.optim.Adam(params, lr=lr, **_ADAM)
    sched = _one_cycle(opt, lr, steps)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    try:
        for _ in tqdm(range(steps), desc="end-to-end distill", unit="step", disable=not progress):
            i = int(torch.randint(len(batches), (1,), generator=gen))
            if prefix is not None:
                prefix.batch = i
            loss = _embedding_loss(_last_hidden(model, batches[i]), targets[i], batches[i]["attention_mask"].bool())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    finally:
        if prefix is not None:
            prefix.restore()
        for b in blocks:
            del b.forward
        for p, flag in frozen.items():
            p.requires_grad_(flag)
    return float(loss.detach())


def calibrated_block(ffn: DenseFFN, x: torch.Tensor, cfg: CalibConfig, seed: int,
                     progress: bool = True, desc: str = "", y: torch.Tensor | None = None) -> tuple[MoEBlock, dict]:
    """One FFN -> calibrated MoEBlock (see the module docstring), and its numbers. y: the dense FFN's outputs on
    x if already known (computed here otherwise)."""
    x = x.float()
    if y is None:
        y = torch.cat([ffn_output(ffn, x[s]) for s in _chunks(x.shape[0])])
    i = ffn.intermediate_size
    if i % cfg.experts:
        raise MoECompileError(f"split needs experts to divide the FFN size: {i} neurons into {cfg.experts} experts")
    size = i // cfg.experts
    routed_k = cfg.routed_k(cfg.top_k)
    if cfg.partition == "weights":
        rows = ffn.w_in.reshape(-1, i, ffn.hidden_size).permute(1, 0, 2).reshape(i, -1)
        features = torch.cat([rows, ffn.w_out.t()], dim=1).float()
    else:
        features = contribution_features(ffn, x)
    shared = None
    rest = torch.arange(i)
    if cfg.shared_experts and cfg.shared_kind == "neurons":  # the most active neurons, always on
        shared = features.mean(1).topk(cfg.shared_experts * size).indices.sort().values
        keep = torch.ones(i, dtype=torch.bool)
        keep[shared] = False
        rest = rest[keep]
    groups = [rest[g] for g in partition_neurons(features[rest], cfg.routed_experts, cfg.partition, seed)]
    block = split_block(ffn, groups, shared, max(routed_k, 1), cfg.capacity_factor, cfg.compensation)
    # the least-squares fits and the error stats need far fewer tokens than distillation (a 385-wide regression
    # per expert): an evenly spaced subset saves most of their time at 270k calibration tokens
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
                    progress: bool = True) -> list[dict]:
    """Replace the model's FFNs (those `layers` selects) by calibrated MoE blocks, in place; returns per-layer
    stats. FFN inputs (and, for `e2e_steps`, the dense last hidden states) come from one forward pass of the
    dense model over the calibration batches."""
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
                           cfg.use_bf16(next(model.parameters()).device), cfg.e2e_frozen_fraction)
        model.eval()
    return rows


# ------------------------------------------------------------------------------------------ quality report


def _set_top_k(model: nn.Module, routed_k: int) -> None:
    for m in model.modules():
        if isinstance(m, MoEBlock):
            m.config.top_k = routed_k


@torch.no_grad()
def _outputs(model: nn.Module, batches: list[dict]) -> list:
    outs = []
    for enc in batches:
        out = model(**_model_kwargs(model, enc))
        logits = getattr(out, "logits", None)
        if logits is not None:  # decoder: per-batch summed next-token NLL and token count
            mask = enc["attention_mask"][:, 1:].float()
            nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), enc["input_ids"][:, 1:], reduction="none")
            outs.append(("ppl", (nll * mask).sum().item(), mask.sum().item()))
        else:  # encoder: mean-pooled sentence embeddings
            h = out.last_hidden_state.float()
            m = enc["attention_mask"].unsqueeze(-1).float()
            outs.append(("emb", (h * m).sum(1) / m.sum(1).clamp_min(1)))
    return outs


def quality(model: nn.Module, dense_outs: list, batches: list[dict]) -> dict:
    """Encoders: mean and 5th-percentile cosine of mean-pooled embeddings vs the dense model's.
    Decoders: perplexity on the held-out text (and the dense model's)."""
    outs = _outputs(model, batches)
    if outs and outs[0][0] == "ppl":
        nll, n = sum(o[1] for o in outs), sum(o[2] for o in outs)
        dn, dc = sum(o[1] for o in dense_outs), sum(o[2] for o in dense_outs)
        return {"perplexity": math.exp(nll / max(n, 1)), "dense_perplexity": math.exp(dn / max(dc, 1))}
    cos = F.cosine_similarity(torch.cat([o[1] for o in outs]), torch.cat([o[1] for o in dense_outs]), dim=-1)
    return {"mean_cosine": cos.mean().item(), "p5_cosine": torch.quantile(cos, 0.05).item()}


def quality_curve(model: nn.Module, dense_outs: list, batches: list[dict], cfg: CalibConfig,
                  dense_ffn_flops: int, progress: bool = True) -> list[dict]:
    """Quality at every top_k from the shared experts' count (at least 1) to experts; restores the block k."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    saved = [b.config.top_k for b in blocks]
    rows = []
    try:
        for k in tqdm(range(max(1, cfg.shared_experts), cfg.experts + 1), desc="evaluate top_k", unit="k",
                      disable=not progress):
            _set_top_k(model, cfg.routed_k(k))  # 0: the shared expert alone
            flops = sum(ffn_flops(b.config, cfg.routed_k(k)) for b in blocks)
            rows.append({"top_k": k, "ffn_flop_fraction": flops / dense_ffn_flops,
                         **quality(model, dense_outs, batches)})
    finally:
        for b, k in zip(blocks, saved):
            b.config.top_k = k
    return rows


def ffn_flops(c: MoEConfig, routed_k: int) -> int:
    """Multiply-adds per token of the experts a token runs (shared one included; router not counted)."""
    per_expert = c.expert_in_features * c.hidden_size + c.hidden_size * c.expert_size
    shared = 0
    if c.shared_expert_size:
        sc = c.shared_config()
        shared = sc.expert_in_features * c.hidden_size + c.hidden_size * sc.expert_size
    return routed_k * per_expert + shared
