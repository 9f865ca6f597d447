"""kernels/triton_decode_attention.py against SDPA's math on the CPU (Triton's interpreter), float32."""
import pytest
import torch

from moecompile.kernels import triton_decode_attention as A

CASES = {  # name: (batch, heads, kv_heads, length, key_dim, value_dim, splits)
    "batch 1, grouped heads, one run": (1, 8, 2, 40, 32, 32, 1),
    "odd length, several runs": (3, 4, 4, 37, 16, 16, 3),
    "more runs than blocks": (2, 6, 3, 20, 16, 16, 8),
    "one key/value head for all query heads": (2, 16, 1, 70, 32, 32, 2),
    "key and value widths differ, odd": (2, 4, 2, 33, 24, 40, 2),
}


def _reference(q, k, v, mask, scale):
    n = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(n, dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale + torch.where(mask[:, None, None, :], 0.0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _inputs(batch, heads, kv_heads, length, key_dim, value_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, key_dim, generator=gen)
    k = torch.randn(batch, kv_heads, length, key_dim, generator=gen)
    v = torch.randn(batch, kv_heads, length, value_dim, generator=gen)
    mask = torch.rand(batch, length, generator=gen) < 0.7  # holes, as left padding and unfilled positions make
    mask[:, -1] = True  # every row keeps its own token
    return q, k, v, mask


@pytest.mark.parametrize("case", CASES)
def test_decode_attention_matches_softmax_attention(case):
    batch, heads, kv_heads, length, key_dim, value_dim, splits = CASES[case]
    q, k, v, mask = _inputs(batch, heads, kv_heads, length, key_dim, value_dim, seed=len(case))
    got = A.decode_attention(q, k, v, mask, key_dim ** -0.5, splits, block_l=16)
    torch.testing.assert_close(got, _reference(q, k, v, mask, key_dim ** -0.5), rtol=1e-5, atol=1e-5)


def test_decode_attention_reads_a_cache_slice_and_a_broadcast_mask():
    """The filled part of a larger static cache (strided along positions and heads) under one mask row shared by
    the batch (stride 0), as a graph hands them over."""
    q, k, v, _ = _inputs(2, 4, 2, 64, 16, 16, seed=5)
    k, v = k[:, :, :45], v[:, :, :45]
    mask = (torch.arange(45) % 3 != 0).expand(2, 45)
    got = A.decode_attention(q, k, v, mask, 0.25, splits=2, block_l=16)
    torch.testing.assert_close(got, _reference(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)


def test_decode_attention_without_a_mask_attends_everywhere():
    q, k, v, _ = _inputs(2, 8, 4, 50, 16, 16, seed=8)
    for splits in (1, 3):
        got = A.decode_attention(q, k, v, None, 0.3, splits=splits, block_l=16)
        torch.testing.assert_close(got, _reference(q, k, v, torch.ones(2, 50, dtype=torch.bool), 0.3), rtol=1e-5,
                                   atol=1e-5)


def test_decode_attention_of_a_row_that_keeps_nothing_is_zero():
    """Every run of the first sequence is masked out (SDPA would give NaN); the second keeps only its last token."""
    q, k, v, mask = _inputs(2, 4, 2, 48, 16, 16, seed=6)
    mask[0] = False
    mask[1] = False
    mask[1, -1] = True
    got = A.decode_attention(q, k, v, mask, 0.25, splits=3, block_l=16)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got[1], v[1, :, -1:].repeat_interleave(2, dim=0), rtol=1e-6, atol=1e-6)


def test_decode_attention_rejects_what_it_does_not_compute():
    q, k, v, mask = _inputs(1, 6, 4, 16, 16, 16, seed=7)
    with pytest.raises(ValueError, match="H a multiple of KV"):
        A.decode_attention(q, k, v, mask, 1.0, splits=1)
    with pytest.raises(ValueError, match="one query token"):
        A.decode_attention(torch.randn(1, 4, 2, 16), k[:, :2], v[:, :2], mask, 1.0, splits=1)
