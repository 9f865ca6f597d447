"""A dense FFN found in a model: which linears it is made of (LinearRef, FFNMatch) and its weights (DenseFFN)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import fx, nn


@dataclass
class LinearRef:
    """One linear of an FFN: where its parameters live in the model and how the weight is laid out."""
    node: fx.Node | None  # None when the FFN was found from a checkpoint's tensor names, not a graph
    weight: str  # fully qualified parameter name
    bias: str | None
    out_in: bool  # weight is [out, in] (nn.Linear) rather than [in, out] (Conv1D, mm)

    @property
    def module(self) -> str:
        return self.weight.rsplit(".", 1)[0] if "." in self.weight else ""


@dataclass
class FFNMatch:
    up: LinearRef  # the linear whose output is (or is gated by) the activation; for gated, the ungated "up"
    down: LinearRef
    gate: LinearRef | None
    activation: str
    chain: list[fx.Node] = field(default_factory=list)
    input: fx.Node | None = None  # the FFN input (data input of the first linear)

    @property
    def gated(self) -> bool:
        return self.gate is not None

    @property
    def linears(self) -> list[LinearRef]:
        return [r for r in (self.gate, self.up, self.down) if r is not None]

    def describe(self) -> str:
        kind = "gated" if self.gated else "plain"
        ins = ", ".join(r.module for r in self.linears[:-1])
        return f"{kind} FFN ({self.activation}): {ins} -> {self.down.module}"


@dataclass
class DenseFFN:
    """One FFN found in a model: its weights as [out, in], and which modules a replacement takes over."""
    match: FFNMatch
    owner: str | None  # module replaced by the MoEBlock (None in the graph view)
    identity: list[str]  # modules replaced by nn.Identity (absorbed into the block)
    w_in: torch.Tensor  # [F, H]: the first projection (gate rows then up rows when gated)
    b_in: torch.Tensor | None
    w_out: torch.Tensor  # [H, I]
    b_out: torch.Tensor | None
    dropout: float  # of the replaced module's output, kept by the block

    @property
    def hidden_size(self) -> int:
        return self.w_out.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w_out.shape[1]

    def describe(self) -> str:
        return f"{self.owner}: {self.match.describe()}, hidden {self.hidden_size}, ffn {self.intermediate_size}"


def _param(root: nn.Module | Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    return root[name] if isinstance(root, Mapping) else root.get_parameter(name).detach()


def _weight(root, ref: LinearRef) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = _param(root, ref.weight)
    b = _param(root, ref.bias) if ref.bias else None
    return (w if ref.out_in else w.t()), b


def dense_ffn(root: nn.Module | Mapping[str, torch.Tensor], match: FFNMatch, owner: str | None = None,
              identity: list[str] | None = None) -> DenseFFN:
    """The matched FFN's weights, read from root: the model, the captured GraphModule (same parameter names), or a
    mapping of those names to tensors (the streaming split reads an FFN's tensors from its checkpoint)."""
    ins = [_weight(root, r) for r in (match.gate, match.up) if r is not None]
    w_in = torch.cat([w for w, _ in ins])
    if all(b is None for _, b in ins):
        b_in = None
    else:
        b_in = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in ins])
    w_out, b_out = _weight(root, match.down)
    return DenseFFN(match, owner, list(identity or []), w_in, b_in, w_out, b_out, 0.0)
