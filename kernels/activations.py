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


def expert_activation(name: str, gated: bool, h: torch.Tensor) -> torch.Tensor:
    """Plain: act(h). Gated: h = [gate | up] along the last dim, act(gate) * up."""
    if not gated:
        return activation(name, h)
    gate, up = h.chunk(2, dim=-1)
    return activation(name, gate) * up


def expert_activation_backward(name: str, gated: bool, h: torch.Tensor, grad_a: torch.Tensor) -> torch.Tensor:
    if not gated:
        return grad_a * activation_grad(name, h)
    gate, up = h.chunk(2, dim=-1)
    return torch.cat([grad_a * up * activation_grad(name, gate), grad_a * activation(name, gate)], dim=-1)
