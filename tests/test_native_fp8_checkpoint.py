"""Native FineGrainedFP8 models (transformers' FP8Linear / FP8Experts, as from_pretrained builds them from an FP8
checkpoint) on moecompile's FP8 ops: eager after finegrained_fp8.enable, compiled with the backend, and
moecompile.generate, against the same model with every FP8 weight dequantised (HF's own modules, float32)."""
import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.finegrained_fp8 import (
    Fp8Dequantize,
    FP8Experts,
    FP8Linear,
)

import moecompile
from moecompile.core.errors import MoECompileError
from moecompile.integrations import finegrained_fp8
from moecompile.ir.fp8 import dequantize_blocks

NO_INDUCTOR = {"inductor": False}
# expert rows a multiple of 128 (2I and I): transformers' gate_up scales are then one per 128 x 128 block
SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
FAMILIES = {
    # 16 experts top-2: one token is decode-sized (direct experts, routed_experts_fp8)
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda **sizes: Qwen3MoeConfig(**{
        **SHAPES, "head_dim": 16, "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 2, **sizes})),
    # 4 experts top-2: the sorted experts_fp8 at every size
    "mixtral": (MixtralForCausalLM, lambda **sizes: MixtralConfig(**{
        **SHAPES, "num_local_experts": 4, "num_experts_per_tok": 2, **sizes})),
}
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def native_fp8(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes
               ) -> tuple[nn.Module, nn.Module]:
    """(FP8 model, reference): a tiny model (its config's `sizes` changed) converted by
    finegrained_fp8.to_native_fp8 to transformers' FP8 modules (what from_pretrained builds for an FP8 checkpoint;
    lm_head kept, as FP8 checkpoints keep it) with 128 x 128 block-quantised random weights; the reference is the
    same model with each of those weights dequantised (plain HF modules, in dtype)."""
    cls, config = FAMILIES[family]
    torch.manual_seed(seed)
    reference = cls(config(**sizes)).eval()
    with torch.no_grad():  # HF's init is tiny: larger weights make the routing and the FP8 error count
        for p in reference.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    reference.to(dtype)  # before the conversion: .to(dtype) would cast FP8 parameters too
    model = finegrained_fp8.to_native_fp8(copy.deepcopy(reference))
    with torch.no_grad():
        for name, module in model.named_modules():
            for w in finegrained_fp8.quantised_weights(module):
                q, s = getattr(module, w), getattr(module, f"{w}_scale_inv")
                getattr(reference.get_submodule(name), w).copy_(dequantize_blocks(q, s))
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


def test_to_native_fp8_builds_on_meta_and_refuses_split_blocks():
    """to_native_fp8 fills meta-device modules through `fill` one at a time (never a whole bf16 model), gives the
    config the quantization_config of an FP8 checkpoint, and refuses (model unchanged) an expert intermediate size
    whose gate and up halves would share scale blocks."""
    cls, config = FAMILIES["mixtral"]
    with torch.device("meta"):
        model = cls(config())
    filled = []

    def fill(name, module):
        module.to_empty(device="cpu")
        nn.init.normal_(module.weight if hasattr(module, "weight") else module.gate_up_proj)
        filled.append(name)

    finegrained_fp8.to_native_fp8(model, fill=fill)
    assert len(filled) == 10 and filled[4] == "model.layers.0.mlp.experts"
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.device.type == "cpu" and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_proj_scale_inv.abs().min() > 0  # filled, not left empty
    quant = model.config.to_dict()["quantization_config"]
    assert quant["quant_method"] == "fp8" and list(quant["weight_block_size"]) == [128, 128]
    assert model.lm_head.weight.is_meta and type(model.lm_head) is nn.Linear  # not converted, not filled
    odd = cls(MixtralConfig(**{**SHAPES, "intermediate_size": 192}, num_local_experts=4))
    with pytest.raises(MoECompileError, match="intermediate size 192 is not a multiple of 128"):
        finegrained_fp8.to_native_fp8(odd)
    assert type(odd.model.layers[0].mlp.experts).__name__ == "MixtralExperts"
    assert not hasattr(odd.config, "quantization_config")


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
    (experts_fp8 over a prompt; routed_experts_fp8 for one token, which FP8 experts take at any expert count;
    linear_fp8 for every FP8Linear; no dequantised copy of an expert weight) and matches the dequantised reference."""
    model, reference = native_fp8(family)
    compiled = moecompile.compile(model, **NO_INDUCTOR)  # enables the FP8 modules itself
    shapes = {tuple(getattr(model.model.layers[0].mlp.experts, w).shape) for w in EXPERT_WEIGHTS}
    gen = torch.Generator().manual_seed(1)
    for ids in [torch.randint(0, 96, size, generator=gen) for size in [(2, 7), (1, 1)]]:
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
        direct = ids.numel() == 1
        assert _ops(gm, "routed_experts_fp8" if direct else "experts_fp8") == 2
        assert _ops(gm, "experts") == _ops(gm, "routed_experts") == 0
        assert _ops(gm, "linear_fp8") == 8  # q, k, v, o of two layers; routers and lm_head stay as they are
        assert not _float_copies(gm, shapes)
        assert all("as stored" in r for r in reports["insert_fp8"]["rewritten"])


def test_fp8_linears_of_one_input_fuse_into_one():
    """q / k / v over whole 128-row scale blocks (4 heads of 32, as many key / value heads) compile to one
    linear_fp8 over their stacked FP8 weights and scales: the unfused graph's logits; the model's weights and scales
    become views of the stacked buffers, so an in-place change of one scale reaches the compiled model."""
    model, reference = native_fp8("qwen3_moe", num_key_value_heads=4, head_dim=32)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    results = {}
    for fuse in (False, True):
        torch._dynamo.reset()
        moecompile.backend.clear_records()
        with torch.no_grad():
            results[fuse] = moecompile.compile(model, fuse_projections=fuse, **NO_INDUCTOR)(ids, use_cache=False).logits
    (record,) = moecompile.backend.records()
    assert len(dict(record.reports)["fuse_projections"]["fused"]) == 2, record.reports
    assert _ops(record.graph_module, "linear_fp8") == 4  # q/k/v fused and o, two layers
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=1e-5)
    attention = model.model.layers[0].self_attn
    q_scale = attention.q_proj.weight_scale_inv
    assert q_scale.untyped_storage().data_ptr() == attention.k_proj.weight_scale_inv.untyped_storage().data_ptr()
    with torch.no_grad():
        q_scale.mul_(2)
        reference.model.layers[0].self_attn.q_proj.weight.mul_(2)
        got = moecompile.compile(model, **NO_INDUCTOR)(ids, use_cache=False).logits
        assert _cosine(got, reference(ids, use_cache=False).logits) >= 0.999
    torch._dynamo.reset()


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
