"""Hugging Face integration: "moecompile" as an experts implementation of every HF MoE model.

    import moecompile
    model.set_experts_implementation("moecompile")   # HF's router, moecompile's dispatch / experts / combine

HF 5 MoE models keep their experts as fused 3D tensors and pick the experts forward from
transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS by config._experts_implementation; importing moecompile
registers this one there.
"""
from __future__ import annotations

import torch

from moecompile.core.activations import expert_activation
from moecompile.core.errors import MoECompileError
from moecompile.ir import ops
from moecompile.ir.config import identify_activation
from moecompile.runtime import choices

NAME = "moecompile"
_SPEC_ATTR = "_moecompile_experts_spec"


# HF hidden_act names (transformers.activations.ACT2CLS) of the activations moecompile's experts run
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh", "relu": "relu"}


def _activation(module) -> str:
    """From HF's config name, else (eagerly) by evaluating the module's act_fn."""
    name = HF_ACTIVATIONS.get(getattr(getattr(module, "config", None), "hidden_act", None))
    if name is None and not torch.compiler.is_compiling():
        name = identify_activation(module.act_fn)
    if name is None:
        raise MoECompileError(f"{type(module).__name__}: its activation is not one moecompile's experts run")
    return name


def experts_spec(module) -> dict:
    """How an HF experts module maps onto moecompile::experts (cached on the module)."""
    spec = getattr(module, _SPEC_ATTR, None)
    if spec is not None:
        return spec
    from transformers.integrations import moe as hf_moe

    if getattr(module, "has_post_expert_norm", False):
        raise MoECompileError(f"{type(module).__name__}: a norm after each expert is not supported")
    gated = getattr(module, "has_gate", True)
    custom_gate = gated and type(module)._apply_gate is not hf_moe._default_apply_gate
    if custom_gate and not (hasattr(module, "alpha") and hasattr(module, "limit")):
        raise MoECompileError(f"{type(module).__name__}: unknown gate function {type(module)._apply_gate.__name__}")
    spec = {"activation": "swiglu_oai" if custom_gate else _activation(module), "gated": gated,
            # HF's default gate splits [gate | up] halves whatever the layout flag; GPT-OSS's gate interleaves
            "interleaved": custom_gate and not getattr(module, "is_concatenated", True),
            "alpha": float(getattr(module, "alpha", 1.702)), "limit": float(getattr(module, "limit", 7.0)),
            "transposed": bool(getattr(module, "is_transposed", False)),
            "bias": bool(getattr(module, "has_bias", False))}
    if not torch.compiler.is_compiling():  # check the mapping against the module's own gate once, eagerly
        _verify(module, spec)
        setattr(module, _SPEC_ATTR, spec)
    return spec


def _verify(module, spec: dict) -> None:
    width = 2 * 6 if spec["gated"] else 6
    probe = torch.linspace(-9.0, 9.0, 5 * width).reshape(5, width)
    if spec["gated"]:
        expected = module._apply_gate(probe.clone())
    else:
        expected = module.act_fn(probe.clone())
    got = expert_activation(spec["activation"], spec["gated"], probe, spec["interleaved"], spec["alpha"],
                            spec["limit"])
    if not torch.allclose(got, expected.float(), rtol=1e-4, atol=1e-5):
        raise MoECompileError(f"{type(module).__name__}: its gate function is not {spec['activation']} as read")


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF experts forward on moecompile ops: dispatch -> experts -> combine (ids >= E are dropped slots). Small eager
    CUDA batches take HF's own implementation for them (runtime/choices.py says when)."""
    if (hidden_states.is_cuda and not torch.compiler.is_compiling()
            and choices.eager_prefers_hf(top_k_index.numel(), self.num_experts)):
        return _hf_small_batch_experts()(self, hidden_states, top_k_index, top_k_weights)
    spec = experts_spec(self)
    w_in = self.gate_up_proj if spec["gated"] else self.up_proj
    w_out = self.down_proj
    if spec["transposed"]:  # [E, H, 2I] / [E, I, H]: strided views, no copy
        w_in, w_out = w_in.transpose(1, 2), w_out.transpose(1, 2)
    b_in = b_out = None
    if spec["bias"]:
        b_in = self.gate_up_proj_bias if spec["gated"] else self.up_proj_bias
        b_out = self.down_proj_bias
    return ops.dispatch_ffn_combine(hidden_states, top_k_weights, top_k_index, self.num_experts, w_in, b_in, w_out,
                                    b_out, spec["activation"], spec["gated"], spec["interleaved"], spec["alpha"],
                                    spec["limit"])


def _hf_small_batch_experts():
    """HF's batched_mm, which HF's generate itself switches to for decoding on GPUs (grouped_mm where absent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    try:
        return ALL_EXPERTS_FUNCTIONS["batched_mm"]
    except KeyError:
        return ALL_EXPERTS_FUNCTIONS["grouped_mm"]


def register() -> bool:
    """Register "moecompile" in HF's experts interface; False when this transformers has none."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
    return True
