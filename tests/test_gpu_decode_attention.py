"""moecompile::decode_attention on CUDA (the split-KV Triton kernel) against the float32 reference at the decode
benches' head shapes and cache lengths, and a captured decode step with the option on (device only)."""
import pytest
import torch
from hf_moe import tiny_moe, token_ids

from moecompile import backend
from moecompile.generation import Generator
from moecompile.ir import ops
from moecompile.kernels import reference as R

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch,heads,kv_heads,length,filled", [
    (1, 32, 4, 160, 129),  # Qwen3-30B-A3B at batch 1, a 128-token prompt: one run per head or a few
    (64, 32, 4, 4224, 4097),  # batch 64 at a 4k context: the long-context bar
    (1, 32, 8, 4224, 1000),  # Mixtral's heads, one sequence over a long cache: many runs merged
    (3, 6, 6, 77, 50),  # one key/value head per query head, odd lengths
])
def test_cuda_decode_attention_matches_reference(batch, heads, kv_heads, length, filled):
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(batch, heads, 1, 128, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(batch, kv_heads, length, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    mask = (torch.arange(length, device="cuda") < filled).expand(batch, 1, 1, length).clone()
    mask[0, ..., : filled // 3] = False  # a left-padded row
    got = ops.decode_attention(q, k, v, mask, 128 ** -0.5)
    want = R.decode_attention(q.float(), k.float(), v.float(), mask, 128 ** -0.5)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-mixtral"])
@pytest.mark.parametrize("batch", [1, 16])
def test_captured_decode_step_with_decode_attention_gives_the_sdpa_steps_tokens(family, batch):
    model = tiny_moe(family).to("cuda", torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    ids = token_ids(batch=batch, length=7).cuda()
    want = Generator(model, batch, 13, options={"inductor": False})(ids, 6)
    backend.clear_records()
    gen = Generator(model, batch, 13, options={"inductor": False, "decode_attention": True})
    got = gen(ids, 6)
    assert len(gen._graphs) == 1
    assert any(dict(r.reports)["decode_attention"].get("rewritten") for r in backend.records())
    assert torch.equal(got[:, :8], want[:, :8])  # the prompt and the prefill's token (column 7): the same graph
    assert (got[:, 8] == want[:, 8]).float().mean().item() >= 0.9  # the step's first: bf16 sums in another order
