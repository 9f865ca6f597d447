"""A native FP8 upcycle run by transformers' own FP8 kernels on CUDA (marker gpu: run on the device with
`pytest -m gpu tests/test_gpu_native_fp8.py`; needs accelerate, as transformers' FineGrainedFP8 loader does).

A small bf16 LLaMA (HF's default init, dimensions multiples of 128 as the FP8 block kernels want) is upcycled on the
CPU straight into Mixtral with FP8 experts, then loaded by plain transformers on the GPU: its FP8Experts must be used
(not the dequantising fallback). Its logits are compared with the dense bf16 model whose FFN weights are the stored
FP8 blocks times their scales (what the kernels should compute, up to activation quantisation), cosine >= 0.999, and
with the dense bf16 model itself, cosine >= 0.995: on random weights e4m3's 3 mantissa bits alone cost that much
(the FP8 math simulated in float32 on the CPU: 0.99917 with FP8 weights, 0.99879 with FP8 activations too).

transformers fetches those kernels from the Hub (kernels-community/finegrained-fp8, through the `kernels` package). On
a machine without the Hub, MOECOMPILE_FP8_KERNEL_DIR may name a folder holding that kernel's `finegrained_fp8`
package as kernel-builder lays it out (the Triton sources of kernels-community's finegrained-fp8/torch-ext and the
`_ops.py` naming its op namespace): it is handed to transformers as the download would be.
"""
import copy
import importlib
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.gpu


def _hopper_or_newer() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _hopper_or_newer(), reason="transformers' FP8 kernels need compute capability >= 8.9")
def test_transformers_runs_native_fp8_upcycle_on_cuda(tmp_path, monkeypatch):
    import transformers
    from transformers.integrations.finegrained_fp8 import FP8Experts

    from moecompile.conversion.native import upcycle_native
    from moecompile.core.fp8_format import dequantize_blocks

    _offline_kernel(monkeypatch)
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    dense.save_pretrained(tmp_path / "dense")
    upcycle_native(tmp_path / "dense", tmp_path / "fp8", experts=4, top_k=2, fp8=True, progress=False)

    moe = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", device_map="cuda").eval()
    assert not moe.hf_quantizer.quantization_config.dequantize  # the FP8 path, not the bf16 fallback
    assert all(isinstance(layer.mlp.experts, FP8Experts) for layer in moe.model.layers)
    assert moe.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    dense = dense.cuda()
    reference = copy.deepcopy(dense)  # the dense model with the FP8 weights the experts hold (all copies alike)
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    for i, layer in enumerate(reference.model.layers):
        for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            name = f"model.layers.{i}.block_sparse_moe.experts.0.{mine}.weight"
            getattr(layer.mlp, theirs).weight.data = dequantize_blocks(
                stored[name], stored[f"{name}_scale_inv"], dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        got, want, exact = (m(ids).logits.float() for m in (moe, dense, reference))
    kernel, end_to_end = _cosine(got, exact), _cosine(got, want)
    print(f"\nFP8 native upcycle on CUDA: logits cosine {kernel:.5f} vs its FP8 weights in bf16, {end_to_end:.5f} vs "
          "the dense bf16 model")
    assert kernel >= 0.999
    assert end_to_end >= 0.995


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def _offline_kernel(monkeypatch) -> None:
    """Register a local copy of the Hub's finegrained-fp8 kernel where transformers' loader looks first."""
    folder = os.environ.get("MOECOMPILE_FP8_KERNEL_DIR")
    if not folder:
        return
    from transformers.integrations import finegrained_fp8, hub_kernels

    monkeypatch.syspath_prepend(folder)
    sys.modules.pop("finegrained_fp8", None)
    kernel = importlib.import_module("finegrained_fp8")
    monkeypatch.setitem(hub_kernels._KERNEL_MODULE_MAPPING, "finegrained-fp8", kernel)
    monkeypatch.setattr(finegrained_fp8, "is_kernels_available", lambda *a, **k: True)
