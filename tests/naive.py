"""Plain-math references the tests share: written the slow, obvious way so that they share no code path with the
kernels under test."""
import math

import torch


def naive_act(name, x):
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    if name == "silu":
        return x / (1.0 + torch.exp(-x))
    raise AssertionError(name)
