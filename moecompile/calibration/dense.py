"""The dense FFN being split, evaluated on calibration inputs in float32."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moecompile.core.activations import expert_activation
from moecompile.ffn.match import DenseFFN


def ffn_hidden(ffn: DenseFFN, x: torch.Tensor) -> torch.Tensor:
    """The dense FFN's hidden activations [N, I] (gate * up for gated FFNs)."""
    h = F.linear(x, ffn.w_in.float(), ffn.b_in.float() if ffn.b_in is not None else None)
    return expert_activation(ffn.match.activation, ffn.match.gated, h)


def ffn_output(ffn: DenseFFN, x: torch.Tensor) -> torch.Tensor:
    return F.linear(ffn_hidden(ffn, x), ffn.w_out.float(), ffn.b_out.float() if ffn.b_out is not None else None)


def chunks(n: int, size: int = 4096):
    """Slices of range(n), `size` rows each (the last shorter): bounds the memory of per-token work."""
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))
