"""The routed experts' outputs on calibration tokens, and the least-squares router and compensation fit to them."""
from __future__ import annotations

import torch

from moecompile.calibration.dense import chunks
from moecompile.core.activations import expert_activation
from moecompile.ir.block import MoEBlock


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
    the fits never build the [N, E, H] outputs."""
    e = block.config.num_experts
    n, h = x.shape
    x1 = torch.cat([x.float(), x.new_ones(n, 1)], 1)
    gram = x1.t() @ x1
    # relative ridge, none on the intercept
    gram += ridge * gram.diagonal()[:-1].mean() * torch.eye(h + 1, device=x.device)
    a = torch.cat([expert_activations(block, x[s]) for s in chunks(n, 1024)])  # [N, E, I]
    w_out = block.experts.w_out.float()  # [E, H, I]
    b_out = block.experts.b_out.float() if block.experts.b_out is not None else torch.zeros(e, h, device=x.device)
    q, r = torch.linalg.qr(w_out)  # [E, H, K], [E, K, I]
    ra = torch.einsum("eki,tei->tek", r, a)
    logits = None
    for _ in range(rounds):
        if block.compensation is not None:
            if logits is None:  # first round: plain mean
                sums, counts = a.sum(0), torch.full((e,), float(n), device=x.device)
            else:
                skipped = 1.0 - _selection(logits, top_k)
                sums, counts = torch.einsum("te,tei->ei", skipped, a), skipped.sum(0)
            mean_a = sums / counts.clamp_min(1).unsqueeze(1)
            block.compensation.copy_(torch.einsum("ehi,ei->eh", w_out, mean_a)
                                     + b_out * (counts > 0).unsqueeze(1))
        d = b_out - (block.compensation.float() if block.compensation is not None else 0.0)  # [E, H]
        qd = torch.einsum("ehk,eh->ek", q, d)
        outside = (d - torch.einsum("ehk,ek->eh", q, qd)).pow(2).sum(1)  # the part of d w_out_e cannot reach
        target = torch.empty(n, e, device=x.device)
        for s in chunks(n):
            target[s] = ((ra[s] + qd).pow(2).sum(-1) + outside).sqrt()
        w = torch.linalg.solve(gram, x1.t() @ target)
        block.router.weight.copy_(w[:h].t())
        block.router.bias.copy_(w[h])
        logits = block.router_logits(x)
