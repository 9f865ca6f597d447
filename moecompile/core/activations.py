"""Expert activations and their derivatives, by name (the names MoEConfig.activation accepts)."""
import math

import torch

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return torch.nn.functional.gelu(x)
    if name == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if name == "relu":
        return torch.relu(x)
    if name == "silu":
        return torch.nn.functional.silu(x)
    raise ValueError(f"unknown activation {name!r}")


def activation_grad(name: str, x: torch.Tensor) -> torch.Tensor:
    """d activation(x) / dx, elementwise."""
    if name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
        pdf = torch.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
        return cdf + x * pdf
    if name == "gelu_tanh":
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * x.pow(3))
        t = torch.tanh(inner)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
    if name == "relu":
        return (x > 0).to(x.dtype)
    if name == "silu":
        s = torch.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    raise ValueError(f"unknown activation {name!r}")


GLU_ACTIVATIONS = ("swiglu_oai",)
"""Gated-only activations with their own gate formula (not act(gate) * up)."""


def split_gate_up(h: torch.Tensor, interleaved: bool = False):
    """[gate | up] halves along the last dim, or gate/up interleaved column by column (GPT-OSS)."""
    if interleaved:
        return h[..., 0::2], h[..., 1::2]
    return h.chunk(2, dim=-1)


def join_gate_up(grad_gate: torch.Tensor, grad_up: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if interleaved:
        return torch.stack([grad_gate, grad_up], dim=-1).flatten(-2)
    return torch.cat([grad_gate, grad_up], dim=-1)


def _swiglu_oai(gate, up, alpha: float, limit: float):
    """GPT-OSS: gate clamped above, up clamped both sides, (up + 1) * gate * sigmoid(alpha * gate)."""
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    return (u + 1.0) * (g * torch.sigmoid(alpha * g))


def _swiglu_oai_backward(gate, up, grad_a, alpha: float, limit: float):
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    s = torch.sigmoid(alpha * g)
    glu = g * s
    # clamp passes the gradient where the input is inside the closed interval (as torch.clamp's backward does)
    grad_gate = grad_a * (u + 1.0) * (s + alpha * g * s * (1.0 - s)) * (gate <= limit).to(gate.dtype)
    grad_up = grad_a * glu * ((up >= -limit) & (up <= limit)).to(up.dtype)
    return grad_gate, grad_up


def expert_activation(name: str, gated: bool, h: torch.Tensor, interleaved: bool = False, alpha: float = 1.702,
                      limit: float = 7.0) -> torch.Tensor:
    """Plain: act(h). Gated: h holds gate and up ([gate | up] halves, or interleaved columns), act(gate) * up;
    "swiglu_oai" (gated only) is GPT-OSS's clamped SwiGLU with its alpha and limit."""
    if not gated:
        if name in GLU_ACTIVATIONS:
            raise ValueError(f"activation {name!r} needs gated experts")
        return activation(name, h)
    gate, up = split_gate_up(h, interleaved)
    if name == "swiglu_oai":
        return _swiglu_oai(gate, up, alpha, limit)
    return activation(name, gate) * up


def expert_activation_backward(name: str, gated: bool, h: torch.Tensor, grad_a: torch.Tensor,
                               interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    if not gated:
        return grad_a * activation_grad(name, h)
    gate, up = split_gate_up(h, interleaved)
    if name == "swiglu_oai":
        grad_gate, grad_up = _swiglu_oai_backward(gate, up, grad_a, alpha, limit)
    else:
        grad_gate, grad_up = grad_a * up * activation_grad(name, gate), grad_a * activation(name, gate)
    return join_gate_up(grad_gate, grad_up, interleaved)
