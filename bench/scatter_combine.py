"""The combine folded into the second projection (atomic adds into the token rows) against the projection then the
combine kernel: does the fold pay at the fine-grained shapes, where the [tokens x k, d] rows written and read back
cost a quarter of the layer outside its GEMMs?

On the device:  python bench/scatter_combine.py --out bench/results/gpu-scatter-combine.md

Same rows (random router, dropless), weights and activations a = the first projection's output; median ms
(triton's do_bench), bf16 operands. Variants:
- <kernel> + combine: the second projection writing its rows in expert order (triton_persistent autotuned, QuACK
  where the quack extra is installed), then moecompile's deterministic combine kernel (a gather per token);
- combine alone, the projection alone: the parts of the row above;
- scattered, <dtype> adds: triton_persistent with the combine in its store: each row, times its router weight,
  atomically added to its token's output row (zeroed first, in the time), float32 adds then a cast to bf16, or bf16
  adds straight into the output.
err: relative to the float32 projection and combine. The fold is worth building into the layer only where a
scattered row beats the best "+ combine" row.
"""
from __future__ import annotations

import options_table
import torch
from options_table import ms

from moecompile.kernels import quack_gemm, reference, triton_moe
from moecompile.runtime import choices

SHAPES = {"qwen3-moe": (2048, 768, 128, 8, 8192), "sonic-7b": (1536, 256, 128, 8, 24576),
          "sonic-30b": (4096, 512, 128, 8, 32768), "deepseek-v3": (7168, 2048, 256, 8, 4096),
          "mixtral": (4096, 14336, 8, 2, 4096)}


def run(name, d, f, e, k, tokens, lines):
    _, w_out, _, offsets, g, weights, order = options_table.routed_layer(d, f, e, k, tokens)
    a = torch.randn(order.shape[0], f, generator=g, device=w_out.device, dtype=torch.bfloat16)
    token_of_row = (order // k).to(torch.int32)
    row_weights = weights.reshape(-1).index_select(0, order).float()
    y = torch.cat([a[s:t].float() @ w_out[i].float().t() for i, (s, t) in
                   enumerate(zip([0, *offsets[:-1].tolist()], offsets.tolist()))])
    want = reference.combine(y, order, weights)

    def second(kernel):
        if kernel == "quack":
            config = choices.quack_config("second", w_out.shape[2], w_out.shape[1])
            return lambda: quack_gemm.second_projection(a, quack_gemm.group_starts(offsets), w_out, None, config=config)
        return lambda: triton_moe.grouped_ffn_in(a, offsets, w_out, None, None, False, variant=kernel)

    def scattered(dtype):
        def fn():
            out = torch.zeros(tokens, d, device=a.device, dtype=dtype)
            triton_moe.grouped_ffn_in(a, offsets, w_out, None, None, False, variant="triton_persistent",
                                      scatter=(token_of_row, row_weights, out))
            return out.to(torch.bfloat16)
        return fn

    kernels = ["triton_persistent"] + (["quack"] if quack_gemm.supported(a, w_out.transpose(1, 2), w_out, None,
                                                                         False) else [])
    variants = []
    for kernel in kernels:
        project = second(kernel)
        variants += [(f"{kernel} + combine", lambda p=project: triton_moe.combine(p(), order, weights)),
                     (f"{kernel} alone", project)]
    rows_out = second(kernels[-1])()
    variants += [("combine alone", lambda: triton_moe.combine(rows_out, order, weights)),
                 ("scattered, float32 adds", scattered(torch.float32)),
                 ("scattered, bf16 adds", scattered(torch.bfloat16))]
    flops = 2 * order.shape[0] * f * d
    for label, fn in variants:
        try:
            out = fn()
            err = ((out.float() - want).norm() / want.norm()).item() if out.shape == want.shape else float("nan")
            t = ms(fn)
            lines.append(f"| {name} | {d}, {f}, {e}, {k}, {tokens} | {label} | {t:.3f} | {flops / t / 1e9:.0f} | "
                         f"{err:.1e} |")
        except Exception as ex:  # noqa: BLE001 - a variant that cannot run here is a row saying why
            lines.append(f"| {name} | {d}, {f}, {e}, {k}, {tokens} | {label} | failed: {str(ex).splitlines()[0][:80]}"
                         " | | |")
        print(lines[-1], flush=True)


def main(argv=None):
    return options_table.main(
        __doc__, "scatter_combine.py", "The combine folded into the second projection (moecompile)",
        "| shape | d, f, E, k, tokens | variant | ms | TF/s (projection FLOPs) | err |", SHAPES, run, argv)


if __name__ == "__main__":
    main()
