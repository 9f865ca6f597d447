"""Probe (issues 9, 10): a persistent grouped first projection that gathers its rows straight from the unsorted tokens.

On the device:  python bench/gather_first_projection.py   (output: bench/results/gpu-gather-first-projection.md)

The dispatch copy (every token's row written once per chosen expert, in expert order) would disappear if the first
GEMM loaded its A rows by token index (pointer loads; weights still by TMA), as vLLM's fused_moe does. This times
that kernel against moecompile's persistent TMA kernel on the dispatched rows, and the dispatch it would save. A
prototype: not wired into the ops (that needs a route_dispatch without the row copy and an experts op that takes
the token order).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from moecompile.kernels import triton_moe as T
from moecompile.kernels import triton_routing


@triton.jit
def _gather_tile(x_ptr, tok_ptr, w_desc, bias_ptr, out_ptr, expert, rows, rmask, pid_n, hidden: tl.constexpr,
                 width: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < width
    toks = tl.load(tok_ptr + rows, mask=rmask, other=0)
    a_ptrs = x_ptr + toks.to(tl.int64)[:, None] * hidden + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        w = w_desc.load([expert, pid_n * BLOCK_N, 0, k0]).reshape(2 * BLOCK_N, BLOCK_K)
        acc = tl.dot(tl.load(a_ptrs + k0), w.T, acc)
    gate, up = tl.split(acc.reshape(BLOCK_M, BLOCK_N, 2))
    out = T._bias_activation(gate, up, bias_ptr, expert, cols, cmask, width, HAS_BIAS, GATED, ACT)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _gather_persistent_kernel(x_ptr, tok_ptr, w_ptr, bias_ptr, offsets_ptr, out_ptr, num_experts,
                              hidden: tl.constexpr, width: tl.constexpr, HAS_BIAS: tl.constexpr,
                              GATED: tl.constexpr, ACT: tl.constexpr, E_PAD: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    tile_ends, begins, ends, tiles_m = T._tile_table(offsets_ptr, num_experts, E_PAD, BLOCK_M)
    tiles_n: tl.constexpr = (width + BLOCK_N - 1) // BLOCK_N
    w_desc = T._tma_weight_desc(w_ptr, num_experts, hidden, width, GATED, BLOCK_N, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS, flatten=True):
        _, expert, rows, rmask, pid_n = T._tile_at(tile, tile_ends, begins, ends, tiles_m, width, E_PAD, BLOCK_M,
                                                   BLOCK_N, GROUP_M)
        _gather_tile(x_ptr, tok_ptr, w_desc, bias_ptr, out_ptr, expert, rows, rmask, pid_n, hidden, width, HAS_BIAS,
                     GATED, ACT, BLOCK_M, BLOCK_N, BLOCK_K)


def gather_ffn_in(x, tok, offsets, w_in, n_rows, cfg):
    num_experts, in_width, hidden = w_in.shape
    width = in_width // 2
    out = x.new_empty(n_rows, width)
    triton.set_allocator(T._tma_scratch)
    _gather_persistent_kernel[(T._num_sms(x.device),)](
        x, tok, w_in, x, offsets, out, num_experts, hidden=hidden, width=width, HAS_BIAS=False, GATED=True,
        ACT=T.ACTIVATION_IDS["silu"], E_PAD=triton.next_power_of_2(num_experts), NUM_SMS=T._num_sms(x.device), **cfg)
    return out


if __name__ == "__main__":
    from options_table import ms
    from moecompile import ops
    for name, (d, f, e, k, tokens) in {"qwen3-16k": (2048, 768, 128, 8, 16384), "gpt2": (768, 3072, 16, 2, 16384)}.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        w_in = torch.randn(e, 2 * f, d, generator=g, device="cuda", dtype=torch.bfloat16) * d ** -0.5
        router = torch.randn(e, d, generator=g, device="cuda", dtype=torch.bfloat16) * d ** -0.5
        x = torch.randn(tokens, d, generator=g, device="cuda", dtype=torch.bfloat16)
        _, ids = ops.route(x @ router.t(), k, 0.0, True)
        rows, order, offsets = triton_routing.dispatch(x, ids, e)
        tok = (order // k).to(torch.int32)
        ref = T.grouped_ffn_in(rows, offsets, w_in, None, "silu", True, variant="triton_persistent")
        t_disp = ms(lambda: triton_routing.dispatch(x, ids, e))
        t_ref = ms(lambda: T.grouped_ffn_in(rows, offsets, w_in, None, "silu", True, variant="triton_persistent"))
        print(f"{name}: dispatch {t_disp:.3f}  persistent TMA first projection {t_ref:.3f}", flush=True)
        for bm, bn, bk, gm, w, s in ((128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 64, 64, 8, 8, 4)):
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=w, num_stages=s)
            try:
                out = gather_ffn_in(x, tok, offsets, w_in, rows.shape[0], cfg)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                t = ms(lambda: gather_ffn_in(x, tok, offsets, w_in, rows.shape[0], cfg))
                print(f"  gather {cfg} {t:.3f} err {err:.1e}  saves {t_ref + t_disp * 0.8 - t:+.3f} (if the copy is ~80% of dispatch)", flush=True)
            except Exception as ex:
                print("  failed", cfg, str(ex)[:100], flush=True)
