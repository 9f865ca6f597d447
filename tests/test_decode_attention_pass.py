"""The decode_attention pass (option decode_attention): SDPA of a one-token query -> moecompile::decode_attention on
Dynamo graphs, the same output; the op's reference kernel against SDPA; greedy decoding with the option equal to
HF's tokens (float32, CPU)."""
import pytest
import torch
from hf_moe import FAMILIES, dynamo_graphs, tiny_moe, token_ids

from moecompile.ir import ops
from moecompile.kernels import reference
from moecompile.passes.decode_attention import decode_attention
from moecompile.passes.nodes import kind
from moecompile.passes.pipeline import PassContext


def _repeat(x, n):  # HF's repeat_kv
    b, kv, length, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n, length, d).reshape(b, kv * n, length, d)


class Attention(torch.nn.Module):
    """SDPA as HF's attention calls it at a decode step: key / value heads repeated under a boolean mask, or
    unrepeated with enable_gqa."""

    def __init__(self, repeat: bool, is_causal: bool = False):
        super().__init__()
        self.repeat, self.is_causal = repeat, is_causal

    def forward(self, q, k, v, mask):
        n = q.shape[1] // k.shape[1]
        if self.repeat:
            k, v = _repeat(k, n), _repeat(v, n)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                                                is_causal=self.is_causal, enable_gqa=not self.repeat)


def _inputs(queries=1, mask_batch=3):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, queries, 16, generator=gen)
    k, v = (torch.randn(3, 2, 20, 16, generator=gen) for _ in range(2))
    mask = torch.rand(mask_batch, 1, queries, 20, generator=gen) < 0.6
    mask[..., -1] = True
    return q, k, v, mask


@pytest.mark.parametrize("repeat", [True, False], ids=["repeat_kv", "enable_gqa"])
@pytest.mark.parametrize("mask_batch", [3, 1])
def test_one_token_attention_becomes_the_op_with_the_same_output(repeat, mask_batch):
    inputs = _inputs(mask_batch=mask_batch)
    ((gm, example),) = dynamo_graphs(Attention(repeat), *inputs)
    with torch.no_grad():
        before = gm(*example)
    report = decode_attention(gm, PassContext())
    gm.graph.lint()
    gm.recompile()
    assert len(report["rewritten"]) == 1
    assert not [n for n in gm.graph.nodes if kind(n) in ("sdpa", "expand")]  # the repeated copies are gone too
    with torch.no_grad():
        torch.testing.assert_close(gm(*example)[0], before[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("what", ["two query tokens", "causal", "a float mask"])
def test_left_alone_where_the_op_would_compute_something_else(what):
    q, k, v, mask = _inputs(queries=2 if what == "two query tokens" else 1)
    if what == "a float mask":
        mask = torch.where(mask, 0.0, -1e9)
    ((gm, _),) = dynamo_graphs(Attention(True, is_causal=what == "causal"), q, k, v,
                               None if what == "causal" else mask)
    assert decode_attention(gm, PassContext()) == {"rewritten": []}
    assert decode_attention(gm, PassContext(training=True)) == {"skipped": "training graph"}


def test_left_alone_on_symbolic_shapes():
    """A graph traced with a dynamic batch: comparing its shapes would add guards after tracing, so SDPA stays."""
    q, k, v, mask = _inputs()
    for t in (q, k, v, mask):
        torch._dynamo.mark_dynamic(t, 0)
    ((gm, _),) = dynamo_graphs(Attention(True), q, k, v, mask)
    assert decode_attention(gm, PassContext()) == {"rewritten": []}


def test_reference_kernel_is_sdpa_and_gives_zero_where_nothing_is_kept():
    q, k, v, mask = _inputs()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(ops.decode_attention(q, k, v, mask, 0.3), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ops.decode_attention(q, k, v, None, 0.3),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True),
                               rtol=1e-5, atol=1e-6)
    mask[1] = False
    got = reference.decode_attention(q, k, v, mask, 0.3)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one query token"):
        ops.decode_attention(torch.randn(3, 8, 2, 16), k, v, None, 0.3)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_with_the_option_matches_hf(family):
    """Every family the backend recognises decodes HF's greedy tokens with the option on; the step's attention
    becomes the op where it is SDPA (not DeepSeek-V3's absorbed latent attention, nor GPT-OSS's attention with
    sinks)."""
    from moecompile import backend
    from moecompile.generation import generate

    model = tiny_moe(family, one_layer=True)
    model.generation_config.eos_token_id = None
    ids = token_ids(batch=2, length=6)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    backend.clear_records()
    got = generate(model, ids, 4, options={"inductor": False, "decode_attention": True})
    prefill, step = (dict(record.reports) for record in backend.records())
    assert bool(step["decode_attention"]["rewritten"]) == (family not in ("tiny-deepseek-v3", "tiny-gpt-oss"))
    assert not prefill["decode_attention"]["rewritten"]
    assert torch.equal(got, expected)
