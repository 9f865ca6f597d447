"""GPU runtime on CUDA (marker gpu: deselected in CI, run on the device with `pytest -m gpu`).

The CUDA kernels (grouped_mm + Triton) against float32 references on fresh random inputs, capacity modes,
backward, CUDA-graph capture and the absence of host synchronisation.
"""
import importlib.util

import pytest
import torch

from moecompile import MoEBlock, MoEConfig
from moecompile.core.logits import float32_logits
from moecompile.ir import ops
from moecompile.kernels import quack_gemm, triton_moe, triton_routing
from moecompile.kernels import reference as R
from moecompile.runtime import choices, graphs
from moecompile.runtime import cuda as C
from moecompile.runtime import fp8 as RF

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _weights(e, h, i, gated, bias, gen):
    f = 2 * i if gated else i
    w_in = torch.randn(e, f, h, generator=gen, device=DEVICE) * h ** -0.5
    w_out = torch.randn(e, h, i, generator=gen, device=DEVICE) * i ** -0.5
    b_in = torch.randn(e, f, generator=gen, device=DEVICE) * 0.1 if bias else None
    b_out = torch.randn(e, h, generator=gen, device=DEVICE) * 0.1 if bias else None
    return w_in, b_in, w_out, b_out


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _bf16(*ts):
    return [None if t is None else t.bfloat16() for t in ts]


@pytest.mark.parametrize("activation,gated", [("silu", True), ("gelu_tanh", False), ("gelu", False), ("relu", True)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0, -1.5])
@pytest.mark.parametrize("ffn_in,ffn_out", [("triton_tma", "grouped_mm"), ("triton", "grouped_mm"),
                                             ("grouped_mm", "grouped_mm"), ("triton_tma", "triton_tma"),
                                             ("triton_persistent", "triton_persistent")])
def test_cuda_layer_matches_float32_reference(activation, gated, bias, capacity_factor, ffn_in, ffn_out,
                                              monkeypatch):
    monkeypatch.setattr(choices, "FFN_IN", ffn_in)
    monkeypatch.setattr(choices, "FFN_OUT", ffn_out)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    tokens, e, k, h, i = 1000, 8, 2, 256, 512
    w_in, b_in, w_out, b_out = _weights(e, h, i, gated, bias, gen)
    x = torch.randn(tokens, h, generator=gen, device=DEVICE)
    logits = torch.randn(tokens, e, generator=gen, device=DEVICE)
    weights, ids = ops.route(logits, k, capacity_factor, True)
    xb, w_in_b, b_in_b, w_out_b, b_out_b = _bf16(x, w_in, b_in, w_out, b_out)
    rows, order, offsets = ops.dispatch(xb, ids, e)
    y = C.experts(rows, offsets, w_in_b, b_in_b, w_out_b, b_out_b, activation, gated)
    out = C.combine(y, order, weights)
    # float32 reference from the same bf16-rounded inputs
    rows32, order32, offsets32 = R.dispatch(xb.float(), ids, e)
    y32 = R.experts(rows32, offsets32, *[None if t is None else t.float() for t in (w_in_b, b_in_b, w_out_b, b_out_b)],
                    activation, gated)
    ref = R.combine(y32, order32, weights)
    assert _rel(out, ref) <= 1e-2
    # every kept assignment appears exactly once, dropped ones last
    assert torch.equal(torch.sort(order).values, torch.arange(tokens * k, device=DEVICE))
    kept = int((ids < e).sum())
    assert int(offsets[-1]) == kept
    if capacity_factor == 0:
        assert kept == tokens * k


# the cutlass extra: without it the runtime's FP8 batches run the Gluon or Triton kernel instead
needs_cutlass = pytest.mark.skipif(importlib.util.find_spec("cutlass_library") is None,
                                   reason="the CUTLASS headers (the cutlass extra) are not installed")
needs_quack = pytest.mark.skipif(not (torch.cuda.is_available() and quack_gemm.available(torch.device(DEVICE))),
                                 reason="QuACK (the quack extra) is not installed or this GPU is not Hopper")


def _reference_layer(x, ids, weights, e, w_in, b_in, w_out, b_out, activation, gated):
    rows, order, offsets = R.dispatch(x.float(), ids, e)
    y = R.experts(rows, offsets, *[None if t is None else t.float() for t in (w_in, b_in, w_out, b_out)], activation,
                  gated)
    return R.combine(y, order, weights)


QUACK_CASES = ["random", "one_expert", "empty_experts", "k_equals_e", "dropped", "odd_tokens"]
QUACK_ACTIVATIONS = [("silu", True, False), ("silu", True, True), ("gelu_tanh", False, True), ("relu", True, False)]


def _quack_case(case, activation, gated, bias, monkeypatch):
    """(x, ids, weights, k, e, w_in, b_in, w_out, b_out) of one edge case, the runtime made to choose QuACK."""
    monkeypatch.setattr(choices, "FFN_IN", "quack")
    monkeypatch.setattr(choices, "FFN_OUT", "quack")
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    tokens, e, k, h, i = {"odd_tokens": 333, "k_equals_e": 200}.get(case, 1000), 8, 2, 256, 384
    k = e if case == "k_equals_e" else k
    w_in, b_in, w_out, b_out = _bf16(*_weights(e, h, i, gated, bias, gen))
    x = torch.randn(tokens, h, generator=gen, device=DEVICE).bfloat16()
    logits = torch.randn(tokens, e, generator=gen, device=DEVICE)
    if case == "one_expert":
        logits[:, 3] += 100.0
        k = 1
    if case == "empty_experts":
        logits[:, 4:] -= 100.0
    weights, ids = ops.route(logits, k, 1.0 if case == "dropped" else 0.0, True)
    assert C._projection_kernels(x, w_in, w_out, activation, gated) == ("quack", "quack")
    return x, ids, weights, k, e, w_in, b_in, w_out, b_out


@needs_quack
@pytest.mark.parametrize("activation,gated,bias", QUACK_ACTIVATIONS)
@pytest.mark.parametrize("case", QUACK_CASES)
def test_quack_expert_gemms_match_float32_reference(activation, gated, bias, case, monkeypatch):
    """QuACK's varlen GEMMs on dispatched rows (runtime choice "quack") and with gathered first-projection rows."""
    x, ids, weights, k, e, w_in, b_in, w_out, b_out = _quack_case(case, activation, gated, bias, monkeypatch)
    ref = _reference_layer(x, ids, weights, e, w_in, b_in, w_out, b_out, activation, gated)
    rows, order, offsets = ops.dispatch(x, ids, e)
    out = C.combine(C.experts(rows, offsets, w_in, b_in, w_out, b_out, activation, gated), order, weights)
    assert _rel(out, ref) <= 1e-2
    _, gather_order, gather_offsets = triton_routing.dispatch(x, ids, e, copy_rows=False)
    cu = triton_routing.group_starts(gather_offsets)
    a = quack_gemm.first_projection(x, cu, w_in, b_in, activation, gated,
                                    gather_rows=(gather_order // k).to(torch.int32))
    out = C.combine(quack_gemm.second_projection(a, cu, w_out, b_out), gather_order, weights)
    assert _rel(out, ref) <= 1e-2
    # the op gather_expert_rows emits, as the runtime runs it: on a copy of the rows under "quack", QuACK gathering
    # them under "quack_gathered" (route_dispatch's row copy off in both)
    for first in choices.QUACK_KERNELS:
        monkeypatch.setattr(choices, "FFN_IN", first)
        y = C.experts_gathered(x, gather_order, gather_offsets, k, w_in, b_in, w_out, b_out, activation, gated)
        assert _rel(C.combine(y, gather_order, weights), ref) <= 1e-2
    if gated:  # gate / up rows interleaved, and a tile configuration other than QuACK's default
        config = dict(tile_m=128, tile_n=128, cluster_m=1, cluster_n=1, pingpong=True, is_dynamic_persistent=False)
        w_mixed = torch.stack(w_in.chunk(2, dim=1), dim=2).flatten(1, 2)
        b_mixed = None if b_in is None else torch.stack(b_in.chunk(2, dim=1), dim=2).flatten(1, 2)
        a = quack_gemm.first_projection(x, cu, w_mixed, b_mixed, activation, gated, interleaved=True,
                                        gather_rows=(gather_order // k).to(torch.int32), config=config)
        out = C.combine(quack_gemm.second_projection(a, cu, w_out, b_out, config=config), gather_order, weights)
        assert _rel(out, ref) <= 1e-2


@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_cuda_backward_matches_reference(gated, bias):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    tokens, e, k, h, i = 512, 4, 2, 128, 256
    w_in, b_in, w_out, b_out = _weights(e, h, i, gated, bias, gen)
    x = torch.randn(tokens, h, generator=gen, device=DEVICE)
    weights, ids = ops.route(torch.randn(tokens, e, generator=gen, device=DEVICE), k, 1.0, True)
    rows, order, offsets = ops.dispatch(x.bfloat16(), ids, e)
    grad_y = torch.randn(rows.shape[0], h, generator=gen, device=DEVICE).bfloat16()
    grad_y[int(offsets[-1]):] = 0  # combine's backward gives dropped rows no gradient
    args = _bf16(w_in, b_in, w_out)
    got = C.experts_backward(grad_y, rows, offsets, *args, "silu", gated, bias)
    want = R.experts_backward(grad_y.float(), rows.float(), offsets, *[None if t is None else t.float() for t in args],
                              "silu", gated, bias)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert _rel(g, w) <= 2e-2


@needs_quack
@pytest.mark.parametrize("activation,gated,bias", QUACK_ACTIVATIONS)
@pytest.mark.parametrize("case", QUACK_CASES)
def test_quack_training_matches_float32_reference(activation, gated, bias, case, monkeypatch):
    """Training on QuACK: experts_train's output, then experts_backward's gradients from its kept h and from a
    recomputed one, against the float32 reference's (dropped rows get no gradient, empty experts zero)."""
    x, ids, weights, k, e, w_in, b_in, w_out, b_out = _quack_case(case, activation, gated, bias, monkeypatch)
    assert C._trains_on_quack(x, w_in, w_out, activation, gated)
    rows, order, offsets = ops.dispatch(x, ids, e)
    kept = int(offsets[-1])
    y, h_kept = C.experts_train(rows, offsets, w_in, b_in, w_out, b_out, activation, gated)
    rows32, args32 = rows.float(), [None if t is None else t.float() for t in (w_in, b_in, w_out, b_out)]
    assert _rel(y[:kept], R.experts(rows32, offsets, *args32, activation, gated)[:kept]) <= 1e-2
    grad_y = torch.randn(rows.shape, generator=torch.Generator(device=DEVICE).manual_seed(2), device=DEVICE)
    grad_y = grad_y.bfloat16().masked_fill_(torch.arange(rows.shape[0], device=DEVICE).unsqueeze(1) >= kept, 0)
    backward_args = (grad_y, rows, offsets, w_in, b_in, w_out, activation, gated, b_out is not None)
    want = R.experts_backward(grad_y.float(), rows32, offsets, args32[0], args32[1], args32[2], activation, gated,
                              b_out is not None)
    results = [C.experts_backward(*backward_args, h=h_kept), C.experts_backward(*backward_args)]
    if case == "random":  # tuned tile configurations (one other than QuACK's default) reach every backward GEMM
        config = dict(tile_m=128, tile_n=128, cluster_m=1, cluster_n=1, pingpong=True, is_dynamic_persistent=False)
        monkeypatch.setattr(choices, "quack_backward_configs", lambda *sizes: dict.fromkeys(
            ("data", "weight_out", "weight_in", "input"), config))
        results.append(C.experts_backward(*backward_args, h=h_kept))
    for got in results:
        for name, g, w in zip(("x", "w_in", "b_in", "w_out", "b_out"), got, want):
            assert (g is None) == (w is None), name
            if g is not None:
                assert _rel(g, w) <= 2e-2, name
        assert not got[0][kept:].any()  # dropped rows


# (activation, gated, biases): the combine's backward folds into QuACK's GEMMs for gated experts without b_out
COMBINED = [("silu", True, "none"), ("silu", True, "in"), ("relu", True, "none"), ("silu", True, "both"),
            ("gelu_tanh", False, "both")]


@needs_quack
@pytest.mark.parametrize("activation,gated,biases", COMBINED)
@pytest.mark.parametrize("case", QUACK_CASES)
def test_quack_combined_backward_matches_float32_reference(activation, gated, biases, case, monkeypatch):
    """experts_combine_train, then experts_combine_backward on CUDA: folded into QuACK's GEMMs (the combine's
    gradient read through each row's token, the routing weights' gradient from the data GEMM's epilogue) where the
    experts are gated without an output bias, else combine_backward then experts_backward; against the float32
    reference's gradients (dropped rows and their weights get none)."""
    x, ids, weights, k, e, w_in, b_in, w_out, b_out = _quack_case(case, activation, gated, biases != "none",
                                                                  monkeypatch)
    b_out = b_out if biases == "both" else None
    monkeypatch.setattr(choices, "FOLD_COMBINE", "on")
    folded, combined_backward = [], quack_gemm.combined_backward
    monkeypatch.setattr(quack_gemm, "combined_backward", lambda *a: folded.append(1) or combined_backward(*a))
    rows, order, offsets = ops.dispatch(x, ids, e)
    kept = int(offsets[-1])
    out, h, y = ops.experts_combine_train(rows, offsets, order, weights, w_in, b_in, w_out, b_out, activation, gated)
    assert _rel(out, _reference_layer(x, ids, weights, e, w_in, b_in, w_out, b_out, activation, gated)) <= 1e-2
    grad_out = torch.randn(out.shape, generator=torch.Generator(device=DEVICE).manual_seed(4), device=DEVICE)
    grad_out = grad_out.bfloat16()
    got = C.experts_combine_backward(grad_out, rows, offsets, order, weights, w_in, b_in, w_out, activation, gated,
                                     b_out is not None, h, y)
    assert bool(folded) == (gated and b_out is None)
    rows32, (w_in32, b_in32, w_out32, b_out32) = rows.float(), [None if t is None else t.float()
                                                                for t in (w_in, b_in, w_out, b_out)]
    y32 = R.experts(rows32, offsets, w_in32, b_in32, w_out32, b_out32, activation, gated)
    want = R.experts_combine_backward(grad_out.float(), rows32, offsets, order, weights, w_in32, b_in32, w_out32,
                                      activation, gated, b_out is not None, None, y32)
    for name, g, w in zip(("x", "weights", "w_in", "b_in", "w_out", "b_out"), got, want):
        assert (g is None) == (w is None), name
        if g is not None:
            assert g.dtype == w.dtype if name == "weights" else g.dtype == torch.bfloat16, name
            assert _rel(g, w) <= 2e-2, name
    assert not got[0][kept:].any()  # dropped rows
    assert not got[1][ids == e].any()  # dropped assignments' weights
    # through autograd, as the MoE modules train: the same gradients, and y kept only for a backward that reads it
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (rows, weights, w_in, b_in, w_out, b_out)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.data_ptr()) or t, lambda t: t):
        out, _, y = ops.experts_combine_train(*leaves[:1], offsets, order, *leaves[1:], activation, gated)
    assert (y.data_ptr() in saved) != bool(folded)
    out.backward(grad_out)
    if folded:  # a backward whose forward folded folds too, though the setting changed in between
        out, _, _ = ops.experts_combine_train(*leaves[:1], offsets, order, *leaves[1:], activation, gated)
        monkeypatch.setattr(choices, "FOLD_COMBINE", "off")
        out.backward(grad_out)
    for name, g, leaf in zip(("x", "weights", "w_in", "b_in", "w_out", "b_out"), got, leaves):
        if leaf is not None:
            assert _rel(leaf.grad, g * (2 if folded else 1)) <= 1e-3, name


@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_cuda_experts_train_keeps_h_for_the_backward(gated, bias, capacity_factor):
    """experts_train's output equals experts'; its h is the first projection; the backward given h equals the one
    that recomputes it and the float32 reference."""
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    tokens, e, k, h, i = 640, 8, 2, 128, 256
    w_in, b_in, w_out, b_out = _weights(e, h, i, gated, bias, gen)
    x = torch.randn(tokens, h, generator=gen, device=DEVICE)
    weights, ids = ops.route(torch.randn(tokens, e, generator=gen, device=DEVICE), k, capacity_factor, True)
    rows, order, offsets = ops.dispatch(x.bfloat16(), ids, e)
    args = _bf16(w_in, b_in, w_out, b_out)
    kept = int(offsets[-1])
    y, h_kept = C.experts_train(rows, offsets, *args, "silu", gated)
    assert _rel(y[:kept], C.experts(rows, offsets, *args, "silu", gated)[:kept]) <= 1e-2
    rows32, args32 = rows.float(), [None if t is None else t.float() for t in args]
    y32, h32 = R.experts_train(rows32, offsets, *args32, "silu", gated)
    assert _rel(y[:kept], y32[:kept]) <= 1e-2 and _rel(h_kept[:kept], h32[:kept]) <= 1e-2
    grad_y = torch.randn(rows.shape[0], h, generator=gen, device=DEVICE).bfloat16()
    grad_y[kept:] = 0  # combine's backward gives dropped rows no gradient
    backward_args = (grad_y, rows, offsets, args[0], args[1], args[2], "silu", gated, bias)
    with_h = C.experts_backward(*backward_args, h=h_kept)
    recomputed = C.experts_backward(*backward_args)
    want = R.experts_backward(grad_y.float(), rows32, offsets, args32[0], args32[1], args32[2], "silu", gated, bias)
    for g, g_recomputed, w in zip(with_h, recomputed, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert torch.equal(g, g_recomputed)  # the same GEMMs on the same h: bit-identical
            assert _rel(g, w) <= 2e-2


def test_block_training_step_runs_experts_train_and_matches_float32(moe_op_log):
    """A training-mode MoEBlock on the GPU keeps h (experts_combine_train) and its gradients match the float32
    block's."""
    torch.manual_seed(3)
    block = _block().train()
    ref = _block().float().train()
    ref.load_state_dict({n: p.float() for n, p in block.state_dict().items()})
    xb = torch.randn(2, 256, 256, device=DEVICE).bfloat16().requires_grad_()
    x32 = xb.detach().float().requires_grad_()
    with moe_op_log() as log:
        out = block(xb)
    assert "moecompile::experts_combine_train" in log.names and "moecompile::experts" not in log.names
    out.float().square().sum().backward()
    ref(x32).square().sum().backward()
    assert _rel(xb.grad, x32.grad) <= 2e-2
    for (name, p), p32 in zip(block.named_parameters(), ref.parameters()):
        assert _rel(p.grad, p32.grad) <= 2e-2, name


def _block(gated=True, bias=False, e=8, k=2, capacity_factor=0.0):
    cfg = MoEConfig(hidden_size=256, expert_size=512, num_experts=e, top_k=k, capacity_factor=capacity_factor,
                    activation="silu" if gated else "gelu_tanh", gated=gated, bias_in=bias,
                    bias_out="expert" if bias else "none")
    return MoEBlock(cfg).to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.25])
def test_block_forward_has_no_host_sync_and_captures_in_a_cuda_graph(capacity_factor):
    torch.manual_seed(0)
    block = _block(capacity_factor=capacity_factor).eval()
    x = torch.randn(4, 128, 256, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = block(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
        try:
            block(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        static_x = x.clone()
        graph, static_y = graphs.capture(lambda: block(static_x))
        graph.replay()
        torch.testing.assert_close(static_y, eager)
        static_x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(static_y, block(static_x))


def test_block_training_step_on_gpu_matches_reference_kernels(monkeypatch):
    torch.manual_seed(0)
    block = _block(gated=False, bias=True).train()
    x = torch.randn(2, 64, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    (block(x).float().square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    gx = x.grad.clone()
    block.zero_grad()
    x.grad = None
    monkeypatch.setenv("MOECOMPILE_KERNELS", "reference")
    (block(x).float().square().mean()).backward()
    assert _rel(gx, x.grad) <= 2e-2
    for n, p in block.named_parameters():
        assert _rel(grads[n], p.grad) <= 3e-2, n


# block batches on sm_90 run CUTLASS or the Gluon kernel, decode (20 tokens) the Triton block kernel
FP8_PATHS = [("block", "cutlass"), ("block", "gluon"), ("rowwise", "auto")]
# the kernels themselves: CUTLASS's needs its headers (an FP8 block falls back without them, as the test below runs)
FP8_KERNEL_PATHS = [pytest.param(*path, marks=needs_cutlass) if path[1] == "cutlass" else path for path in FP8_PATHS]


@pytest.mark.parametrize("gemm,block_kernel", FP8_KERNEL_PATHS)
@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
@pytest.mark.parametrize("tokens", [700, 20])
def test_fp8_kernels_match_reference(gated, bias, gemm, block_kernel, tokens, monkeypatch):
    from moecompile.kernels import cutlass_fp8

    monkeypatch.setattr(choices, "FP8_GEMM", gemm)
    monkeypatch.setattr(choices, "FP8_BLOCK_KERNEL", block_kernel)
    cutlass_calls, cutlass_gemm = [], cutlass_fp8.grouped_gemm
    monkeypatch.setattr(cutlass_fp8, "grouped_gemm", lambda *a: cutlass_calls.append(1) or cutlass_gemm(*a))
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    e, k, h, i = 4, 2, 256, 384
    w_in, b_in, w_out, b_out = _weights(e, h, i, gated, bias, gen)
    from moecompile.core import fp8_format as F

    w_in_q, w_in_s = F.quantize_blocks(w_in)
    w_out_q, w_out_s = F.quantize_blocks(w_out)
    x = torch.randn(tokens, h, generator=gen, device=DEVICE).bfloat16()
    weights, ids = ops.route(torch.randn(tokens, e, generator=gen, device=DEVICE), k, 0.0, True)
    rows, order, offsets = ops.dispatch(x, ids, e)
    xq, xs = RF.quantize_fp8(rows, 128)
    rq, rs = R.quantize_fp8(rows, 128)
    assert _rel(xq.float() * xs.repeat_interleave(128, 1), rq.float() * rs.repeat_interleave(128, 1)) < 1e-2
    args = (xq, xs, offsets, w_in_q, w_in_s, b_in, w_out_q, w_out_s, b_out, "silu" if gated else "gelu", gated,
            torch.bfloat16)
    got = RF.experts_fp8(*args)
    want = R.experts_fp8(*args)
    kept = int(offsets[-1])
    print("fp8 kernel vs reference", gemm, block_kernel, _rel(got[:kept], want[:kept]))
    assert len(cutlass_calls) == (2 if block_kernel == "cutlass" and tokens * k >= 64 * e else 0)  # no fallback
    # block computes the reference's math (the Gluon kernel with one more rounding of the first projection's output,
    # test_gluon_fp8_matches_reference_math); rowwise rounds weights and activations once more (its exact math is
    # checked against a float32 reference in tests/test_triton_fp8.py)
    # (CUTLASS: the same math as block, the first projection's output rounded to bf16 before the activation)
    assert _rel(got[:kept], want[:kept]) <= (8e-2 if gemm == "rowwise" else 2e-2)
    exact = R.experts(rows.float(), offsets, w_in, b_in, w_out, b_out, "silu" if gated else "gelu", gated)
    # e4m3's own error on these random weights: the float32 reference of experts_fp8 is 6.4e-2 (gated) off too
    assert _rel(got[:kept], exact[:kept]) <= (1e-1 if gemm == "rowwise" else 8e-2)


def test_fp8_auto_runs_the_block_math_where_rowwise_copies_cannot_be_kept(monkeypatch):
    """A batch whose per-channel weight copies cannot be kept (a model that fills the GPU) runs the block math on the
    weights as stored, with the block math's error, and keeps no copy."""
    from moecompile.core import fp8_format as F
    from moecompile.kernels import triton_fp8
    from moecompile.runtime import fp8 as rt_fp8

    monkeypatch.setattr(choices, "FP8_GEMM", "auto")
    monkeypatch.setattr(rt_fp8, "_room_to_keep", lambda device: False)
    monkeypatch.setattr(triton_fp8, "experts_fp8_rowwise", lambda *a: pytest.fail("rowwise math without its copies"))
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    e, k, h, i, tokens = 4, 2, 256, 384, 700
    w_in, b_in, w_out, b_out = _weights(e, h, i, True, False, gen)
    (w_in_q, w_in_s), (w_out_q, w_out_s) = F.quantize_blocks(w_in), F.quantize_blocks(w_out)
    x = torch.randn(tokens, h, generator=gen, device=DEVICE).bfloat16()
    weights, ids = ops.route(torch.randn(tokens, e, generator=gen, device=DEVICE), k, 0.0, True)
    rows, order, offsets = ops.dispatch(x, ids, e)
    xq, xs = RF.quantize_fp8(rows, 128)
    args = (xq, xs, offsets, w_in_q, w_in_s, b_in, w_out_q, w_out_s, b_out, "silu", True, torch.bfloat16)
    got, want = RF.experts_fp8(*args), R.experts_fp8(*args)
    kept = int(offsets[-1])
    assert _rel(got[:kept], want[:kept]) <= 2e-2
    assert rt_fp8._kept(w_in_q, w_in_s, F.rowwise_from_blocks) is None


@pytest.mark.skipif(not _hopper(), reason="sm_90 only")
@pytest.mark.parametrize("counts,hidden,width", [
    ([0, 37, 300, 1], 256, 384),  # an empty expert, odd group sizes, K of 3 steps (fewer than the stages)
    ([0, 0, 513, 0], 384, 256),  # every row to one expert
    ([200], 128, 128),  # one expert, one K step
    ([64, 0, 129, 5, 0, 0, 700, 3], 512, 640)])
@pytest.mark.parametrize("activation,gated,bias", [("silu", True, False), ("gelu", False, True), ("relu", True, True)])
def test_gluon_fp8_matches_reference_math(counts, hidden, width, activation, gated, bias):
    """kernels/gluon_fp8.py against the reference experts_fp8 (the same block math in float32), groups of any size,
    with 10 input rows past offsets[-1] (dropped assignments: their outputs are unspecified)."""
    from moecompile.core import fp8_format as F
    from moecompile.kernels import gluon_fp8

    gen = torch.Generator(device=DEVICE).manual_seed(len(counts) + hidden)
    e = len(counts)
    w_in, b_in, w_out, b_out = _weights(e, hidden, width, gated, bias, gen)
    w_in_q, w_in_s = F.quantize_blocks(w_in)
    w_out_q, w_out_s = F.quantize_blocks(w_out)
    offsets = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    n = int(offsets[-1])
    xq, xs = RF.quantize_fp8(torch.randn(n + 10, hidden, generator=gen, device=DEVICE).bfloat16(), 128)
    b_in, b_out = _bf16(b_in, b_out)
    w_in_k = gluon_fp8.interleave_gate_up(w_in_q) if gated else w_in_q
    got = gluon_fp8.experts_fp8(xq, xs, offsets, w_in_k, w_in_s, b_in, w_out_q, w_out_s, b_out,
                                triton_moe.ACTIVATION_IDS[activation], gated, torch.bfloat16)
    want = R.experts_fp8(xq, xs, offsets, w_in_q, w_in_s, b_in, w_out_q, w_out_s, b_out, activation, gated,
                         torch.float32)
    print("gluon fp8 vs reference", counts, activation, _rel(got[:n], want[:n]))
    assert got.shape == (n + 10, hidden) and torch.isfinite(got[:n]).all()
    # the same math but for one more rounding: the kernel writes the first projection's output in bf16 before
    # quantising it per 128 channels, which moves ~3% of those fp8 values by one step (1.1e-2 measured, silu)
    assert _rel(got[:n], want[:n]) <= 2e-2


@needs_cutlass
@pytest.mark.skipif(not _hopper(), reason="sm_90 only")
@pytest.mark.parametrize("counts,hidden,width", [
    ([0, 37, 300, 1], 256, 384),  # an empty expert, odd group sizes
    ([0, 0, 513, 0], 384, 256),  # every row to one expert
    ([200], 128, 128),  # one expert, one K step
    ([64, 0, 129, 5, 0, 0, 700, 3], 512, 640)])
def test_cutlass_fp8_grouped_gemm_matches_reference_math(counts, hidden, width):
    """kernels/cutlass_fp8.py: one block-scaled grouped GEMM against the dequantised float32 product, groups of any
    size, 10 rows past offsets[-1] (left unspecified)."""
    from moecompile.core import fp8_format as F
    from moecompile.kernels import cutlass_fp8

    gen = torch.Generator(device=DEVICE).manual_seed(len(counts) + hidden)
    e = len(counts)
    w = torch.randn(e, width, hidden, generator=gen, device=DEVICE) * hidden ** -0.5
    w_q, w_s = F.quantize_blocks(w)
    offsets = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    n = int(offsets[-1])
    xq, xs = RF.quantize_fp8(torch.randn(n + 10, hidden, generator=gen, device=DEVICE).bfloat16(), 128)
    got = cutlass_fp8.grouped_gemm(xq, xs, offsets, w_q, cutlass_fp8.weight_scales(w_q, w_s), RF.cutlass_library())
    x = F.dequantize_groups(xq, xs)
    ends = offsets.tolist()
    want = torch.cat([x[end - count:end] @ F.dequantize_blocks(w_q[e], w_s[e]).t()
                      for e, (count, end) in enumerate(zip(counts, ends))])
    assert got.shape == (n + 10, width) and got.dtype == torch.bfloat16
    assert _rel(got[:n], want) <= 8e-3  # float32 accumulation; only the bf16 output rounding


@pytest.mark.parametrize("gemm,block_kernel", FP8_PATHS)
def test_fp8_block_dispatches_fp8_rows_on_gpu(gemm, block_kernel, monkeypatch):
    """An FP8 MoEBlock end to end on the GPU (tokens quantised before the dispatch, FP8 rows dispatched): close to
    the same block on the reference kernels, no host synchronisation."""
    from moecompile.ir import fp8

    monkeypatch.setattr(choices, "FP8_GEMM", gemm)
    monkeypatch.setattr(choices, "FP8_BLOCK_KERNEL", block_kernel)
    torch.manual_seed(0)
    block = MoEBlock(MoEConfig(hidden_size=256, expert_size=384, num_experts=8, top_k=2, activation="silu",
                               gated=True)).to(DEVICE, torch.bfloat16).eval()
    fp8.quantize(block)
    x = torch.randn(520, 256, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        got = block(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host synchronisation in the block's forward raises
        try:
            again = block(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(again, got, rtol=0, atol=0)
        monkeypatch.setenv("MOECOMPILE_KERNELS", "reference")
        want = block(x)
    print("fp8 block vs reference kernels", gemm, _rel(got, want))
    assert got.dtype == torch.bfloat16 and _rel(got, want) <= (8e-2 if gemm == "rowwise" else 2e-2)


@pytest.mark.parametrize("tokens,experts,top_k,capacity_factor", [(2048, 128, 8, 0.0), (1000, 8, 2, 1.0),
                                                                  (333, 6, 6, 0.0), (1, 8, 2, 0.0)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["triton_tma", "triton_persistent"])
def test_second_projection_scattering_the_combine_matches_float32_reference(tokens, experts, top_k, capacity_factor,
                                                                            out_dtype, variant):
    """The combine folded into the second projection's store by atomic adds, autotuned (its tuning runs zero the
    output in between), against the float32 projection and combine."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    hidden, width = 256, 512
    weights, ids = ops.route(torch.randn(tokens, experts, generator=gen, device=DEVICE), top_k, capacity_factor, True)
    a, order, offsets = ops.dispatch(torch.randn(tokens, width, generator=gen, device=DEVICE), ids, experts)
    w = torch.randn(experts, hidden, width, generator=gen, device=DEVICE) * width ** -0.5
    y, start = torch.zeros(a.shape[0], hidden, device=DEVICE), 0
    for e, end in enumerate(offsets.tolist()):
        y[start:end], start = a[start:end] @ w[e].t(), end
    want = R.combine(y, order, weights)
    out = torch.zeros(tokens, hidden, device=DEVICE, dtype=out_dtype)
    row_weights = weights.reshape(-1).index_select(0, order).float()
    got = triton_moe.grouped_ffn_in(a.bfloat16(), offsets, w.bfloat16(), None, None, False, variant=variant,
                                    scatter=((order // top_k).to(torch.int32), row_weights, out))
    assert _rel(got, want) <= (1e-2 if out_dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("tokens,experts,top_k", [(4096, 8, 2), (2048, 128, 8), (1024, 256, 8), (333, 6, 6),
                                                  (16384, 128, 8)])  # 2048 rank blocks: a scan of two steps
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0, -1.5])
def test_cuda_routing_matches_reference(tokens, experts, top_k, capacity_factor):
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    logits = torch.randn(tokens, experts, generator=gen, device=DEVICE)
    weights, ids = C.route(logits, top_k, capacity_factor, True)
    want_w, want_ids = R.route(logits, top_k, capacity_factor, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)
    x = torch.randn(tokens, 64, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    for name, got, want in zip(("rows", "order", "offsets"), C.dispatch(x, ids, experts), R.dispatch(x, ids, experts)):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("tokens,experts,top_k,n_group", [(1, 128, 8, 1), (16, 128, 8, 1), (3, 6, 6, 1), (1, 8, 2, 1),
                                                          (8, 256, 8, 8), (64, 256, 8, 8)])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])  # 1.0: drops, the separate kernels
def test_cuda_route_dispatch_matches_reference(tokens, experts, top_k, n_group, capacity_factor):
    """route_dispatch at decode sizes (one launch when dropless) against the reference kernels, bf16 operands;
    DeepSeek-V3's grouped sigmoid routing with 8 groups."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens + experts)
    x = torch.randn(tokens, 256, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(experts, 256, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    grouped = n_group > 1
    bias = torch.randn(experts, generator=gen, device=DEVICE) * 0.1 if grouped else None
    # float32 logits: bf16 ones tie often among 128 experts, and ties may break either way in torch.topk
    routing = (top_k, capacity_factor, True, "sigmoid" if grouped else "softmax", bias, n_group, 4 if grouped else 1,
               2.5 if grouped else 1.0)
    got = C.route_dispatch(x, w, None, *routing, True)
    # the op's float32 logits come from one tensor-core GEMM (core/logits.py): the upcast product up to summation
    # order; the routing and dispatch kernels then match the reference on those logits exactly
    logits = float32_logits(x, w)
    torch.testing.assert_close(logits, x.float() @ w.float().t(), atol=1e-4, rtol=1e-5)
    weights, ids = R.route_grouped(logits, *routing)
    want = (weights, ids, *R.dispatch(x, ids, experts))
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    for name, g, r in zip(("ids", "rows", "order", "offsets"), got[1:], want[1:]):
        assert torch.equal(g, r), name


@pytest.mark.parametrize("tokens,experts,top_k,n_group,capacity_factor", [(4096, 128, 8, 1, 0.0), (333, 8, 2, 1, 1.0),
                                                                         (1024, 256, 8, 8, 0.0)])
def test_cuda_routing_backward_matches_reference(tokens, experts, top_k, n_group, capacity_factor):
    """The logits' gradient of the routing weights (one Triton launch) against the reference, float32 logits;
    DeepSeek-V3's grouped sigmoid routing with 8 groups."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    logits = torch.randn(tokens, experts, generator=gen, device=DEVICE)
    if n_group == 1:
        _, ids = C.route(logits, top_k, capacity_factor, True)
        grad_w = torch.randn(ids.shape, generator=gen, device=DEVICE)
        got, want = (k.route_backward(grad_w, logits, ids, top_k, True) for k in (C, R))
    else:
        routing = (True, "sigmoid", torch.randn(experts, generator=gen, device=DEVICE) * 0.1, n_group, 4, 2.5)
        _, ids = C.route_grouped(logits, top_k, capacity_factor, *routing)
        grad_w = torch.randn(ids.shape, generator=gen, device=DEVICE)
        got, want = (k.route_grouped_backward(grad_w, logits, ids, top_k, *routing) for k in (C, R))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("logits_fp32", [True, False])
def test_cuda_route_dispatch_backward_matches_reference(logits_fp32):
    """The compiled training graphs' route_dispatch backward on CUDA (float32 logits of bf16 operands and their
    gradient's GEMMs on tensor cores, as the module's router trains) against the reference kernel's float32 math."""
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    hidden, weight = (torch.randn(*s, generator=gen, device=DEVICE, dtype=torch.bfloat16) for s in ((512, 256),
                                                                                                   (64, 256)))
    routing = (8, 0.0, True, "softmax", None, 1, 1, 1.0, logits_fp32)
    weights, ids, rows, order, _ = C.route_dispatch(hidden, weight, None, *routing)
    grad_w = torch.randn(weights.shape, generator=gen, device=DEVICE)
    grad_rows = torch.randn(rows.shape, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    args = (grad_w, grad_rows, hidden, weight, None, ids, order, 8, True, "softmax", None, 1, 1, 1.0, logits_fp32)
    got, want = C.route_dispatch_backward(*args), R.route_dispatch_backward(*args)
    assert got[2] is None and want[2] is None
    for g, w in zip(got[:2], want[:2]):
        assert g.dtype == w.dtype and _rel(g, w) <= 2e-2


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (3, 8, 2), (8, 8, 2), (40, 8, 2)])
def test_cuda_decode_layer_matches_reference_kernels(tokens, experts, top_k, monkeypatch):
    """Decode-sized MoE layers (combine searching `order` up to SEARCH_ROWS assignments; 40 x 2 is past it) against
    the reference kernels on the same bf16 weights."""
    torch.manual_seed(tokens)
    block = MoEBlock(MoEConfig(hidden_size=256, expert_size=128, num_experts=experts, top_k=top_k,
                               capacity_factor=0.0, activation="silu", gated=True)).to(DEVICE, torch.bfloat16).eval()
    x = torch.randn(tokens, 256, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        got = block(x)
        monkeypatch.setenv("MOECOMPILE_KERNELS", "reference")
        want = block(x)
    assert _rel(got, want) <= 2e-2


@pytest.mark.parametrize("tokens,experts,top_k,hidden,width", [(1, 128, 8, 2048, 768), (4, 128, 8, 2048, 768),
                                                                (1, 8, 2, 4096, 1024), (1, 64, 6, 200, 72)])
@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_cuda_direct_experts_match_reference_kernels(tokens, experts, top_k, hidden, width, gated, bias):
    """The direct kernels (autotuned, and at the runtime's table tiles, bf16) against routed_experts' reference
    (dispatch + experts + combine)."""
    from moecompile.kernels import triton_direct

    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=DEVICE, generator=gen).bfloat16()
    logits = torch.randn(tokens, experts, device=DEVICE, generator=gen)
    w_in, b_in, w_out, b_out = _bf16(*_weights(experts, hidden, width, gated, bias, gen))
    weights, ids = ops.route(logits, top_k, 0.0, True)
    got = triton_direct.routed_experts(x, weights, ids, w_in, b_in, w_out, b_out, "silu", gated)
    want = R.routed_experts(x, weights, ids, w_in, b_in, w_out, b_out, "silu", gated)
    assert _rel(got, want) <= 2e-2
    assert _rel(C.routed_experts(x, weights, ids, w_in, b_in, w_out, b_out, "silu", gated), want) <= 2e-2


@pytest.mark.skipif(not _hopper(), reason="programmatic dependent launch: Hopper")
@pytest.mark.parametrize("tokens,experts,top_k,hidden,width", [(1, 128, 8, 2048, 768), (4, 8, 2, 512, 256)])
def test_programmatic_launches_match_stream_order_in_a_cuda_graph(tokens, experts, top_k, hidden, width,
                                                                   monkeypatch):
    """MOECOMPILE_PDL=auto (the default): the top-k and direct-expert kernels of two decode layers, each launched as
    a programmatic dependent of the one before, captured in a CUDA graph and replayed on new inputs, give exactly the
    results of the same kernels in plain stream order (each waits for its predecessor's writes before reading
    anything)."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    w_router = torch.randn(experts, hidden, device=DEVICE, generator=gen).bfloat16()
    w_in, b_in, w_out, b_out = _bf16(*_weights(experts, hidden, width, True, False, gen))
    x = torch.randn(tokens, hidden, device=DEVICE, generator=gen).bfloat16()

    def two_layers():
        h = x
        for _ in range(2):
            weights, ids = C.route((h @ w_router.T).float(), top_k, 0.0, True)
            h = h + C.routed_experts(h, weights, ids, w_in, b_in, w_out, b_out, "silu", True).sum(1).to(h.dtype)
        return h

    with torch.no_grad():
        monkeypatch.setattr(choices, "PROGRAMMATIC_LAUNCH", "auto")
        assert choices.programmatic_launch(x)
        graph, out = graphs.capture(two_layers)
        for seed in range(2):
            x.copy_(torch.randn(tokens, hidden, device=DEVICE, generator=gen))
            graph.replay()
            monkeypatch.setattr(choices, "PROGRAMMATIC_LAUNCH", "off")
            assert torch.equal(out, two_layers()), seed
            monkeypatch.setattr(choices, "PROGRAMMATIC_LAUNCH", "auto")


def test_compiled_hf_moe_runs_its_moe_ops_inside_cuda_graphs():
    """moecompile.compile(model, mode="reduce-overhead") (bench/results/compile-h200-*-cudagraphs.md): inductor
    records the graph with the moecompile ops in it (no cudagraph skip) and its replays give eager's output on
    new inputs."""
    from hf_moe import tiny_moe, token_ids

    import moecompile

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_moe("tiny-qwen3-moe").to(DEVICE, torch.bfloat16)
    compiled = moecompile.compile(model, mode="reduce-overhead", dynamic=False)
    with torch.no_grad():
        for seed in range(4):  # warm-up, record, replay, replay
            ids = token_ids(seed).to(DEVICE)
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(input_ids=ids).logits.clone()
            assert _rel(got, model(input_ids=ids).logits) <= 2e-2, seed
    inductor = torch._dynamo.utils.counters["inductor"]
    assert inductor["cudagraph_skips"] == 0 and inductor["cudagraph_recorded_non_static_inputs"] >= 1
    assert moecompile.backend.records()[-1].moe_blocks == 2
    torch._dynamo.reset()


@pytest.mark.skipif(not _hopper(), reason="programmatic dependent launch: Hopper")
@pytest.mark.parametrize("batch, setting", [(1, "auto"), (2, "on")])
def test_generate_with_programmatic_launches_gives_the_same_tokens(batch, setting, monkeypatch):
    """moecompile.generate on a tiny Qwen3-MoE with MOECOMPILE_PDL auto (batch 1: inductor's kernels of the decode
    step and ours launched as programmatic dependents inside the captured step) or on (every graph's) gives the
    tokens of plain launches (off)."""
    from hf_moe import tiny_moe, token_ids

    import moecompile

    ids = token_ids(batch=batch).to(DEVICE)
    results = {}
    for value in ("off", setting):  # a model each: generate keeps its compiled step per model
        model = tiny_moe("tiny-qwen3-moe").to(DEVICE, torch.bfloat16)
        monkeypatch.setattr(choices, "PROGRAMMATIC_LAUNCH", value)
        torch._dynamo.reset()
        with torch.no_grad():
            results[value] = moecompile.generate(model, ids, max_new_tokens=8)
    assert torch.equal(results[setting], results["off"])
    torch._dynamo.reset()


def test_decode_step_runs_grouped_query_attention_and_direct_experts(monkeypatch):
    """moecompile.generate on a tiny Qwen3-MoE (bf16; its 6 experts count as many for the direct experts here): the
    decode step's graph has SDPA with enable_gqa (no repeated key/value heads) and routed_experts, and its first
    greedy tokens are HF eager's."""
    from hf_moe import tiny_moe, token_ids

    import moecompile
    from moecompile import backend
    from moecompile.conversion.models import TINY_MOE
    from moecompile.passes import direct_experts

    monkeypatch.setattr(direct_experts, "MAX_ASSIGNMENTS_PER_EXPERT", 1.0)
    torch._dynamo.reset()
    backend.clear_records()
    config, _ = TINY_MOE["tiny-qwen3-moe"]()
    assert config.num_key_value_heads < config.num_attention_heads
    model = tiny_moe("tiny-qwen3-moe").to(DEVICE, torch.bfloat16)
    ids = token_ids(batch=1).to(DEVICE)
    with torch.no_grad():
        got = moecompile.generate(model, ids, max_new_tokens=6)
    reports = [dict(r.reports) for r in backend.records()]
    step = reports[-1]  # the decode step's graph (prefill's came first)
    assert len(step["gqa_attention"]["rewritten"]) == 2, step["gqa_attention"]
    assert len(step["direct_experts"]["direct"]) == 2
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert (got[:, :ids.shape[1] + 2] == want[:, :ids.shape[1] + 2]).all()  # bf16: later near-ties may differ
    torch._dynamo.reset()
