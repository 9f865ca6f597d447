"""Layer-wise training of one block on its FFN's calibration inputs: the router alone, then every parameter."""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from moecompile.calibration.masked import masked_forward
from moecompile.calibration.router import expert_outputs
from moecompile.ir.block import MoEBlock

ADAM_OPTIONS = {"fused": True}  # one Adam kernel for all parameters


def one_cycle(opt: torch.optim.Optimizer, lr: float, steps: int):
    """One-cycle learning rate, 10% warm-up (15% at exactly 10 steps, where OneCycleLR's warm-up would end at step 0
    and it divides by zero)."""
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.15 if steps == 10
                                               else 0.1)


def _token_weights(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token loss weights: the error relative to the token's residual-stream scale, so that a few tokens with
    huge FFN outputs (BERT's [CLS] in layer 0) do not drown the rest."""
    return 1.0 / (y.float().pow(2).sum(1) + x.float().pow(2).sum(1)).clamp_min(1e-6)


def train_router(block: MoEBlock, x: torch.Tensor, steps: int, lr: float, batch: int, seed: int,
                 progress: bool = True, desc: str = "router") -> float:
    """Train the router alone to rank experts by the error their absence causes: cross-entropy between the
    router's softmax and softmax(target / T), target = ||out_e - compensation[e]||, T its mean spread."""
    if steps <= 0:
        return float("nan")
    params = [p for p in block.router.parameters()]
    opt = torch.optim.Adam(params, lr=lr, **ADAM_OPTIONS)
    gen = torch.Generator().manual_seed(seed)
    comp = block.compensation.detach().float() if block.compensation is not None else 0.0
    loss = torch.zeros(())
    for _ in tqdm(range(steps), desc=desc, unit="step", disable=not progress, leave=False):
        idx = torch.randint(x.shape[0], (min(batch, x.shape[0]),), generator=gen).to(x.device)
        xb = x[idx]
        target = (expert_outputs(block, xb) - comp).norm(dim=-1)
        temp = target.std(dim=1, keepdim=True).clamp_min(1e-6)
        loss = torch.sum(-torch.softmax(target / temp, 1) * torch.log_softmax(block.router_logits(xb), 1), 1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())


def distill(block: MoEBlock, x: torch.Tensor, y: torch.Tensor, steps: int, top_ks: tuple[int, ...], lr: float,
            batch: int, seed: int, progress: bool = True, desc: str = "distill", bf16: bool = False) -> float:
    """Adam on every parameter of the block against the dense outputs y, top_k cycling through top_ks."""
    if steps <= 0:
        return float("nan")
    weights = _token_weights(x, y)  # the block stays in eval mode: masked_forward has no dropout or jitter
    opt = torch.optim.Adam(block.parameters(), lr=lr, **ADAM_OPTIONS)
    sched = one_cycle(opt, lr, steps)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for step in tqdm(range(steps), desc=desc, unit="step", disable=not progress, leave=False):
        idx = torch.randint(x.shape[0], (min(batch, x.shape[0]),), generator=gen).to(x.device)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            out = masked_forward(block, x[idx], top_ks[step % len(top_ks)])
        loss = ((out.float() - y[idx]).pow(2).sum(1) * weights[idx]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return float(loss.detach())
