"""The combine folded into the second projection (atomic adds into the token rows) against the projection then the
combine kernel: does the fold pay at the fine-grained shapes, where the [tokens x k, d] rows written and read back
cost a quarter of the layer outside its GEMMs?

On the device:  python bench/scatter_combine.py --out bench/results/gpu-scatter-combine.md

Same tokens, router, weights (random, dropless) for every row; median ms (triton's do_bench), bf16 operands.
The second projection alone, on the first projection's output a (random here) in expert order:
- <kernel> + combine: the second projection writing its rows in expert order (triton_persistent autotuned, QuACK
  with its tuned configuration where the quack extra is installed), then moecompile's deterministic combine kernel
  (a gather per token); <kernel> alone and combine alone: its parts;
- scattered, <dtype> adds: triton_persistent with the combine in its store: each row, times its router weight,
  atomically added to its token's output row (zeroed first, in the time), float32 adds then a cast to bf16, or bf16
  adds straight into the output.
The whole layer from a CUDA graph (router GEMM, top-k, dispatch, both projections, combine):
- layer, <second> + combine: the runtime's experts (its table's kernels) then the combine kernel;
- layer, <first> + triton_persistent scattering bf16 adds: the runtime's first projection, then the scattered
  second projection.
err: relative to a float32 reference of the same computation (the projection and combine, or the layer).
"""
from __future__ import annotations

import options_table
import torch
from options_table import ms

from moecompile.kernels import quack_gemm, reference, triton_moe, triton_routing
from moecompile.runtime import choices, graphs
from moecompile.runtime import cuda as runtime

SHAPES = {"qwen3-moe": (2048, 768, 128, 8, 8192), "sonic-7b": (1536, 256, 128, 8, 24576),
          "sonic-30b": (4096, 512, 128, 8, 32768), "deepseek-v3": (7168, 2048, 256, 8, 4096),
          "mixtral": (4096, 14336, 8, 2, 4096)}


def expert_order_rows(rows, offsets, weights_of):
    """float32 rows[r] @ weights_of(e).T for the rows r of each expert e's group."""
    starts = [0, *offsets[:-1].tolist()]
    return torch.cat([rows[s:t].float() @ weights_of(e).float().t() for e, (s, t) in
                      enumerate(zip(starts, offsets.tolist()))])


def scattered_second(a, offsets, w_out, token_of_row, row_weights, tokens, dtype):
    out = torch.zeros(tokens, w_out.shape[1], device=a.device, dtype=dtype)
    triton_moe.grouped_ffn_in(a, offsets, w_out, None, None, False, variant="triton_persistent",
                              scatter=(token_of_row, row_weights, out))
    return out.to(torch.bfloat16)


def projection_variants(r, a, tokens, k):
    offsets, order, weights, w_out = r.offsets, r.order, r.weights, r.w_out
    token_of_row = triton_routing.gather_indices(order, offsets, k)[1]
    row_weights = weights.reshape(-1).index_select(0, order).float()

    def second(kernel):
        if kernel == "quack":
            config = choices.quack_config("second", w_out.shape[2], w_out.shape[1])
            starts = triton_routing.group_starts(offsets)
            return lambda: quack_gemm.second_projection(a, starts, w_out, None, config=config)
        return lambda: triton_moe.grouped_ffn_in(a, offsets, w_out, None, None, False, variant=kernel)

    kernels = ["triton_persistent"]
    if quack_gemm.supported(a, w_out.transpose(1, 2), w_out, None, False):
        kernels.append("quack")
    variants = []
    for kernel in kernels:
        project = second(kernel)
        variants += [(f"{kernel} + combine", lambda p=project: triton_moe.combine(p(), order, weights)),
                     (f"{kernel} alone", project)]
    rows_out = second(kernels[-1])()
    variants.append(("combine alone", lambda: triton_moe.combine(rows_out, order, weights)))
    for dtype, label in ((torch.float32, "float32"), (torch.bfloat16, "bf16")):
        variants.append((f"scattered, {label} adds", lambda dtype=dtype: scattered_second(
            a, offsets, w_out, token_of_row, row_weights, tokens, dtype)))
    return variants


def layer_variants(r, k):
    """The layer as the runtime runs it, and with its second projection scattering the combine."""
    x, e = r.x, r.w_in.shape[0]
    first, second = runtime._projection_kernels(x, r.w_in, r.w_out, "silu", True, rows=x.shape[0] * k)

    def route():
        weights, ids = triton_routing.topk(reference.router_logits(x, r.router, None, False), k, True)
        _, order, offsets = triton_routing.dispatch(x, ids, e, copy_rows=False)
        return weights, order, offsets

    def as_run():
        weights, order, offsets = route()
        y = runtime.experts_gathered(x, order, offsets, k, r.w_in, None, r.w_out, None, "silu", True)
        return triton_moe.combine(y, order, weights)

    def scattered():
        weights, order, offsets = route()
        a, _, _ = runtime.gathered_first_projection(x, order, offsets, k, r.w_in, None, r.w_out, "silu", True)
        return scattered_second(a, offsets, r.w_out, triton_routing.gather_indices(order, offsets, k)[1],
                                weights.reshape(-1).index_select(0, order).float(), x.shape[0], torch.bfloat16)

    return [(f"layer, {first} + {second} + combine", as_run),
            (f"layer, {first} + triton_persistent scattering bf16 adds", scattered)]


def graphed(fn):
    fn()  # compiles and autotunes outside the capture
    graph, _ = graphs.capture(fn)
    return graph.replay


def run(name, d, f, e, k, tokens, lines):
    r = options_table.routed_layer(d, f, e, k, tokens)
    a = torch.randn(r.order.shape[0], f, generator=r.g, device=r.x.device, dtype=torch.bfloat16)
    want = reference.combine(expert_order_rows(a, r.offsets, lambda i: r.w_out[i]), r.order, r.weights)
    act = expert_order_rows(r.rows, r.offsets, lambda i: r.w_in[i])
    gate, up = act.chunk(2, dim=1)
    layer_y = expert_order_rows(torch.nn.functional.silu(gate) * up, r.offsets, lambda i: r.w_out[i])
    want_layer = reference.combine(layer_y, r.order, r.weights)
    flops = 2 * r.order.shape[0] * f * d
    rows = [(label, fn, want, False) for label, fn in projection_variants(r, a, tokens, k)]
    rows += [(label, fn, want_layer, True) for label, fn in layer_variants(r, k)]
    for label, fn, ref, whole in rows:
        try:
            out = fn()
            err = ((out.float() - ref).norm() / ref.norm()).item() if out.shape == ref.shape else float("nan")
            t = ms(graphed(fn) if whole else fn)
            lines.append(f"| {name} | {d}, {f}, {e}, {k}, {tokens} | {label} | {t:.3f} | "
                         f"{'' if whole else f'{flops / t / 1e9:.0f}'} | {err:.1e} |")
        except Exception as ex:  # noqa: BLE001 - a variant that cannot run here is a row saying why
            lines.append(f"| {name} | {d}, {f}, {e}, {k}, {tokens} | {label} | failed: {str(ex).splitlines()[0][:80]}"
                         " | | |")
        print(lines[-1], flush=True)


def main(argv=None):
    return options_table.main(
        __doc__, "scatter_combine.py", "The combine folded into the second projection (moecompile)",
        "| shape | d, f, E, k, tokens | variant | ms | TF/s (second projection) | err |", SHAPES, run, argv)


if __name__ == "__main__":
    main()
