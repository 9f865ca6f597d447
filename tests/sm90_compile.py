"""Compile every Triton kernel of the CUDA runtime for an H100/H200 (sm_90a) on a machine without a GPU: Triton's
front end, its Hopper lowering (wgmma, TMA) and ptxas run, nothing is launched. Run by tests/test_triton_sm90.py in
a subprocess without TRITON_INTERPRET (which swaps the kernels for interpreted functions). Prints one line per
compiled kernel variant: "ok <name> <variant>" or "FAIL <name> <variant>: <error>"."""
import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moecompile.kernels import (
    triton_decode_attention,
    triton_direct,
    triton_fp8,
    triton_fp8_decode,
    triton_moe,
    triton_routing,
)

TARGET = GPUTarget("cuda", 90, 32)
BF16 = "*bf16"


def compile_kernel(fn, types: dict, consts: dict, **options) -> None:
    params = list(inspect.signature(fn.fn).parameters)
    unknown = set(consts) - set(params)
    if unknown:
        raise TypeError(f"not parameters: {sorted(unknown)}")
    signature = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    triton.compile(ASTSource(fn, signature, constexprs={(params.index(k),): v for k, v in consts.items()}),
                   target=TARGET, options=options)


def cases():
    gemm = {"x_ptr": BF16, "w_ptr": BF16, "bias_ptr": BF16, "offsets_ptr": "*i32", "out_ptr": BF16, "tok_ptr": "*i32",
            "rw_ptr": "*fp32"}
    tiles = dict(E_PAD=8, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, hidden=4096, width=14336)
    for kernel in (triton_moe._grouped_ffn_in_kernel, triton_moe._grouped_ffn_in_tma_kernel):
        for gated, act, bias, label in ((True, 3, False, "swiglu"), (False, 0, True, "gelu+bias"),
                                        (False, -1, True, "no activation (second projection)")):
            yield kernel, label, gemm, dict(tiles, HAS_BIAS=bias, GATED=gated, ACT=act, SCATTER=False), dict(
                num_warps=8, num_stages=3)
    for gated, act, bias, scatter, out, label in (
            (True, 3, False, False, BF16, "swiglu"), (False, -1, True, False, BF16, "second projection"),
            (False, -1, False, True, BF16, "second projection, combine scattered, bf16 adds"),
            (False, -1, False, True, "*fp32", "second projection, combine scattered, float32 adds")):
        yield (triton_moe._grouped_ffn_in_persistent_kernel, label, {**gemm, "out_ptr": out},
               dict(tiles, HAS_BIAS=bias, GATED=gated, ACT=act, SCATTER=scatter, NUM_SMS=132, INTERPRET=False),
               dict(num_warps=8, num_stages=3))
    act = {"h_ptr": BF16, "bias_ptr": BF16, "offsets_ptr": "*i32", "out_ptr": BF16}
    yield (triton_moe._expert_activation_kernel, "swiglu", act,
           dict(HAS_BIAS=True, GATED=True, ACT=3, BLOCK_M=32, BLOCK_N=128, E_PAD=8), {})
    act_bwd = {"h_ptr": BF16, "bias_ptr": BF16, "offsets_ptr": "*i32", "grad_a_ptr": BF16, "a_ptr": BF16,
               "grad_h_ptr": BF16}
    yield (triton_moe._expert_activation_backward_kernel, "gelu", act_bwd,
           dict(HAS_BIAS=True, GATED=False, ACT=0, BLOCK_M=32, BLOCK_N=128, E_PAD=8), {})
    yield (triton_moe._invert_kernel, "", {"order_ptr": "*i64", "row_of_ptr": "*i64"}, dict(BLOCK=1024), {})
    combine = {"y_ptr": BF16, "row_of_ptr": "*i64", "order_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": BF16}
    for search in (False, True):
        yield (triton_moe._combine_kernel, f"k=8, search {search}", combine,
               dict(TOP_K=8, BLOCK_T=1, BLOCK_H=2048, SEARCH=search, CHUNK=64), {})
    yield (triton_moe._combine_backward_kernel, "k=2",
           {"grad_out_ptr": BF16, "y_ptr": BF16, "row_of_ptr": "*i64", "w_ptr": "*fp32", "grad_rows_ptr": BF16,
            "grad_w_ptr": "*fp32"}, dict(hidden=4096, TOP_K=2, BLOCK_T=16, BLOCK_H=256), {})
    quantize = {"h_ptr": BF16, "bias_ptr": BF16, "offsets_ptr": "*i32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    for gated, act, bias, label in ((False, -1, False, "1x128"), (True, 3, True, "swiglu + bias, 1x128")):
        yield (triton_fp8._quantize_rows_kernel, label, quantize,
               dict(width=4096, HAS_BIAS=bias, GATED=gated, ACT=act, BLOCK_M=32, GROUP=128, E_PAD=8, EMULATE=False),
               {})
    fp8 = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
           "bias_ptr": BF16, "offsets_ptr": "*i32", "out_ptr": "*fp8e4nv", "out_scale_ptr": "*fp32"}
    yield (triton_fp8._grouped_fp8_kernel, "first projection", fp8,
           dict(K=4096, width=14336, HAS_BIAS=True, GATED=True, ACT=3, QUANT_OUT=True, CAST_FP32=False, E_PAD=8,
                BLOCK_M=128, GROUP_M=8), dict(num_warps=8, num_stages=3))
    yield (triton_fp8._grouped_fp8_kernel, "second projection", {**fp8, "out_ptr": BF16},
           dict(K=14336, width=4096, HAS_BIAS=False, GATED=False, ACT=-1, QUANT_OUT=False, CAST_FP32=False,
                E_PAD=8, BLOCK_M=64, GROUP_M=8), dict(num_warps=4, num_stages=4))
    yield (triton_fp8._requantize_rows_kernel, "per row", {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                                                         "out_ptr": "*fp8e4nv", "out_s_ptr": "*fp32"},
           dict(width=14336, BLOCK_M=16, G_PAD=128, EMULATE=False), {})
    rowwise = dict(E_PAD=8, BLOCK_M=128, GROUP_M=8, NUM_SMS=132, CAST_FP32=False)
    yield (triton_fp8._grouped_fp8_rowwise_kernel, "first projection", fp8,
           dict(rowwise, K=4096, width=14336, HAS_BIAS=True, GATED=True, ACT=3, QUANT_OUT=True),
           dict(num_warps=8, num_stages=4))
    for warps in (8, 4):
        yield (triton_fp8._grouped_fp8_rowwise_kernel, f"second projection, {warps} warps", {**fp8, "out_ptr": BF16},
               dict(rowwise, K=14336, width=4096, HAS_BIAS=False, GATED=False, ACT=-1, QUANT_OUT=False),
               dict(num_warps=warps, num_stages=4))
    for scoring, bias, groups, pdl, ranked, (experts, block_t, warps) in (  # topk's tiles (_selection_tile)
            (0, False, (1, 1), False, False, (256, 16, 8)), (1, True, (8, 4), False, False, (256, 16, 8)),
            (0, False, (1, 1), True, False, (256, 16, 8)), (0, False, (1, 1), True, True, (128, 8, 4))):
        yield (triton_routing._topk_kernel, f"E={experts}, scoring {scoring}, groups {groups}"
               + (", PDL" if pdl else "") + (", ranked" if ranked else ""),
               {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                "rank_ptr": "*i32", "counts_ptr": "*i32", "scaling": "fp32"},
               dict(TOP_K=8, K_PAD=8, E_PAD=experts, BLOCK_T=block_t, SCORING=scoring, HAS_BIAS=bias, RENORM=True,
                    N_GROUP=groups[0], TOPK_GROUP=groups[1], RANK=ranked, PDL=pdl),
               dict(launch_pdl=pdl, num_warps=warps))
    for scoring, bias, groups, renorm in ((0, False, (1, 1), True), (1, True, (8, 4), True), (0, False, (1, 1), False)):
        yield (triton_routing._topk_backward_kernel, f"scoring {scoring}, groups {groups}, renormalise {renorm}",
               {"logits_ptr": BF16, "bias_ptr": "*fp32", "ids_ptr": "*i64", "grad_w_ptr": "*fp32", "grad_ptr": BF16,
                "scaling": "fp32"},
               dict(TOP_K=8, K_PAD=8, E_PAD=256, BLOCK_T=16, SCORING=scoring, HAS_BIAS=bias, RENORM=renorm,
                    N_GROUP=groups[0], TOPK_GROUP=groups[1]), {})
    yield (triton_routing._small_route_dispatch_kernel, "E=128, k=8, 16 tokens",
           {"logits_ptr": BF16, "bias_ptr": BF16, "x_ptr": BF16, "weights_ptr": "*fp32", "ids_ptr": "*i64",
            "order_ptr": "*i64", "rows_ptr": BF16, "offsets_ptr": "*i32", "scaling": "fp32"},
           dict(hidden=2048, TOP_K=8, K_PAD=8, E_PAD=128, T_PAD=16, SCORING=0, HAS_BIAS=False, RENORM=True,
                N_GROUP=1, TOPK_GROUP=1, BLOCK_A=16, BLOCK_H=256), {})
    rank = {"ids_ptr": "*i64", "rank_ptr": "*i32", "counts_ptr": "*i32"}
    for experts, bins in ((128, 256), (8, 16)):  # the block's histogram over many bins and over fewer than a warp
        yield (triton_routing._rank_kernel, f"E={experts}", rank, dict(BLOCK=64, B_PAD=bins), {})
    yield (triton_routing._scan_counts_kernel, "1024 blocks", {"counts_ptr": "*i32", "totals_ptr": "*i32"},
           dict(CHUNK=1024), {})
    scatter = {"x_ptr": BF16, "ids_ptr": "*i64", "rank_ptr": "*i32", "prefix_ptr": "*i32", "totals_ptr": "*i32",
               "order_ptr": "*i64", "rows_ptr": BF16, "offsets_ptr": "*i32"}
    yield (triton_routing._scatter_rows_kernel, "H=2048", scatter,
           dict(hidden=2048, TOP_K=8, RANK_BLOCK=64, BLOCK_A=32, B_PAD=256, BLOCK_H=256), {})
    fp8_rows = {**scatter, "x_ptr": "*fp8e4nv", "rows_ptr": "*fp8e4nv"}
    yield (triton_routing._scatter_rows_kernel, "H=7168 FP8 rows", fp8_rows,
           dict(hidden=7168, TOP_K=8, RANK_BLOCK=32, BLOCK_A=32, B_PAD=512, BLOCK_H=512), {})
    yield (triton_routing._group_indices_kernel, "E=128", {"offsets_ptr": "*i32", "starts_ptr": "*i32",
           "order_ptr": "*i64", "token_of_ptr": "*i32"}, dict(TOP_K=8, BLOCK=1024, E_PAD=256), {})
    yield (triton_routing._gather_rows_kernel, "H=2048", {"x_ptr": BF16, "order_ptr": "*i64", "rows_ptr": BF16},
           dict(hidden=2048, TOP_K=8, BLOCK_A=32, BLOCK_H=256), {})
    direct = {"x_ptr": BF16, "ids_ptr": "*i64", "w_ptr": BF16, "s_ptr": BF16, "bias_ptr": BF16, "out_ptr": BF16}
    fp8_direct = {**direct, "w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}  # FP8 weights, 128 x 128 block scales
    for gated, act, bias, label in ((True, 3, False, "swiglu"), (False, 0, True, "gelu+bias")):
        yield (triton_direct._direct_ffn_in_kernel, label, direct,
               dict(hidden=2048, width=768, HAS_BIAS=bias, GATED=gated, ACT=act, SCALED=False, BLOCK_N=16,
                    BLOCK_K=256, PDL=False), dict(num_warps=4, num_stages=4))
    for block_k, pdl in ((128, False), (256, False), (256, True)):  # FP8 K steps in a scale block, over two blocks
        yield (triton_direct._direct_ffn_in_kernel,
               f"swiglu, FP8 weights, K step {block_k}" + (", PDL" if pdl else ""), fp8_direct,
               dict(hidden=2048, width=768, HAS_BIAS=False, GATED=True, ACT=3, SCALED=True, BLOCK_N=16,
                    BLOCK_K=block_k, PDL=pdl), dict(num_warps=4, num_stages=4, launch_pdl=pdl))
    for bias, scaled, block_k, types, pdl in ((False, False, 256, direct, False), (True, False, 256, direct, False),
                                              (False, True, 128, fp8_direct, False),
                                              (False, True, 512, fp8_direct, False), (False, False, 256, direct, True)):
        yield (triton_direct._direct_ffn_out_kernel,
               ("bias" if bias else "no bias") + (f", FP8, K step {block_k}" if scaled else "") +
               (", PDL" if pdl else ""),
               {**types, "a_ptr": BF16, "weights_ptr": "*fp32", "out_ptr": "*fp32"},  # float32 terms
               dict(hidden=2048, width=768, HAS_BIAS=bias, SCALED=scaled, BLOCK_N=8, BLOCK_K=block_k, PDL=pdl),
               dict(num_warps=2, num_stages=4, launch_pdl=pdl))
    linear = {"x_ptr": BF16, "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "bias_ptr": BF16, "out_ptr": BF16}
    for block_m, block_k, k_split, label in ((1, 128, 2048, "one row (matrix-vector)"),
                                             (1, 128, 256, "one row, K split in 8"),
                                             (1, 256, 512, "one row, K split in 4, K step 256"),
                                             (16, 128, 2048, "16 rows (dot)"), (16, 128, 512, "16 rows, K split in 4")):
        partial = {"out_ptr": "*fp32"} if k_split < 2048 else {}  # split: float32 partial sums
        yield (triton_fp8_decode._fp8_linear_kernel, label, {**linear, **partial},
               dict(n=5120, k=2048, HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=32 if block_m == 1 else 64,
                    BLOCK_K=block_k, K_SPLIT=k_split), dict(num_warps=4, num_stages=4))
    yield (triton_fp8_decode._sum_splits_kernel, "4 splits + bias", {"partial_ptr": "*fp32", "bias_ptr": BF16,
                                                                      "out_ptr": BF16},
           dict(SPLITS=4, HAS_BIAS=True, BLOCK=1024), {})
    partials = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32"}
    attend = {"q_ptr": BF16, "k_ptr": BF16, "v_ptr": BF16, "mask_ptr": "*u8", "scale": "fp32", **partials}
    for kv, group, whole, label in ((4, 8, True, "Qwen3-30B-A3B heads (32 over 4), one run, no mask"),
                                    (8, 4, False, "Mixtral heads (32 over 8), runs to merge, a mask")):
        yield (triton_decode_attention._attend_run_kernel, label, {**attend, "acc_ptr": BF16} if whole else attend,
               dict(kv_heads=kv, group=group, key_dim=128, value_dim=128, BLOCK_G=16, BLOCK_L=64, BLOCK_D=128,
                    BLOCK_DV=128, WHOLE=whole, HAS_MASK=not whole), dict(num_warps=4))
    yield (triton_decode_attention._merge_runs_kernel, "16 runs", {**partials, "out_ptr": BF16},
           dict(value_dim=128, BLOCK_S=16, BLOCK_DV=128), {})


if __name__ == "__main__":
    for fn, label, types, consts, options in cases():
        try:
            compile_kernel(fn, types, consts, **options)
            print(f"ok {fn.fn.__name__} {label}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported per kernel, the test fails on any
            print(f"FAIL {fn.fn.__name__} {label}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
