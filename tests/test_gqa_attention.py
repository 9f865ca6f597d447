"""gqa_attention on Dynamo graphs of the tiny HF families: HF's repeat_kv before SDPA becomes enable_gqa where a
fused kernel takes it (patched to say so here: CPUs run SDPA's math either way), with the same output."""
import pytest
import torch
from hf_moe import FAMILIES, dynamo_graphs, tiny_moe, token_ids

from moecompile.passes import gqa_attention as pass_module
from moecompile.passes.nodes import arg, kind
from moecompile.passes.pipeline import PassContext

REPEATS_HEADS = ("tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-olmoe")  # fewer kv heads than heads


def _sdpa(gm):
    return [n for n in gm.graph.nodes if kind(n) == "sdpa"]


@pytest.mark.parametrize("family", FAMILIES)
def test_repeated_heads_become_enable_gqa_with_the_same_output(family, monkeypatch):
    monkeypatch.setattr(pass_module, "fused_kernel_takes_gqa", lambda *args: True)
    ((gm, inputs),) = dynamo_graphs(tiny_moe(family), token_ids(batch=2, length=3), use_cache=False)
    with torch.no_grad():
        before = gm(*inputs)
    expands = sum(kind(n) == "expand" for n in gm.graph.nodes)
    report = pass_module.gqa_attention(gm, PassContext())
    gm.graph.lint()
    gm.recompile()
    layers = len(_sdpa(gm))
    if family in REPEATS_HEADS:
        assert len(report["rewritten"]) == layers == 2
        assert all(arg(n, "enable_gqa") for n in _sdpa(gm))
        assert sum(kind(n) == "expand" for n in gm.graph.nodes) == expands - 2 * layers  # k and v copies gone
        for n in _sdpa(gm):  # key / value: the cache's own heads
            assert arg(n, "key").meta["example_value"].shape[1] < arg(n, "query").meta["example_value"].shape[1]
    else:  # DeepSeek-V3's MLA: a key/value head per head; GPT-OSS: its own attention with sinks
        assert report["rewritten"] == []
    with torch.no_grad():
        after = gm(*inputs)
    torch.testing.assert_close(after[0], before[0], rtol=1e-5, atol=1e-6)


def test_left_alone_where_no_fused_kernel_takes_it_and_in_training():
    ((gm, _),) = dynamo_graphs(tiny_moe("tiny-qwen3-moe"), token_ids(), use_cache=False)
    key = torch.zeros(1, 1, 4, 8)  # CPU tensors: no fused CUDA kernel
    assert not pass_module.fused_kernel_takes_gqa(torch.zeros(1, 2, 1, 8), key, key, None, 0.0, False)
    assert pass_module.gqa_attention(gm, PassContext()) == {"rewritten": []}
    assert pass_module.gqa_attention(gm, PassContext(training=True)) == {"skipped": "training graph"}
    assert not any(arg(n, "enable_gqa") for n in _sdpa(gm))
