"""Triton kernels against the reference, on CPU through TRITON_INTERPRET=1 (set in conftest) at tiny sizes."""
import pytest
import torch

from moecompile.kernels import reference as R
from moecompile.kernels import triton_moe
from moecompile.kernels.activations import expert_activation


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_expert_activation_matches_reference(activation, gated, bias):
    gen = torch.Generator().manual_seed(1)
    counts = [4, 0, 6, 3]  # an empty expert; 13 rows of which the last 2 are dropped
    offsets = _offsets(counts)
    rows, width = 15, 10
    h = torch.randn(rows, 2 * width if gated else width, generator=gen) * 3
    b = torch.randn(len(counts), h.shape[1], generator=gen) if bias else None
    got = triton_moe.expert_activation(h, offsets, b, activation, gated, block_m=16, block_n=16)
    expert = torch.searchsorted(offsets, torch.arange(rows, dtype=torch.int32), right=True).clamp_max(3)
    pre = h + b[expert] if bias else h
    want = expert_activation(activation, gated, pre)
    torch.testing.assert_close(got[:13], want[:13], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_combine_matches_reference_and_skips_dropped_rows(top_k):
    gen = torch.Generator().manual_seed(2)
    tokens, experts, hidden = 7, 3, 12
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = R.route(logits, top_k, 0.5, True)  # capacity 0.5: some assignments dropped
    assert (ids == experts).any()
    x = torch.randn(tokens, hidden, generator=gen)
    rows, order, offsets = R.dispatch(x, ids, experts)
    y = torch.randn(rows.shape[0], hidden, generator=gen)
    y[int(offsets[-1]):] = float("nan")  # a device experts kernel may leave dropped rows unspecified
    got = triton_moe.combine(y, order, weights, block_t=8, block_h=16)
    want = R.combine(y, order, weights)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_combine_empty_batch():
    y = torch.zeros(0, 4)
    out = triton_moe.combine(y, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2))
    assert out.shape == (0, 4)
