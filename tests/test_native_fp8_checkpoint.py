"""Native FineGrainedFP8 models (transformers' FP8Linear / FP8Experts, as from_pretrained builds them from an FP8
checkpoint) on moecompile's FP8 ops: eager after finegrained_fp8.enable, compiled with the backend, and
moecompile.generate, against the same model with every FP8 weight dequantised (HF's own modules, float32)."""
import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from transformers import FineGrainedFP8Config, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.finegrained_fp8 import (
    Fp8Dequantize,
    FP8Experts,
    FP8Linear,
    replace_with_fp8_linear,
)

import moecompile
from moecompile.integrations import finegrained_fp8
from moecompile.ir.fp8 import dequantize_blocks, quantize_blocks, quantize_weight

NO_INDUCTOR = {"inductor": False}
# expert rows a multiple of 128 (2I and I): transformers' gate_up scales are then one per 128 x 128 block
SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
FAMILIES = {
    # 16 experts top-2: one token is decode-sized (direct experts, routed_experts_fp8)
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(**SHAPES, head_dim=16, moe_intermediate_size=128,
                                                                 num_experts=16, num_experts_per_tok=2)),
    # 4 experts top-2: the sorted experts_fp8 at every size
    "mixtral": (MixtralForCausalLM, lambda: MixtralConfig(**SHAPES, num_local_experts=4, num_experts_per_tok=2)),
}
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def native_fp8(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Module]:
    """(FP8 model, reference): a tiny model swapped to transformers' FP8 modules by transformers' own
    replace_with_fp8_linear (what from_pretrained does for an FP8 checkpoint; lm_head kept, as FP8 checkpoints
    keep it), filled with 128 x 128 block-quantised random weights; the reference is the same model with each of
    those weights dequantised (plain HF modules, in dtype)."""
    cls, config = FAMILIES[family]
    torch.manual_seed(seed)
    reference = cls(config()).eval()
    with torch.no_grad():  # HF's init is tiny: larger weights make the routing and the FP8 error count
        for p in reference.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    reference.to(dtype)  # before the swap: .to(dtype) would cast FP8 parameters too
    model = copy.deepcopy(reference)
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], quantization_config=FineGrainedFP8Config())
    for name, module in model.named_modules():
        ref = reference.get_submodule(name) if name else reference
        if isinstance(module, FP8Linear):
            pairs = [("weight", quantize_blocks)]
        elif isinstance(module, FP8Experts):
            pairs = [(w, quantize_weight) for w in EXPERT_WEIGHTS]
        else:
            continue
        for w, quantize in pairs:
            q, s = quantize(getattr(ref, w).detach())
            setattr(module, w, nn.Parameter(q, requires_grad=False))
            setattr(module, f"{w}_scale_inv", nn.Parameter(s, requires_grad=False))
            with torch.no_grad():
                getattr(ref, w).copy_(dequantize_blocks(q, s))
    return model.eval(), reference


def _cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(1).float(), b.flatten(1).float()).min().item()


def test_fixture_is_transformers_fp8_layout():
    """The fixture holds what transformers loads from an FP8 checkpoint: FP8Linear / FP8Experts with float8_e4m3fn
    weights and float32 scale_inv per 128 x 128 block, and transformers' own dequantisation of them is ours."""
    model, _ = native_fp8("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, FP8Experts) and isinstance(model.model.layers[0].self_attn.q_proj, FP8Linear)
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scale_inv.dtype == torch.float32
    assert tuple(experts.gate_up_proj.shape) == (16, 256, 64)
    assert tuple(experts.gate_up_proj_scale_inv.shape) == (16, 2, 1)
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.gate).__name__ == "Qwen3MoeTopKRouter"
    hf = Fp8Dequantize(None)._dequantize_one(experts.gate_up_proj, experts.gate_up_proj_scale_inv, torch.float32)
    assert torch.equal(hf, dequantize_blocks(experts.gate_up_proj, experts.gate_up_proj_scale_inv))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_enable_runs_eagerly_on_moecompile_ops(family):
    """After enable() the FP8 model runs without transformers' Hub kernel, within FP8 error of the dequantised
    reference (the activations are quantised per 128 channels, as transformers' FP8 kernels do)."""
    model, reference = native_fp8(family)
    report = finegrained_fp8.enable(model)
    assert len(report["experts"]) == 2 and len(report["linears"]) == 8 and not report["left"]
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "MoECompileFP8Linear"
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert _cosine(got, want) >= 0.999


def _ops(gm, name: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None)
               == "moecompile" and n.target._opname == name)


def _float_copies(gm, shapes: set) -> list[str]:
    """Graph constants and node values in a non-FP8 float dtype with an expert weight's shape: a dequantised copy."""
    tensors = [(name, t) for name, t in [*gm.named_parameters(), *gm.named_buffers()]]
    tensors += [(n.name, n.meta.get("val")) for n in gm.graph.nodes]
    return [name for name, t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.dtype != torch.float8_e4m3fn and any(list(t.shape) == list(s) for s in shapes)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_backend_runs_the_stored_fp8_weights(family):
    """Compiled with the backend, a native FP8 model runs moecompile's FP8 ops on the checkpoint's own FP8 tensors
    (experts_fp8 over a prompt; routed_experts_fp8 for Qwen3-MoE's one token, a decode-sized block; linear_fp8 for
    every FP8Linear; no dequantised copy of an expert weight) and matches the dequantised reference."""
    model, reference = native_fp8(family)
    compiled = moecompile.compile(model, **NO_INDUCTOR)  # enables the FP8 modules itself
    shapes = {tuple(getattr(model.model.layers[0].mlp.experts, w).shape) for w in EXPERT_WEIGHTS}
    gen = torch.Generator().manual_seed(1)
    sizes = [(2, 7), (1, 1)] if family == "qwen3_moe" else [(2, 7)]  # Mixtral's one token: the same experts_fp8
    for ids in [torch.randint(0, 96, size, generator=gen) for size in sizes]:
        moecompile.backend.clear_records()
        with torch.no_grad():
            got = compiled(ids, use_cache=False).logits
            want = reference(ids, use_cache=False).logits
        assert _cosine(got, want) >= 0.999
        (record,) = moecompile.backend.records()
        reports = dict(record.reports)
        assert all("FP8 weights as stored" in r for r in reports["recognise_moe"]["recognised"])
        assert len(reports["recognise_moe"]["recognised"]) == 2, reports["recognise_moe"]
        gm = record.graph_module
        direct = family == "qwen3_moe" and ids.numel() == 1
        assert _ops(gm, "routed_experts_fp8" if direct else "experts_fp8") == 2
        assert _ops(gm, "experts") == _ops(gm, "routed_experts") == 0
        assert _ops(gm, "linear_fp8") == 8  # q, k, v, o of two layers; routers and lm_head stay as they are
        assert not _float_copies(gm, shapes)
        assert all("as stored" in r for r in reports["insert_fp8"]["rewritten"])


def test_generate_matches_the_dequantised_model():
    """moecompile.generate on the native FP8 model gives the dequantised model's greedy tokens (seed chosen where
    no near-tie separates them; the logits are compared too)."""
    model, reference = native_fp8("qwen3_moe")
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    got = moecompile.generate(model, ids, 4, options=NO_INDUCTOR)
    want = moecompile.generate(reference, ids, 4, compile=False)
    assert torch.equal(got, want)
    with torch.no_grad():
        assert _cosine(model(got).logits, reference(got).logits) >= 0.999
