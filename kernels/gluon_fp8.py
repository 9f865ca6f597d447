"""Block-scaled FP8 grouped GEMM for Hopper in Gluon (Triton's explicit-layout dialect), promotion overlapped.

The block math (A 1x128 per token, W 128x128 tiles, each K step of 128 scaled into a float32 accumulator) needs
each K step's wgmma product in registers. Plain Triton waits for every wgmma before scaling it (wait_group 0), so
the tensor cores idle while the scaling runs (kernels/triton_fp8.py's block kernels). Here K steps alternate
between two partial accumulators: step k's wgmma is issued, then the kernel waits for step k - 1 only
(wait_group 1) and scales it while step k runs. ptxas keeps that overlap only in straight-line code (a wgmma in
flight across a loop's back edge, or a branch in between, and it serialises every wgmma), so the K loop runs
UNROLL steps straight and drains after them: with pairs, half the promotions overlap (four steps straight need more
than 255 registers). TMA loads run STAGES - 1 steps ahead on mbarriers.

Gated first projections take the weights with gate and up rows interleaved in runs of 64 (interleave_gate_up):
one 128-row weight tile is 64 gate and the same 64 up channels, so one m64n128 wgmma per warpgroup covers both
and its columns carry two weight-block scales. A tile of 128 outputs (gate and up 256 wide) would need 3 x 128
accumulator registers per thread: more than a thread has. The epilogue writes act(gate) * up in bf16 and
quantize_rows makes its 1x128 groups (a tile holds 64 channels). Hopper (sm_90) only; the runtime (runtime/fp8.py)
imports it for block-scaled batches there.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moecompile.kernels.triton_moe import _activation

# Gluon is experimental and renames its builtins between Triton versions: the TMA load is async_copy_global_to_shared
# in Triton 3.6 and async_load in 3.9
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
BLOCK_K = gl.constexpr(128)  # one weight block along K: one promotion per K step
HALF = gl.constexpr(64)  # gate / up channels per weight tile of a gated projection


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _promote(acc, partial, sa, sg, su, gate_cols, GATED: gl.constexpr):
    """acc + one K step's product times its scales: A's per row, W's per tile (gated: gate and up halves)."""
    if GATED:
        return acc + partial * sa[:, None] * gl.where(gate_cols, sg, su)
    return acc + partial * (sa * sg)[:, None]


@gluon.jit
def _issue(k, slot, ops, k_steps: gl.constexpr, STAGES: gl.constexpr):
    """K step k: wait for its operands, start its wgmma into `slot` (whose old value is done with), load its
    scales while it runs."""
    a_desc, w_desc, a_smem, w_smem, bars, row0, w_row0, rows, n_rows, a_scale_ptr, ws_base, gate_block, up_block = ops
    stage = k % STAGES
    mbarrier.wait(bars.index(stage), (k // STAGES) & 1)
    slot = warpgroup_mma(a_smem.index(stage), w_smem.index(stage).permute((1, 0)), slot, use_acc=False,
                         is_async=True)
    sa = gl.load(a_scale_ptr + k * n_rows + rows, mask=rows < n_rows, other=0.0)
    sg = gl.load(ws_base + gate_block * k_steps + k)
    su = gl.load(ws_base + up_block * k_steps + k)
    return slot, sa, sg, su


@gluon.jit
def _refill(k, ops, k_steps: gl.constexpr, STAGES: gl.constexpr):
    """Once step k - 1's wgmma is done: load step k + STAGES - 1 into the stage it read (at k = 0: the last
    stage, not used yet). Predicated, not branched (a branch between a wgmma and its wait serialises them)."""
    a_desc, w_desc, a_smem, w_smem, bars, row0, w_row0, rows, n_rows, a_scale_ptr, ws_base, gate_block, up_block = ops
    refill = k + STAGES - 1
    live = refill < k_steps
    r = refill % STAGES
    mbarrier.expect(bars.index(r), a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=live)
    _tma_load(a_desc, [row0, refill * BLOCK_K], bars.index(r), a_smem.index(r), pred=live)
    _tma_load(w_desc, [w_row0, refill * BLOCK_K], bars.index(r), w_smem.index(r), pred=live)


@gluon.jit
def _retire(slot, acc, sa, sg, su, gate_cols, in_flight: gl.constexpr, GATED: gl.constexpr):
    """Wait until at most `in_flight` wgmmas run (the one in `slot` done), promote its product into acc."""
    done = warpgroup_mma_wait(num_outstanding=in_flight, deps=[slot])
    return done, _promote(acc, done, sa, sg, su, gate_cols, GATED)


@gluon.jit
def _steps(k0, n: gl.constexpr, acc, zero, gate_cols, ops, k_steps: gl.constexpr, STAGES: gl.constexpr,
           GATED: gl.constexpr):
    """K steps k0 .. k0 + n - 1, straight-line: even ones into p0, odd ones into p1; each step's wgmma runs while
    the previous step is promoted. All wgmmas are done on return: ptxas serialises wgmmas whose registers are read
    while one is in flight across a loop's back edge, so the pipeline drains once per n steps."""
    p0 = zero
    p1 = zero
    for u in gl.static_range(n):
        if u % 2 == 0:
            q0, sa0, sg0, su0 = _issue(k0 + u, p0, ops, k_steps, STAGES)
            if u > 0:
                p1, acc = _retire(q1, acc, sa1, sg1, su1, gate_cols, 1, GATED)  # noqa: F821 (previous step)
        else:
            q1, sa1, sg1, su1 = _issue(k0 + u, p1, ops, k_steps, STAGES)
            p0, acc = _retire(q0, acc, sa0, sg0, su0, gate_cols, 1, GATED)
        _refill(k0 + u, ops, k_steps, STAGES)
    if n % 2 == 1:
        p0, acc = _retire(q0, acc, sa0, sg0, su0, gate_cols, 0, GATED)
    else:
        p1, acc = _retire(q1, acc, sa1, sg1, su1, gate_cols, 0, GATED)
    return acc


@gluon.jit
def _block_fp8_kernel(a_desc, w_desc, a_scale_ptr, w_scale_ptr, bias_ptr, offsets_ptr, out_ptr, n_rows, num_experts,
                      K: gl.constexpr, width: gl.constexpr, HAS_BIAS: gl.constexpr, GATED: gl.constexpr,
                      ACT: gl.constexpr, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr):
    """out[r] = (act(gate) * up | x W^T + b) for the rows r of each expert's group. a_desc: A [n_rows, K] fp8;
    a_scale_ptr: A's scales transposed, [K / 128, n_rows]; w_desc: W [E * in_width, K] fp8 (gated: interleaved);
    w_scale_ptr: W's block scales [E, in_width / 128, K / 128] in the original (not interleaved) row order."""
    BLOCK_N: gl.constexpr = 128  # weight rows per tile
    OUT_N: gl.constexpr = HALF if GATED else BLOCK_N  # output channels per tile
    in_width: gl.constexpr = 2 * width if GATED else width
    tiles_n: gl.constexpr = in_width // BLOCK_N
    k_steps: gl.constexpr = K // BLOCK_K
    row_blocks: gl.constexpr = in_width // BLOCK_N

    # the tile: triton_moe._tile_table / _tile_at on this program's id
    e_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    e_idx = gl.arange(0, E_PAD, layout=e_layout)
    valid = e_idx < num_experts
    ends = gl.load(offsets_ptr + e_idx, mask=valid, other=0)
    begins = gl.load(offsets_ptr + e_idx - 1, mask=valid & (e_idx > 0), other=0)
    tile_ends = gl.associative_scan((ends - begins + BLOCK_M - 1) // BLOCK_M, 0, _add)
    total_tiles = gl.max(gl.where(valid, tile_ends, 0), axis=0)
    tile_ends = gl.where(valid, tile_ends, 2147483647)
    tiles_m = gl.cdiv(n_rows, BLOCK_M) + num_experts
    tile = gl.program_id(0)
    first_m = tile // (GROUP_M * tiles_n) * GROUP_M
    group_size = gl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * tiles_n)) % group_size
    pid_n = (tile % (GROUP_M * tiles_n)) // group_size
    if pid_m < total_tiles:
        expert = gl.sum((tile_ends <= pid_m).to(gl.int32), axis=0)
        tile_start = gl.sum(gl.where(e_idx == expert - 1, tile_ends, 0), axis=0)
        row_begin = gl.sum(gl.where(e_idx == expert, begins, 0), axis=0)
        row_end = gl.sum(gl.where(e_idx == expert, ends, 0), axis=0)
        row0 = row_begin + (pid_m - tile_start) * BLOCK_M
        w_row0 = expert * in_width + pid_n * BLOCK_N

        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        # weight-block scales of this tile's columns, per K step: gated tiles hold gate (first half) and up rows
        ws_base = w_scale_ptr + expert.to(gl.int64) * row_blocks * k_steps
        if GATED:
            gate_block = (pid_n * HALF) // BLOCK_N
            up_block = (width + pid_n * HALF) // BLOCK_N
        else:
            gate_block = pid_n
            up_block = pid_n

        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        nbytes: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K
        for i in gl.static_range(STAGES - 1):
            if i < k_steps:
                mbarrier.expect(bars.index(i), nbytes)
                _tma_load(a_desc, [row0, i * BLOCK_K], bars.index(i), a_smem.index(i))
                _tma_load(w_desc, [w_row0, i * BLOCK_K], bars.index(i), w_smem.index(i))

        # two partial accumulators, p0 for even K steps and p1 for odd ones (_steps)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        gate_cols = (cols < OUT_N)[None, :]  # gated: the tile's first half are gate channels
        ops = (a_desc, w_desc, a_smem, w_smem, bars, row0, w_row0, rows, n_rows, a_scale_ptr, ws_base, gate_block,
               up_block)
        acc = zero
        for kb in range(k_steps // UNROLL):
            acc = _steps(kb * UNROLL, UNROLL, acc, zero, gate_cols, ops, k_steps, STAGES, GATED)
        if k_steps % UNROLL:
            acc = _steps(k_steps - k_steps % UNROLL, k_steps % UNROLL, acc, zero, gate_cols, ops, k_steps, STAGES,
                         GATED)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        rmask = rows < row_end
        if GATED:
            both = gl.permute(gl.reshape(acc, [BLOCK_M, 2, HALF]), (0, 2, 1))
            gate, up = gl.split(both)
            out_layout: gl.constexpr = gate.type.layout
            out_rows = gl.convert_layout(rows, gl.SliceLayout(1, out_layout))
            out_cols = pid_n * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, out_layout))
            if HAS_BIAS:
                b_row = bias_ptr + expert.to(gl.int64) * in_width
                gate = gate + gl.load(b_row + out_cols).to(gl.float32)[None, :]
                up = up + gl.load(b_row + width + out_cols).to(gl.float32)[None, :]
            out = _activation(gate, ACT) * up
            omask = gl.convert_layout(rmask, gl.SliceLayout(1, out_layout))
        else:
            out_rows = rows
            out_cols = pid_n * BLOCK_N + cols
            out = acc
            if HAS_BIAS:
                out = out + gl.load(bias_ptr + expert.to(gl.int64) * width + out_cols).to(gl.float32)[None, :]
            if ACT >= 0:
                out = _activation(out, ACT)
            omask = rmask
        offs = out_rows[:, None].to(gl.int64) * width + out_cols[None, :]
        gl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=omask[:, None])


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """Gated weights [E, 2F, K] (gate rows, then up rows) -> the same rows as [E, 2F, K] in runs of 64: gate 0-63,
    up 0-63, gate 64-127, ... The values and their block scales are unchanged (a permutation of rows)."""
    e, rows, k = w.shape
    return w.view(e, 2, rows // (2 * HALF.value), HALF.value, k).transpose(1, 2).reshape(e, rows, k)


def grouped_gemm(a, a_scale, w, w_scale, bias, offsets, out, activation_id: int, gated: bool,
                 block_m: int = 128, group_m: int = 8, stages: int = 4, num_warps: int = 8, unroll: int = 2):
    """One grouped projection over rows in expert order (see _block_fp8_kernel); `w` interleaved when gated.
    a_scale [n_rows, K / 128] as quantize_rows gives it; out [n_rows, width] is written for live rows only."""
    n_rows, k = a.shape
    num_experts, in_width, _ = w.shape
    width = out.shape[1]
    if n_rows == 0:
        return out
    bk = BLOCK_K.value
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, bk], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([128, bk], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a, [block_m, bk], a_layout)
    w_desc = TensorDescriptor.from_tensor(w.view(num_experts * in_width, k), [128, bk], w_layout)
    grid = ((triton.cdiv(n_rows, block_m) + num_experts) * (in_width // 128),)
    _block_fp8_kernel[grid](a_desc, w_desc, a_scale.t().contiguous(), w_scale.contiguous(),
                            bias if bias is not None else a_scale, offsets, out, n_rows, num_experts, K=k, width=width,
                            HAS_BIAS=bias is not None, GATED=gated, ACT=activation_id,
                            E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, GROUP_M=group_m,
                            STAGES=stages, UNROLL=unroll, num_warps=num_warps)
    return out


def experts_fp8(x_fp8, x_scale_inv, offsets, w_in, w_in_scale_inv, b_in, w_out, w_out_scale_inv, b_out,
                activation_id: int, gated: bool, out_dtype: torch.dtype, config: dict | None = None):
    """triton_fp8.experts_fp8 (block scales, promoted every K step) on the Gluon kernel; w_in interleaved when
    gated (interleave_gate_up). The first projection's output goes through bf16 to quantize_rows (per 128)."""
    from moecompile.kernels.triton_fp8 import quantize_rows

    n_rows, hidden = x_fp8.shape
    width = w_out.shape[2]
    y = torch.empty(n_rows, hidden, dtype=out_dtype, device=x_fp8.device)
    if n_rows == 0:
        return y
    h = torch.empty(n_rows, width, dtype=torch.bfloat16, device=x_fp8.device)
    tiles = config or _tiles(n_rows, w_in.shape[0])
    grouped_gemm(x_fp8.contiguous(), x_scale_inv, w_in, w_in_scale_inv, b_in, offsets, h, activation_id, gated,
                 **tiles)
    a, a_scale = quantize_rows(h)
    return grouped_gemm(a, a_scale, w_out, w_out_scale_inv, b_out, offsets, y, -1, False, **tiles)


def _tiles(n_rows: int, num_experts: int) -> dict:
    """The tile config of both projections: 128-row tiles once experts average 512 rows, else 64-row tiles with 4
    warps, two programs per SM (the faster of the two on the device at either size)."""
    if n_rows >= 512 * num_experts:
        return dict(block_m=128, group_m=8, stages=4, num_warps=8)
    return dict(block_m=64, group_m=8, stages=4, num_warps=4)
