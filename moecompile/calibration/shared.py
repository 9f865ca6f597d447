"""The linear shared expert: an always-on linear map fit to what the routed experts miss."""
from __future__ import annotations

import torch

from moecompile.calibration.dense import chunks
from moecompile.ir.block import MoEBlock
from moecompile.ir.config import MoEConfig


def with_config(block: MoEBlock, **changes) -> MoEBlock:
    """A copy of block with config fields changed; parameters that keep their shapes are carried over."""
    device = next(block.parameters()).device
    new = MoEBlock(MoEConfig(**{**block.config.to_dict(), **changes})).to(dtype=torch.float32, device=device)
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
    residual = torch.empty(n, h, device=x.device)
    for s in chunks(n):
        residual[s] = y[s] - block(x[s], top_k=top_k).float()
    x_mean, r_mean = x.float().mean(0), residual.mean(0)
    xc = x.float() - x_mean
    gram = xc.t() @ xc
    gram += 1e-6 * gram.diagonal().mean() * torch.eye(h, device=x.device)
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
