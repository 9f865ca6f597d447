"""MoEBlock: the module view of a Mixture-of-Experts FFN (router + stacked expert weights)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moecompile.core.activations import expert_activation
from moecompile.core.logits import float32_logits, float32_logits_backward, on_tensor_cores
from moecompile.ir import ops
from moecompile.ir.config import MoEConfig
from moecompile.ir.knobs import check_top_k


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits in float32 whatever the model dtype. On CUDA with 16-bit inputs the product runs on tensor
    cores with a float32 output (products of 16-bit values are exact in float32; only the summation order
    differs from upcasting first), instead of an upcast copy of x and a float32 GEMM; so too in eager training.
    Autocast does not apply."""
    if torch.is_autocast_enabled(x.device.type):  # (checked first: no autocast region in graphs captured without it)
        with torch.autocast(x.device.type, enabled=False):
            return router_logits(x, weight)
    if on_tensor_cores(x, weight):
        if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return float32_logits(x, weight)
        if not torch.compiler.is_compiling():  # captured graphs keep the float32 linear fuse_route_dispatch matches
            return _Float32Logits.apply(x, weight)
    return F.linear(x.float(), weight.float())


class _Float32Logits(torch.autograd.Function):
    """x W^T with a float32 output on tensor cores; the backward's GEMMs in x's dtype (the logits' gradient rounded
    to it, as a router run in the model dtype has it), accumulating in float32."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return float32_logits(x, weight)

    @staticmethod
    def backward(ctx, grad_logits):
        return float32_logits_backward(grad_logits, *ctx.saved_tensors)


class MoEExperts(nn.Module):
    """Expert weights stacked on a leading expert dim: w_in [E, F, H] (F = 2I gate|up when gated), w_out [E, H, I]."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        e, h, i, f = config.num_experts, config.hidden_size, config.expert_size, config.expert_in_features
        self.w_in = nn.Parameter(torch.empty(e, f, h))
        self.w_out = nn.Parameter(torch.empty(e, h, i))
        self.b_in = nn.Parameter(torch.zeros(e, f)) if config.bias_in else None
        self.b_out = nn.Parameter(torch.zeros(e, h)) if config.bias_out == "expert" else None
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.w_out, std=0.02)

    def forward(self, rows, offsets, activation: str, gated: bool):
        return ops.expert_ffn(rows, offsets, self.w_in, self.b_in, self.w_out, self.b_out, activation, gated)

    def routed(self, x, weights, expert_ids, activation: str, gated: bool) -> torch.Tensor:
        """Dispatch tokens x [T, H] to their experts, run them and combine their outputs by the routing weights."""
        return ops.dispatch_ffn_combine(x, weights, expert_ids, self.w_in.shape[0], self.w_in, self.b_in, self.w_out,
                                        self.b_out, activation, gated)


class MoEBlock(nn.Module):
    """Drop-in replacement for a dense FFN: route -> dispatch -> experts -> combine.

    forward(hidden_states, top_k=None, capacity_factor=None): both override the config for one call.
    In training mode the block keeps `aux_loss` (load balancing + z-loss, already scaled by their coefficients)
    for the caller to add to its loss (`moecompile.aux_loss(model)` sums every block's).
    With `track_routing` on (`moecompile.track_routing(model)`), each forward also keeps `routing`: detached
    device tensors (no host sync) that `moecompile.routing_stats(model)` reads.
    """

    experts_sharded = False  # True where expert parallelism holds only this rank's experts

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=config.router_bias)
        nn.init.normal_(self.router.weight, std=0.02)
        if self.router.bias is not None:
            nn.init.zeros_(self.router.bias)
        self.experts = MoEExperts(config)
        # always-on expert: a plain dense FFN, outside the routed ops
        self.shared = MoEExperts(config.shared_config()) if config.shared_expert_size else None
        # compensation[e] stands in for expert e's output on tokens that do not use it (zeros: exact at init)
        self.compensation = (nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
                             if config.compensation else None)
        self.bias = nn.Parameter(torch.zeros(config.hidden_size)) if config.bias_out == "shared" else None
        self.dropout = nn.Dropout(config.dropout)
        self.aux_loss: torch.Tensor | None = None
        self.track_routing = False
        self.routing: dict | None = None

    def extra_repr(self) -> str:
        c = self.config
        return (f"experts={c.num_experts}, top_k={c.top_k}, hidden={c.hidden_size}, expert_size={c.expert_size}, "
                f"activation={c.activation}, gated={c.gated}, capacity_factor={c.capacity_factor}")

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.config.router_jitter > 0:
            eps = self.config.router_jitter
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        if self.router.bias is not None:  # (a calibrated router's intercept)
            return F.linear(x.float(), self.router.weight.float(), self.router.bias.float())
        return router_logits(x, self.router.weight)

    def forward(self, hidden_states: torch.Tensor, top_k: int | None = None,
                capacity_factor: float | None = None) -> torch.Tensor:
        c = self.config
        if top_k is None:
            top_k = c.top_k  # checked when the config was made
        else:
            check_top_k(top_k, c.num_experts, low=0 if self.shared is not None else 1, error=ValueError)
        capacity_factor = c.capacity_factor if capacity_factor is None else capacity_factor
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if top_k == 0:  # the shared expert alone
            out = self._shared_out(x) + self._compensation_out(x, None)
        else:
            logits = self.router_logits(x)
            weights, expert_ids = ops.route(logits, top_k, float(capacity_factor), c.renormalize)
            if c.gate_weighting == "unit":  # weight 1 per kept expert, straight-through gradient to the router
                weights = torch.where(expert_ids < c.num_experts, weights - weights.detach() + 1.0, 0.0)
            out = self.run_experts(x, weights, expert_ids)
            if self.shared is not None:
                out = out + self._shared_out(x)
            if self.compensation is not None:
                out = out + self._compensation_out(x, expert_ids)
            if self.training and x.shape[0] > 0:  # dropless: route's ids are the top-k choices
                self.aux_loss = self._aux_loss(logits, top_k, expert_ids if capacity_factor == 0 else None)
            if self.track_routing and not torch.compiler.is_exporting():  # export would leave fake tensors here
                self.routing = self._routing(logits, expert_ids, top_k)
        if self.bias is not None:
            out = out + self.bias
        return self.dropout(out).reshape(shape)

    def _routing(self, logits, expert_ids, top_k: int) -> dict:
        """Kept assignments per expert (scatter_add: no bincount, no host sync), dropped assignments (id E), aux
        loss and mean router entropy (nats) of this forward: detached, on the input's device."""
        with torch.no_grad():
            flat = expert_ids.reshape(-1)
            counts = torch.zeros(self.config.num_experts + 1, dtype=torch.long, device=flat.device).scatter_add_(
                0, flat, torch.ones_like(flat))[: self.config.num_experts]
            if logits.shape[0] > 0:
                aux = self.aux_loss if self.training else self._aux_loss(logits, top_k)
                entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()
            else:
                aux = entropy = logits.new_zeros(())
            return {"counts": counts, "dropped": (expert_ids == self.config.num_experts).sum(),
                    "aux_loss": aux.detach().float(), "entropy": entropy.float(), "top_k": top_k}
    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Routed tokens -> weighted sum of their experts' outputs (expert parallelism overrides this)."""
        return self.experts.routed(x, weights, expert_ids, self.config.activation, self.config.gated)

    def _shared_out(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared is None:
            return x.new_zeros(x.shape[0], self.config.hidden_size)
        s = self.shared
        h = F.linear(x, s.w_in[0], s.b_in[0] if s.b_in is not None else None)
        if not self.config.shared_linear:
            h = expert_activation(self.config.activation, self.config.gated, h)
        return F.linear(h, s.w_out[0])

    def _compensation_out(self, x: torch.Tensor, expert_ids: torch.Tensor | None) -> torch.Tensor:
        """Sum of compensation[e] over the experts each token does not use (capacity-dropped ones included)."""
        if self.compensation is None:
            return x.new_zeros(x.shape[0], self.config.hidden_size)
        e = self.config.num_experts
        unused = x.new_ones(x.shape[0], e)
        if expert_ids is not None:  # dropped assignments carry id e: they land in the extra column
            unused = 1.0 - x.new_zeros(x.shape[0], e + 1).scatter(1, expert_ids, 1.0)[:, :e]
        return unused @ self.compensation.to(x.dtype)

    def _aux_loss(self, logits: torch.Tensor, top_k: int, chosen: torch.Tensor | None = None) -> torch.Tensor:
        """Switch/GShard load balancing E * sum_e f_e P_e (f: fraction of top-k choices, P: mean router
        probability) plus the ST-MoE z-loss mean(logsumexp(logits)^2), each times its coefficient. chosen: the
        top-k choices where already known."""
        c = self.config
        probs = torch.softmax(logits, dim=-1)
        if chosen is None:
            chosen = torch.topk(logits, top_k, dim=-1).indices
        flat = chosen.reshape(-1)  # counted by scatter_add: a one-hot of every choice would be [T * k, E]
        counts = probs.new_zeros(c.num_experts).scatter_add_(0, flat, probs.new_ones(flat.shape))
        fraction = counts / max(flat.numel(), 1)
        balance = c.num_experts * (fraction * probs.mean(0)).sum()
        loss = c.aux_loss_coef * balance
        if c.z_loss_coef > 0:
            loss = loss + c.z_loss_coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return loss


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the auxiliary losses every MoEBlock in model kept from its last training-mode forward."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoEBlock) and m.aux_loss is not None]
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).sum()
