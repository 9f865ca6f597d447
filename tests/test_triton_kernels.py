"""Triton kernels against the reference, on CPU through TRITON_INTERPRET=1 (set in conftest) at tiny sizes."""
import pytest
import torch

from moecompile.core.activations import expert_activation
from moecompile.kernels import reference as R
from moecompile.kernels import triton_moe


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


@pytest.mark.parametrize("tokens", [7, 70])  # 70 x k > SEARCH_ROWS: the inverse permutation, else the search
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_combine_matches_reference_and_skips_dropped_rows(top_k, tokens):
    gen = torch.Generator().manual_seed(2)
    experts, hidden = 3, 12
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


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_expert_activation_backward_matches_autograd(activation, gated, bias):
    gen = torch.Generator().manual_seed(3)
    offsets = _offsets([5, 0, 4])  # 9 kept rows, 3 dropped
    rows, width = 12, 6
    h = torch.randn(rows, 2 * width if gated else width, generator=gen) * 2
    b = torch.randn(3, h.shape[1], generator=gen) if bias else None
    grad_a = torch.randn(rows, width, generator=gen)
    a, grad_h = triton_moe.expert_activation_backward(h, offsets, b, grad_a, activation, gated, block_m=16, block_n=8)
    expert = torch.searchsorted(offsets, torch.arange(rows, dtype=torch.int32), right=True).clamp_max(2)
    hv = h.clone().requires_grad_()
    want_a = expert_activation(activation, gated, hv + b[expert] if bias else hv)
    (want_grad,) = torch.autograd.grad(want_a[:9], hv, grad_a[:9])
    torch.testing.assert_close(a[:9], want_a[:9].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_h, want_grad, atol=1e-5, rtol=1e-5)  # dropped rows: zero


def test_combine_backward_and_gather_sum_match_reference():
    gen = torch.Generator().manual_seed(4)
    tokens, experts, hidden, top_k = 9, 4, 20, 2
    weights, ids = R.route(torch.randn(tokens, experts, generator=gen), top_k, 0.6, True)
    assert (ids == experts).any()
    rows, order, offsets = R.dispatch(torch.randn(tokens, hidden, generator=gen), ids, experts)
    y = torch.randn(rows.shape[0], hidden, generator=gen)
    grad_out = torch.randn(tokens, hidden, generator=gen)
    got_rows, got_w = triton_moe.combine_backward(grad_out, y, order, weights, block_t=8, block_h=8)
    want_rows, want_w = R.combine_backward(grad_out, y, order, weights)
    torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_rows, want_rows, atol=1e-6, rtol=1e-6)
    grad_sorted = torch.randn(rows.shape[0], hidden, generator=gen)
    torch.testing.assert_close(triton_moe.gather_sum(grad_sorted, order, tokens, top_k),
                               R.dispatch_backward(grad_sorted, order, tokens, top_k), atol=1e-5, rtol=1e-5)


# 1: the grid holds only tiles that can hold a row (the decode configs); 16: more than this problem's M tiles
@pytest.mark.parametrize("group_m", [1, 2, 16])
@pytest.mark.parametrize("variant", list(triton_moe.GROUPED_GEMMS))
def test_grouped_projection_without_activation(variant, group_m):
    """activation None: the plain second projection x W^T + b per expert group (rows past the groups untouched)."""
    gen = torch.Generator().manual_seed(6)
    offsets = _offsets([7, 0, 18, 2])
    x = torch.randn(30, 40, generator=gen)
    w, b = torch.randn(4, 24, 40, generator=gen), torch.randn(4, 24, generator=gen)
    got = triton_moe.grouped_ffn_in(x, offsets, w, b, None, False,
                                    config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": group_m},
                                    variant=variant)
    expert = torch.searchsorted(offsets, torch.arange(27, dtype=torch.int32), right=True)
    torch.testing.assert_close(got[:27], torch.einsum("rh,rfh->rf", x[:27], w[expert]) + b[expert],
                               atol=1e-4, rtol=1e-4)


# (experts, top_k, capacity factor, logits skew): dropped assignments, k = E, every token to one expert (+ empty ones)
@pytest.mark.parametrize("experts,top_k,capacity,skew", [(4, 2, 0.6, 0.0), (3, 3, 0.0, 0.0), (5, 1, 0.0, 50.0)])
@pytest.mark.parametrize("variant", list(triton_moe.GROUPED_GEMMS))
def test_second_projection_with_the_combine_scattered(variant, experts, top_k, capacity, skew):
    """scatter=: the weighted combine folded into the second projection's store, against the projection followed by
    the reference combine (float32 adds: the interpreter has no bf16 atomics; tests/test_gpu.py runs those)."""
    gen = torch.Generator().manual_seed(7)
    tokens, hidden, width = 13, 24, 20
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] += skew
    weights, ids = R.route(logits, top_k, capacity, True)
    a_tokens = torch.randn(tokens, hidden, generator=gen)
    a, order, offsets = R.dispatch(a_tokens, ids, experts)
    w, b = torch.randn(experts, width, hidden, generator=gen) * 0.3, torch.randn(experts, width, generator=gen)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}
    want = R.combine(triton_moe.grouped_ffn_in(a, offsets, w, b, None, False, config=config, variant=variant), order,
                     weights)
    row_weights = weights.reshape(-1).index_select(0, order).float()
    out = torch.zeros(tokens, width)
    got = triton_moe.grouped_ffn_in(a, offsets, w, b, None, False, config=config, variant=variant,
                                    scatter=((order // top_k).to(torch.int32), row_weights, out))
    assert got is out
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", list(triton_moe.GROUPED_GEMMS))
@pytest.mark.parametrize("activation,gated,bias", [("silu", True, False), ("gelu_tanh", False, True),
                                                   ("relu", True, True), ("gelu", False, False)])
def test_grouped_ffn_in_matches_reference(activation, gated, bias, variant):
    gen = torch.Generator().manual_seed(5)
    counts = [20, 0, 9, 3]  # empty expert, groups not multiples of the tile, 4 dropped rows after
    offsets = _offsets(counts)
    rows, hidden, width = 36, 24, 20
    x = torch.randn(rows, hidden, generator=gen)
    w_in = torch.randn(4, 2 * width if gated else width, hidden, generator=gen) * 0.3
    b_in = torch.randn(4, w_in.shape[1], generator=gen) if bias else None
    got = triton_moe.grouped_ffn_in(x, offsets, w_in, b_in, activation, gated,
                                    config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, variant=variant)
    kept = int(offsets[-1])
    expert = torch.searchsorted(offsets, torch.arange(kept, dtype=torch.int32), right=True)
    h = torch.einsum("rh,rfh->rf", x[:kept], w_in[expert])
    if bias:
        h = h + b_in[expert]
    torch.testing.assert_close(got[:kept], expert_activation(activation, gated, h), atol=1e-4, rtol=1e-4)


def test_cuda_kernel_choice_follows_the_measurements(monkeypatch):
    from moecompile.runtime import choices as C

    monkeypatch.setattr(C, "FFN_IN", "auto")
    monkeypatch.setattr(C, "FFN_OUT", "auto")
    kernels = C.expert_gemm_kernels
    assert kernels(32768, 7168, 2048, 256) == ("quack", "quack")  # DeepSeek-V3, batch: the row copy costs less
    assert kernels(196608, 1536, 256, 128) == ("quack_gathered", "quack")  # SonicMoE's 7B shape, batch
    assert kernels(262144, 4096, 512, 128) == ("quack_gathered", "quack")  # SonicMoE's 30B shape, batch
    assert kernels(8192, 4096, 14336, 8) == ("triton_persistent", "triton_persistent")  # Mixtral, batch
    assert kernels(8192, 4096, 14336, 8, training=True) == ("quack", "quack")  # Mixtral, training steps measured
    assert kernels(128, 4096, 14336, 8) == ("triton_decode", "triton_decode")  # Mixtral, decode
    assert kernels(128, 4096, 14336, 8, training=True) == ("triton_decode", "triton_decode")
    assert kernels(65536, 2048, 1408, 60, training=True) == ("triton_persistent", "triton_persistent")  # no train entry
    assert kernels(65536, 2048, 1408, 60) == ("triton_persistent", "triton_persistent")  # Qwen2-MoE, batch
    assert kernels(65536, 2048, 768, 128) == ("quack_gathered", "quack")  # Qwen3-MoE (Triton without QuACK)
    assert kernels(65536, 2048, 768, 128, training=True) == ("quack", "quack")  # its train entry
    assert kernels(4096, 1000, 500, 8) == ("triton_persistent", "triton_persistent")  # unmeasured, batch
    assert kernels(64, 1000, 500, 8) == ("triton_decode", "triton_decode")  # unmeasured, decode
    monkeypatch.setattr(C, "FFN_OUT", "triton")
    assert kernels(64, 1000, 500, 8) == ("triton_decode", "triton")  # an explicit choice wins


def test_expert_gemm_choices_are_data_of_known_kernels():
    """Every tuned expert GEMM choice names a kernel the runtime runs for its projection, in a regime it knows, for a
    shape key it parses: a typo in the data would otherwise be a KeyError at some user's first batch."""
    from moecompile.core import settings
    from moecompile.runtime import choices as C

    default, tuned = C.expert_gemm_table()
    assert set(default) == {"batch", "decode"}
    for (hidden, expert_size, experts, regime), (first, second) in [
            *(((0, 0, 0, name), pair) for name, pair in default.items()), *tuned.items()]:
        assert regime in ("batch", "decode", "train")
        assert first in settings.FIRST_PROJECTION_GEMMS and first != "auto"
        assert second in settings.EXPERT_GEMMS and second != "auto"


def test_quack_gathered_falls_back_with_quack(monkeypatch):
    """Where QuACK cannot run (here: no CUDA), a layer choosing quack_gathered runs the fallback kernel for both
    projections, and experts_gathered reads a copy of its rows: the same output as experts on dispatched rows."""
    from moecompile.kernels import reference as R
    from moecompile.runtime import choices as C
    from moecompile.runtime import cuda

    monkeypatch.setattr(C, "FFN_IN", "quack_gathered")
    monkeypatch.setattr(C, "FFN_OUT", "quack")
    gen = torch.Generator().manual_seed(3)
    e, h, i, k, tokens = 4, 32, 48, 2, 9
    x = torch.randn(tokens, h, generator=gen)
    w_in, w_out = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    assert cuda._projection_kernels(x, w_in, w_out, "silu", True) == (C.QUACK_FALLBACK, C.QUACK_FALLBACK)
    order = torch.randperm(tokens * k, generator=gen)
    offsets = torch.tensor([5, 5, 12, tokens * k], dtype=torch.int32)
    got = cuda.experts_gathered(x, order, offsets, k, w_in, None, w_out, None, "silu", True)
    want = R.experts(x[order // k], offsets, w_in, None, w_out, None, "silu", True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_quack_tile_configurations_are_data_of_known_fields():
    """Every tuned QuACK configuration names GemmConfig's fields, so the GPU path can build one from it; a GEMM not
    in the table gets None (QuACK's default)."""
    from moecompile.runtime import choices as C

    fields = {"tile_m", "tile_n", "pingpong", "is_dynamic_persistent", "cluster_m", "cluster_n", "swap_ab",
              "max_swizzle_size", "device_capacity", "use_tma_gather"}
    table = C._quack_table()
    assert table, "kernels/configs/quack_gemm.json holds no tuned configuration"
    for key, config in table.items():
        projection, k, n, *rest = key.split(",")
        assert C.quack_config(projection, int(k[2:]), int(n[2:]), gathered=rest == ["gathered"]) == config
        assert set(config) <= fields and config["tile_m"] % 64 == 0 and config["tile_n"] % 16 == 0
    assert C.quack_config("second", 768, 2048) is not None  # Qwen3-MoE's second projection was tuned
    assert C.quack_config("first", 3, 5) is None


def test_quack_concatenated_columns_put_gate_columns_first():
    """QuACK's gated tensors alternate gate / up columns; the bias gradient goes back to W_in's [gate | up] order."""
    from moecompile.kernels import quack_gemm

    gate, up = torch.randn(3, 5), torch.randn(3, 5)
    alternating = torch.stack((gate, up), dim=-1).flatten(-2)
    assert torch.equal(quack_gemm.concatenated_columns(alternating), torch.cat((gate, up), dim=-1))


@pytest.mark.parametrize("counts", [[4, 0, 6, 3], [5, 0, 0, 10], [0, 0, 0, 0]])  # dropped tail, none, all
def test_zero_rows_past_groups_touches_only_the_dropped_rows(counts):
    t = torch.randn(15, 320)[:, :300]  # a row stride wider than the rows
    want = t.clone()
    want[sum(counts):] = 0
    assert torch.equal(triton_moe.zero_rows_past_groups(t, _offsets(counts), block_r=4, block_c=128), want)


def test_quack_backward_configurations_are_looked_up_by_gemm_name(monkeypatch):
    """The training backward's QuACK GEMMs find their tuned configurations under their own names and sizes."""
    from moecompile.runtime import choices as C

    table = {"data,k=8,n=4": {"tile_m": 128}, "input,k=16,n=8": {"tile_m": 64}, "second,k=4,n=8": {"tile_m": 192}}
    monkeypatch.setattr(C, "_quack_table", lambda: table)
    assert C.quack_backward_configs(8, 4, 16) == {"data": {"tile_m": 128}, "weight_out": None, "weight_in": None,
                                                  "input": {"tile_m": 64}}


def test_quack_combined_backward_configurations_read_the_gathered_entries(monkeypatch):
    """The folded backward's data and weight_out GEMMs gather the combine's gradient: their own tuned entries."""
    from moecompile.runtime import choices as C

    table = {"data,k=8,n=4,gathered": {"tile_m": 128}, "data,k=8,n=4": {"tile_m": 64}, "input,k=16,n=8": {"x": 1}}
    monkeypatch.setattr(C, "_quack_table", lambda: table)
    assert C.quack_backward_configs(8, 4, 16, combined=True) == {"data": {"tile_m": 128}, "weight_out": None,
                                                                 "weight_in": None, "input": {"x": 1}}


@pytest.mark.parametrize("setting, tuned, folds", [("auto", ("data", "weight_out"), True), ("auto", ("data",), False),
                                                    ("on", (), True), ("off", ("data", "weight_out"), False)])
def test_fold_combine_setting(monkeypatch, setting, tuned, folds):
    """auto folds the combine's backward only where both gathered backward GEMMs have tuned configurations."""
    from moecompile.runtime import choices as C

    monkeypatch.setattr(C, "FOLD_COMBINE", setting)
    monkeypatch.setattr(C, "_quack_table", lambda: {f"{name},k=8,n=4,gathered": {"tile_m": 128} for name in tuned})
    assert C.folds_combine(8, 4, 16) is folds


def test_programmatic_launch_setting(monkeypatch):
    """MOECOMPILE_PDL: auto by default, else on or off; anything else is a one-line error. Tensors off the GPU never
    launch as programmatic dependents, whatever the setting."""
    from moecompile.core import settings
    from moecompile.core.errors import MoECompileError
    from moecompile.runtime import choices as C

    monkeypatch.delenv("MOECOMPILE_PDL", raising=False)
    assert settings.programmatic_launch() == "auto"
    for value in ("on", "off"):
        monkeypatch.setenv("MOECOMPILE_PDL", value)
        assert settings.programmatic_launch() == value
    monkeypatch.setenv("MOECOMPILE_PDL", "1")
    with pytest.raises(MoECompileError, match="^MOECOMPILE_PDL='1': expected one of auto, on, off$"):
        settings.programmatic_launch()
    for value in ("auto", "on", "off"):
        monkeypatch.setattr(C, "PROGRAMMATIC_LAUNCH", value)
        assert C.programmatic_launch(torch.zeros(1)) is False


def _alternating(t):
    """[gate | up] columns -> gate / up pairs (QuACK's gated layout)."""
    return torch.stack(t.chunk(2, dim=-1), dim=-1).flatten(-2)


def _quack_combined_backward_emulated(grad_out, tokens, scores, x, cu, w_in, w_out, h, activation, configs):
    """quack_gemm.combined_backward as QuACK's epilogues compute it, in plain PyTorch (what the GPU test checks on
    the device): rows past the last group are left as NaN, as an unwritten output would hold garbage."""
    from moecompile.core.activations import expert_activation, expert_activation_backward
    from moecompile.kernels import quack_gemm

    nan = float("nan")
    grad_x, grad_h = torch.full_like(x, nan), torch.full_like(h, nan)
    grad_scores = torch.full((x.shape[0],), nan, dtype=torch.float32)
    grad_w_in, grad_w_out = torch.zeros_like(w_in), torch.zeros_like(w_out)
    for e in range(w_in.shape[0]):
        r = slice(int(cu[e]), int(cu[e + 1]))
        g = grad_out[tokens[r].long()]
        pre = quack_gemm.concatenated_columns(h[r])
        d = g @ w_out[e]
        a = expert_activation(activation, True, pre)
        grad_scores[r] = (a * d).sum(-1)
        dh = expert_activation_backward(activation, True, pre, d * scores[r, None])
        grad_h[r] = _alternating(dh)
        grad_w_out[e] = g.t() @ (a * scores[r, None])
        grad_w_in[e] = dh.t() @ x[r]
        grad_x[r] = dh @ w_in[e]
    return grad_x, grad_w_in, grad_w_out, grad_h, grad_scores


@pytest.mark.parametrize("capacity_factor,bias_in", [(0.0, False), (1.0, True), (0.5, False)])
def test_folded_combine_backward_bookkeeping_matches_reference(monkeypatch, capacity_factor, bias_in):
    """runtime/cuda's fold of the combine's backward into the QuACK backward, QuACK emulated: the rows' tokens and
    scores handed to it, the routing weights' gradient scattered back from its rows (dropped slots zero, whatever
    the unwritten rows hold), grad_x's dropped rows zeroed, b_in's gradient back in [gate | up] order."""
    from moecompile.kernels import grouped_mm, quack_gemm
    from moecompile.runtime import choices
    from moecompile.runtime import cuda as C

    monkeypatch.setattr(choices, "FOLD_COMBINE", "on")
    monkeypatch.setattr(grouped_mm, "supported", lambda *a: True)
    monkeypatch.setattr(C, "_trains_on_quack", lambda *a: True)
    monkeypatch.setattr(quack_gemm, "combined_backward", _quack_combined_backward_emulated)
    gen = torch.Generator().manual_seed(5)
    tokens, e, k, hidden, width = 11, 4, 2, 6, 5
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w_in = torch.randn(e, 2 * width, hidden, generator=gen, dtype=torch.float64)
    w_out = torch.randn(e, hidden, width, generator=gen, dtype=torch.float64)
    b_in = torch.randn(e, 2 * width, generator=gen, dtype=torch.float64) if bias_in else None
    weights, ids = R.route(torch.randn(tokens, e, generator=gen), k, capacity_factor, True)
    weights = weights.double()
    rows, order, offsets = R.dispatch(x, ids, e)
    y, h_ref = R.experts_train(rows, offsets, w_in, b_in, w_out, None, "silu", True)
    h = _alternating(h_ref + (b_in[grouped_mm.row_expert(offsets, rows.shape[0]).clamp_max(e - 1)]
                              if bias_in else 0))
    grad_out = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    got = C.experts_combine_backward(grad_out, rows, offsets, order, weights, w_in, b_in, w_out, "silu", True,
                                     False, h, y)
    want = R.experts_combine_backward(grad_out, rows, offsets, order, weights, w_in, b_in, w_out, "silu", True,
                                      False, None, y)
    for name, g, w in zip(("x", "weights", "w_in", "b_in", "w_out", "b_out"), got, want):
        assert (g is None) == (w is None), name
        if g is not None:
            # float32 on the way: the scores' gradient out of QuACK, the bias gradient's segment sum
            tol = 1e-5 if name in ("weights", "b_in") else 1e-9
            torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    if capacity_factor:
        assert int(offsets[-1]) < rows.shape[0]  # the case has dropped slots


@pytest.mark.parametrize("tokens,capacity_factor,copy_rows", [(300, 0.0, False), (300, 0.0, True), (5, 0.0, False),
                                                             (300, 1.0, False), (2, 0.0, True)])
def test_cuda_route_dispatch_batch_path_matches_the_reference(monkeypatch, tokens, capacity_factor, copy_rows):
    """runtime/cuda's route_dispatch off CUDA (its Triton kernels interpreted): dropless batches through the ranked
    top-k (dispatch's rank kernel folded in), drops and the one-launch dispatch through top-k, then dispatch."""
    from moecompile.kernels import triton_routing
    from moecompile.runtime import cuda as C

    monkeypatch.setattr(C, "_routable", lambda *a: True)
    monkeypatch.setattr(triton_routing, "route_dispatch_fits", lambda *a: False)  # not the decode kernel
    ranked, topk = [], triton_routing.topk

    def recorded_topk(*args, **kwargs):
        ranked.append(kwargs.get("ranked", False))
        return topk(*args, **kwargs)

    monkeypatch.setattr(triton_routing, "topk", recorded_topk)
    gen = torch.Generator().manual_seed(tokens)
    hidden, weight = torch.randn(tokens, 16, generator=gen), torch.randn(32, 16, generator=gen)
    routing = (4, capacity_factor, True, "softmax", None, 1, 1, 1.0, True, copy_rows)
    got, want = C.route_dispatch(hidden, weight, None, *routing), R.route_dispatch(hidden, weight, None, *routing)
    for name, g, w in zip(("weights", "ids", "rows", "order", "offsets"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    assert ranked == [not capacity_factor and triton_routing.sorts_by_counting(tokens * 4, copy_rows)]


@pytest.mark.parametrize("logits_fp32", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_route_dispatch_backward_matches_the_reference(logits_fp32, dtype):
    """runtime/cuda's route_dispatch_backward (the rows' gradient by a per-token gather, the router's GEMMs as
    core/logits.py runs them) against the reference kernel, off CUDA: the same math; on CUDA, 16-bit operands take
    the tensor cores (tests/test_gpu.py)."""
    from moecompile.runtime import cuda as C

    gen = torch.Generator().manual_seed(8)
    hidden, weight, bias = (torch.randn(*s, generator=gen).to(dtype) for s in ((11, 16), (6, 16), (6,)))
    routing = (3, 1.0, True, "softmax", None, 1, 1, 1.0, logits_fp32)  # capacity 1.0: some slots dropped
    weights, ids, rows, order, _ = R.route_dispatch(hidden, weight, bias, *routing)
    assert (ids == 6).any()
    grad_w, grad_rows = torch.randn(weights.shape, generator=gen), torch.randn(rows.shape, generator=gen).to(dtype)
    args = (grad_w, grad_rows, hidden, weight, bias, ids, order, 3, True, "softmax", None, 1, 1, 1.0, logits_fp32)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(C.route_dispatch_backward(*args), R.route_dispatch_backward(*args)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
