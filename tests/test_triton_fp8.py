"""FP8 block-scaled grouped GEMM kernels against a dequantise-then-float32 reference (TRITON_INTERPRET on CPU)."""
import pytest
import torch

from moecompile.kernels import triton_fp8
from moecompile.kernels.activations import expert_activation


def _block_quantize(w):
    """[E, N, K] -> fp8 weights and [E, N/128, K/128] scale_inv (128x128 blocks)."""
    e, n, k = w.shape
    blocks = w.reshape(e, n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(e, n, k)
    return q, scale


def _block_dequantize(q, scale):
    e, n, k = q.shape
    return (q.float().reshape(e, n // 128, 128, k // 128, 128) * scale[:, :, None, :, None]).reshape(e, n, k)


def _row_dequantize(q, scale):
    return (q.float().reshape(q.shape[0], -1, 128) * scale.unsqueeze(-1)).reshape(q.shape)


def test_quantize_rows_roundtrip():
    x = torch.randn(5, 256) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0]).unsqueeze(1)
    q, s = triton_fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2)
    torch.testing.assert_close(_row_dequantize(q, s), x, rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("activation,gated,bias", [("silu", True, False), ("gelu_tanh", False, True)])
def test_experts_fp8_matches_dequantised_reference(activation, gated, bias):
    gen = torch.Generator().manual_seed(0)
    counts = [9, 0, 14]
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    rows, hidden, width, e = 26, 128, 128, 3  # 3 dropped rows at the end
    x = torch.randn(rows, hidden, generator=gen)
    w_in = torch.randn(e, 2 * width if gated else width, hidden, generator=gen) * hidden ** -0.5
    w_out = torch.randn(e, hidden, width, generator=gen) * width ** -0.5
    b_in = torch.randn(e, w_in.shape[1], generator=gen) * 0.1 if bias else None
    b_out = torch.randn(e, hidden, generator=gen) * 0.1 if bias else None
    xq, xs = triton_fp8.quantize_rows(x)
    w_in_q, w_in_s = _block_quantize(w_in)
    w_out_q, w_out_s = _block_quantize(w_out)
    y = triton_fp8.experts_fp8(xq, xs, offsets, w_in_q, w_in_s, b_in, w_out_q, w_out_s, b_out, activation, gated,
                               torch.float32)
    kept = int(offsets[-1])
    expert = torch.searchsorted(offsets, torch.arange(kept, dtype=torch.int32), right=True)
    xd = _row_dequantize(xq, xs)[:kept]
    h = torch.einsum("rh,rfh->rf", xd, _block_dequantize(w_in_q, w_in_s)[expert])
    if bias:
        h = h + b_in[expert]
    a = expert_activation(activation, gated, h)
    aq, as_ = triton_fp8.quantize_rows(a)
    want = torch.einsum("ri,rhi->rh", _row_dequantize(aq, as_), _block_dequantize(w_out_q, w_out_s)[expert])
    if bias:
        want = want + b_out[expert]
    rel = (y[:kept] - want).norm() / want.norm()
    assert rel < 1e-2
    # and against the unquantised float32 FFN: FP8's own error stays small
    exact = torch.einsum("ri,rhi->rh", expert_activation(activation, gated, torch.einsum(
        "rh,rfh->rf", x[:kept], w_in[expert]) + (b_in[expert] if bias else 0)), w_out[expert])
    if bias:
        exact = exact + b_out[expert]
    assert (y[:kept] - exact).norm() / exact.norm() < 6e-2
