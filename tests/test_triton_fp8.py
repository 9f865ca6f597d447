"""FP8 block-scaled grouped GEMM kernels against a dequantise-then-float32 reference (TRITON_INTERPRET on CPU)."""
import pytest
import torch

from moecompile.core import fp8_format as fp8_math
from moecompile.core.activations import expert_activation
from moecompile.kernels import triton_fp8


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


def _layer(gated, bias):
    gen = torch.Generator().manual_seed(0)
    counts = [9, 0, 40]  # an empty expert; with BLOCK_M 16, 2 x 4 tiles for the 4 persistent programs (CPU)
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    rows, hidden, width, e = 52, 256, 256, 3  # 3 dropped rows at the end
    x = torch.randn(rows, hidden, generator=gen)
    w_in = torch.randn(e, 2 * width if gated else width, hidden, generator=gen) * hidden ** -0.5
    w_out = torch.randn(e, hidden, width, generator=gen) * width ** -0.5
    b_in = torch.randn(e, w_in.shape[1], generator=gen) * 0.1 if bias else None
    b_out = torch.randn(e, hidden, generator=gen) * 0.1 if bias else None
    return x, offsets, w_in, b_in, w_out, b_out


def _experts_of(offsets):
    kept = int(offsets[-1])
    return torch.searchsorted(offsets, torch.arange(kept, dtype=torch.int32), right=True)


def _first(x, offsets, w_in, b_in, activation, gated):
    """act(x W_in^T + b_in) in float32, each kept row with its expert's weights (rows in expert order)."""
    expert = _experts_of(offsets)
    h = torch.einsum("rh,rfh->rf", x[:len(expert)], w_in[expert])
    return expert_activation(activation, gated, h + b_in[expert] if b_in is not None else h)


def _second(a, offsets, w_out, b_out):
    expert = _experts_of(offsets)
    y = torch.einsum("ri,rhi->rh", a[:len(expert)], w_out[expert])
    return y + b_out[expert] if b_out is not None else y


@pytest.mark.parametrize("activation,gated,bias", [("silu", True, False), ("gelu_tanh", False, True)])
def test_experts_fp8_matches_dequantised_reference(activation, gated, bias):
    x, offsets, w_in, b_in, w_out, b_out = _layer(gated, bias)
    xq, xs = triton_fp8.quantize_rows(x)
    w_in_q, w_in_s = _block_quantize(w_in)
    w_out_q, w_out_s = _block_quantize(w_out)
    y = triton_fp8.experts_fp8(xq, xs, offsets, w_in_q, w_in_s, b_in, w_out_q, w_out_s, b_out, activation, gated,
                               torch.float32)
    kept = int(offsets[-1])
    a = _first(_row_dequantize(xq, xs), offsets, _block_dequantize(w_in_q, w_in_s), b_in, activation, gated)
    want = _second(_row_dequantize(*triton_fp8.quantize_rows(a)), offsets, _block_dequantize(w_out_q, w_out_s), b_out)
    assert (y[:kept] - want).norm() / want.norm() < 1e-2
    # and against the unquantised float32 FFN: FP8's own error stays small
    exact = _second(_first(x, offsets, w_in, b_in, activation, gated), offsets, w_out, b_out)
    assert (y[:kept] - exact).norm() / exact.norm() < 8e-2  # e4m3: ~6% on random gated FFNs (tests/test_fp8.py)


def test_requantize_rows_keeps_values_within_one_rounding():
    x = torch.randn(6, 384) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0, 2.0]).unsqueeze(1)
    x[5, 200:] *= 1e-3  # a row whose groups differ a lot in scale
    q, s = triton_fp8.quantize_rows(x)
    rq, rs = triton_fp8.requantize_rows(q, s)
    assert rq.dtype == torch.float8_e4m3fn and rs.shape == (6,)
    torch.testing.assert_close(rs, s.amax(1))
    back = rq.float() * rs.unsqueeze(1)
    big = x.abs() >= rs.unsqueeze(1) * 2 ** -6 * 448  # e4m3's normal range under the row's scale
    torch.testing.assert_close(back[big], x[big], rtol=0.13, atol=0)  # two roundings of <= 2^-4 each
    assert (back - x).abs().max() <= (rs * 2 ** -9 * 448).max() + 0.13 * x.abs().max()


def test_rowwise_from_blocks_scales_each_output_channel():
    w = torch.randn(2, 256, 384) * torch.linspace(0.01, 3.0, 384)  # block scales that differ along K
    q, s = _block_quantize(w)
    rq, rs = fp8_math.rowwise_from_blocks(q, s)
    assert rq.shape == q.shape and rs.shape == (2, 256)
    dense = _block_dequantize(q, s)
    torch.testing.assert_close(rs, dense.abs().amax(-1) / 448.0)
    rel = (rq.float() * rs.unsqueeze(-1) - dense).norm() / dense.norm()
    assert rel < 0.05


@pytest.mark.parametrize("activation,gated,bias", [("silu", True, False), ("gelu_tanh", False, True)])
def test_experts_fp8_rowwise_matches_dequantised_reference(activation, gated, bias):
    x, offsets, w_in, b_in, w_out, b_out = _layer(gated, bias)
    xq, xs = triton_fp8.requantize_rows(*triton_fp8.quantize_rows(x))
    w_in_q, w_in_s = fp8_math.rowwise_from_blocks(*_block_quantize(w_in))
    w_out_q, w_out_s = fp8_math.rowwise_from_blocks(*_block_quantize(w_out))
    y = triton_fp8.experts_fp8_rowwise(xq, xs, offsets, w_in_q, w_in_s, b_in, w_out_q, w_out_s, b_out, activation,
                                       gated, torch.float32)
    kept = int(offsets[-1])
    # the same math in float32 on the dequantised operands, activations rounded as the kernel rounds them
    a = _first(xq.float() * xs[:, None], offsets, w_in_q.float() * w_in_s[..., None], b_in, activation, gated)
    aq, as_ = triton_fp8.requantize_rows(*triton_fp8.quantize_rows(a))
    want = _second(aq.float() * as_[:, None], offsets, w_out_q.float() * w_out_s[..., None], b_out)
    assert (y[:kept] - want).norm() / want.norm() < 1e-2
    exact = _second(_first(x, offsets, w_in, b_in, activation, gated), offsets, w_out, b_out)
    # 8.6% / 7.0% here: x, the activations and the weights are each rounded twice
    assert (y[:kept] - exact).norm() / exact.norm() < 1e-1


def test_rowwise_weights_are_converted_once_per_weight_tensor():
    from moecompile.runtime import fp8 as rt_fp8

    w, s = _block_quantize(torch.randn(2, 256, 128))
    first = rt_fp8._rowwise_weights(w, s)
    assert rt_fp8._rowwise_weights(w, s) is first  # cached
    torch.testing.assert_close(first[1], fp8_math.rowwise_from_blocks(w, s)[1])
    s.mul_(2.0)  # an in-place change of the scales: converted again
    again = rt_fp8._rowwise_weights(w, s)
    assert again is not first
    torch.testing.assert_close(again[1], first[1] * 2.0)
    key = (id(w), fp8_math.rowwise_from_blocks)
    del w, first, again
    assert key not in rt_fp8._CONVERTED_WEIGHTS  # dropped with its weight


def test_converted_weights_are_kept_only_while_memory_allows(monkeypatch):
    """Beside a model that fills the GPU the converted copy is made per call, not kept: the cache would double the
    expert weights (Mixtral-8x7B in FP8 ran out of memory at its first batch prefill)."""
    from moecompile.runtime import choices
    from moecompile.runtime import fp8 as rt_fp8

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 20)  # 10 held by the allocator, unused
    share = choices.CONVERTED_WEIGHTS_MIN_FREE_SHARE
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (share * 100 - 10, 100))
    assert rt_fp8._room_to_keep(cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (share * 100 - 11, 100))
    assert not rt_fp8._room_to_keep(cuda)
    assert rt_fp8._room_to_keep(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # nothing kept while capturing
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100, 100))
    assert not rt_fp8._room_to_keep(cuda)

    monkeypatch.setattr(rt_fp8, "_room_to_keep", lambda device: False)
    w, s = _block_quantize(torch.randn(2, 256, 128))
    first = rt_fp8._rowwise_weights(w, s)
    assert rt_fp8._rowwise_weights(w, s) is not first and (id(w), fp8_math.rowwise_from_blocks) not in \
        rt_fp8._CONVERTED_WEIGHTS
    torch.testing.assert_close(rt_fp8._rowwise_weights(w, s)[1], first[1])


def test_auto_takes_the_block_math_where_rowwise_copies_cannot_be_kept(monkeypatch):
    """The rowwise math runs on per-channel weight copies: kept ones, or where there is room to keep them; else the
    block math, which reads the weights as stored (a model that fills the GPU would convert them at every call)."""
    from moecompile.runtime import fp8 as rt_fp8

    w_in, s_in = _block_quantize(torch.randn(2, 256, 128))
    w_out, s_out = _block_quantize(torch.randn(2, 128, 128))
    monkeypatch.setattr(rt_fp8, "_room_to_keep", lambda device: False)
    assert not rt_fp8._rowwise_affordable(w_in, s_in, w_out, s_out)
    monkeypatch.setattr(rt_fp8, "_room_to_keep", lambda device: True)
    assert rt_fp8._rowwise_affordable(w_in, s_in, w_out, s_out)
    rt_fp8._rowwise_weights(w_in, s_in)  # both kept now
    rt_fp8._rowwise_weights(w_out, s_out)
    monkeypatch.setattr(rt_fp8, "_room_to_keep", lambda device: False)
    assert rt_fp8._rowwise_affordable(w_in, s_in, w_out, s_out)  # the kept copies serve
    s_out.mul_(2.0)  # a changed weight's copy is stale: not kept any more
    assert not rt_fp8._rowwise_affordable(w_in, s_in, w_out, s_out)


def test_block_batches_fall_back_to_triton_when_gluon_does_not_build(monkeypatch, caplog):
    """runtime/fp8.py's FP8 dispatch as on an H200 (faked here): block-scaled batches go to the Gluon kernel; when
    this Triton's Gluon rejects it (an experimental dialect: builtins get renamed), one warning, then the Triton block
    kernel, and the Gluon kernel is not tried again."""
    from moecompile.kernels import gluon_fp8
    from moecompile.runtime import choices
    from moecompile.runtime import fp8 as rt_fp8

    calls = []

    def broken(*args, **kwargs):
        calls.append("gluon")
        raise AttributeError("module 'tma' has no attribute 'async_copy_global_to_shared'")

    def triton_block(*args):
        calls.append("triton")
        return "triton block"

    monkeypatch.setattr(choices, "FP8_GEMM", "block")
    monkeypatch.setattr(choices, "FP8_BLOCK_KERNEL", "gluon")
    monkeypatch.setattr(rt_fp8, "_GLUON_UNUSABLE", [])
    monkeypatch.setattr(rt_fp8, "_fp8_gemm_supported", lambda x: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(gluon_fp8, "experts_fp8", broken)
    monkeypatch.setattr(triton_fp8, "experts_fp8", triton_block)
    e, h, f, n = 2, 128, 128, 256  # 128 rows per expert: a batch
    w_in, w_in_s = _block_quantize(torch.randn(e, 2 * f, h))
    w_out, w_out_s = _block_quantize(torch.randn(e, h, f))
    xq, xs = fp8_math.quantize_groups(torch.randn(n, h))
    args = (xq, xs, torch.tensor([100, n], dtype=torch.int32), w_in, w_in_s, None, w_out, w_out_s, None, "silu", True,
            torch.bfloat16)
    assert rt_fp8.experts_fp8(*args) == "triton block" and calls == ["gluon", "triton"]
    assert len(rt_fp8._GLUON_UNUSABLE) == 1 and "does not build with this Triton" in caplog.text
    assert rt_fp8.experts_fp8(*args) == "triton block" and calls == ["gluon", "triton", "triton"]


@pytest.mark.parametrize("activation,gated,bias", [("silu", True, False), ("gelu", False, True), ("relu", True, True)])
def test_activation_quantize_matches_reference(activation, gated, bias):
    """The pass between the two CUTLASS GEMMs: bias of each row's expert, activation, per row per 128 channels
    quantised."""
    gen = torch.Generator().manual_seed(1)
    offsets = torch.tensor([9, 9, 49], dtype=torch.int32)  # an empty expert; 3 dropped rows at the end
    width = 256
    h = torch.randn(52, 2 * width if gated else width, generator=gen) * 3
    b_in = torch.randn(3, h.shape[1], generator=gen) if bias else None
    q, s = triton_fp8.activation_quantize(h, offsets, b_in, activation, gated)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (52, width) and s.shape == (52, 2)
    kept = int(offsets[-1])
    expert = _experts_of(offsets)
    want = expert_activation(activation, gated, h[:kept] + b_in[expert] if bias else h[:kept])
    want_q, want_s = fp8_math.quantize_groups(want)
    torch.testing.assert_close(s[:kept], want_s, rtol=1e-5, atol=0)
    # the same e4m3 codes but for values within an ulp of a rounding boundary (activations computed in another order)
    assert (q[:kept].float() != want_q.float()).float().mean() < 1e-3
    got, want = _row_dequantize(q[:kept], s[:kept]), _row_dequantize(want_q, want_s)
    # and those one step apart: 2^-3 relative for normal codes, one subnormal step (2^-9 of the group scale) near 0
    step = torch.maximum(want.abs() / 8, 2.0 ** -9 * want_s.repeat_interleave(128, dim=1))
    assert ((got - want).abs() <= step * (1 + 1e-5)).all()


def test_block_batches_try_cutlass_first_and_fall_back_once(monkeypatch, caplog):
    """MOECOMPILE_FP8_BLOCK_KERNEL=auto as on an H200 (faked here): CUTLASS first; when its library cannot be built
    (no nvcc, no headers), one warning and the Gluon kernel, and CUTLASS is not tried again."""
    from moecompile.kernels import cutlass_fp8, gluon_fp8
    from moecompile.runtime import choices
    from moecompile.runtime import fp8 as rt_fp8

    calls = []

    def unbuildable():
        calls.append("cutlass")
        raise cutlass_fp8.CutlassUnavailable("nvcc not found (set CUDA_HOME or put nvcc on PATH)")

    monkeypatch.setattr(choices, "FP8_GEMM", "block")
    monkeypatch.setattr(choices, "FP8_BLOCK_KERNEL", "auto")
    monkeypatch.setattr(rt_fp8, "_CUTLASS_UNUSABLE", [])
    monkeypatch.setattr(rt_fp8, "_GLUON_UNUSABLE", [])
    monkeypatch.setattr(rt_fp8, "_fp8_gemm_supported", lambda x: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(rt_fp8, "cutlass_library", unbuildable)
    monkeypatch.setattr(gluon_fp8, "experts_fp8", lambda *a, **k: calls.append("gluon") or "gluon")
    e, h, f, n = 2, 128, 128, 256
    w_in, w_in_s = _block_quantize(torch.randn(e, 2 * f, h))
    w_out, w_out_s = _block_quantize(torch.randn(e, h, f))
    xq, xs = fp8_math.quantize_groups(torch.randn(n, h))
    args = (xq, xs, torch.tensor([100, n], dtype=torch.int32), w_in, w_in_s, None, w_out, w_out_s, None, "silu", True,
            torch.bfloat16)
    monkeypatch.setattr(rt_fp8, "_converted_weights", lambda w, s, convert: w)  # the Gluon weight layout: not needed
    assert rt_fp8.experts_fp8(*args) == "gluon" and calls == ["cutlass", "gluon"]
    assert len(rt_fp8._CUTLASS_UNUSABLE) == 1 and "CUTLASS FP8 kernel is not available (nvcc not found" in caplog.text
    assert rt_fp8.experts_fp8(*args) == "gluon" and calls == ["cutlass", "gluon", "gluon"]
