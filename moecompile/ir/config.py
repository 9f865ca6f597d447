"""Configuration of one MoE block: the single source of truth for its shapes and routing knobs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moecompile.core.activations import activation as activation_fn  # noqa: F401  (the one definition)
from moecompile.core.errors import MoECompileError
from moecompile.ir.knobs import CAPACITY_FACTOR, TOP_K, check_experts, check_top_k

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
ACTIVATION_ALIASES = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "swish": "silu"}


def identify_activation(fn) -> str | None:
    """The known activation that `fn` (a module, a function, a graph fragment) computes, found by evaluating it on
    a fixed float32 probe; None if it is none of them."""
    import torch

    x = torch.linspace(-6.0, 6.0, 121)
    got = fn(x)
    for name in ACTIVATIONS:
        if torch.allclose(got.float(), activation_fn(name, x), rtol=1e-4, atol=1e-5):
            return name
    return None


def canonical_activation(name: str) -> str:
    name = ACTIVATION_ALIASES.get(name, name)
    if name not in ACTIVATIONS:
        raise MoECompileError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")
    return name


@dataclass
class MoEConfig:
    """Shapes and routing of an `MoEBlock`.

    capacity_factor (the one statement of its convention; its default, dropless: knobs.CAPACITY_FACTOR)
    follows Tutel: > 0 a fixed capacity of ceil(cf * tokens * top_k / experts) per expert, the
    overflow dropped; 0 dropless; < 0 dropless up to a cap of ceil(|cf| * tokens * top_k / experts). Expert
    groups have variable size (no padding), so > 0 and < 0 drop the same assignments; the sign only records intent.
    gate_weighting "router" scales each expert's output by its (renormalised) router weight; "unit" gives every
    selected expert weight 1 (a neuron split is exact at top_k = experts that way), with a straight-through
    gradient to the router. With a shared expert, top_k may be 0 per call (only the shared expert runs).
    """

    hidden_size: int
    expert_size: int  # hidden neurons per expert
    num_experts: int
    top_k: int = TOP_K
    capacity_factor: float = CAPACITY_FACTOR
    activation: str = "gelu"
    gated: bool = False  # act(x W_gate) * (x W_up), LLaMA-style
    bias_in: bool = False  # per-expert bias of the first projection
    bias_out: str = "none"  # "expert": per-expert bias of the second projection (an upcycled copy keeps it);
    # "shared": one bias added once after combining (a neuron split keeps the dense bias that way); "none"
    renormalize: bool = True  # top-k weights renormalised to sum to 1
    gate_weighting: str = "router"  # "router" | "unit"
    router_jitter: float = 0.0  # multiplicative uniform noise on the router input while training (Switch)
    aux_loss_coef: float = 0.01  # Switch/GShard load balancing
    z_loss_coef: float = 0.0  # ST-MoE router z-loss
    dropout: float = 0.0  # on the block output, kept from the dense FFN it replaced
    method: str = "custom"  # how the experts were made: upcycle | split | custom
    # calibrated conversion (moecompile/calibration/); the defaults leave the block as above
    shared_expert_size: int = 0  # neurons of one always-on expert beside the routed ones (same activation/gating)
    shared_linear: bool = False  # the shared expert without activation: a rank-shared_expert_size linear map
    router_bias: bool = False  # a bias on the router logits (a fitted router predicts expert mass with an intercept)
    compensation: bool = False  # a learned output vector per expert, added for every expert a token does not use

    def __post_init__(self):
        self.activation = canonical_activation(self.activation)
        check_experts(self.num_experts)
        check_top_k(self.top_k, self.num_experts)
        if self.gate_weighting not in ("router", "unit"):
            raise MoECompileError(f"gate_weighting must be 'router' or 'unit', got {self.gate_weighting!r}")
        if self.bias_out not in ("none", "expert", "shared"):
            raise MoECompileError(f"bias_out must be 'none', 'expert' or 'shared', got {self.bias_out!r}")
        if self.hidden_size < 1 or self.expert_size < 1:
            raise MoECompileError("hidden_size and expert_size must be positive")
        if self.shared_expert_size < 0:
            raise MoECompileError(f"shared_expert_size must be >= 0, got {self.shared_expert_size}")

    @property
    def expert_in_features(self) -> int:
        """Rows of w_in per expert: gate and up stacked for gated experts."""
        return 2 * self.expert_size if self.gated else self.expert_size

    def params_per_expert(self) -> int:
        n = self.expert_in_features * self.hidden_size + self.hidden_size * self.expert_size
        if self.bias_in:
            n += self.expert_in_features
        if self.bias_out == "expert":
            n += self.hidden_size
        return n

    def shared_config(self) -> "MoEConfig":
        """The always-on expert's shapes: one expert of shared_expert_size neurons, no output bias of its own."""
        return dataclasses.replace(self, num_experts=1, top_k=1, expert_size=self.shared_expert_size,
                                   bias_out="none", shared_expert_size=0, compensation=False, router_bias=False,
                                   gated=self.gated and not self.shared_linear, shared_linear=False)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise MoECompileError(f"unknown MoE config keys: {', '.join(sorted(unknown))}")
        return cls(**d)
