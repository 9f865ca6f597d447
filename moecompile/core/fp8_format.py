"""FP8 (float8_e4m3fn) quantisation math in the DeepSeek-V3 / HF FineGrainedFP8 convention.

A tensor is stored as (x_fp8, scale_inv) with x ≈ x_fp8 * scale_inv, one float32 scale_inv per block:
- weights [..., R, C]: 128 × 128 tiles of the last two dims, scale_inv [..., ceil(R/128), ceil(C/128)];
- activations [N, H]: each row's channels in runs of `group` (1 × 128), scale_inv [N, ceil(H/group)].
Every kernel (the reference here, a device kernel elsewhere) computes, in float32:
    scale_inv = max(amax / 448, FLOAT32_TINY)        amax over the block; partial edge blocks use their own amax
    x_fp8     = round_to_nearest_even(clamp(x / scale_inv, -448, 448))
The floor keeps an all-zero block finite (its x_fp8 is 0); 448 is float8_e4m3fn's largest finite value.
"""
import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
WEIGHT_BLOCK = 128
ACT_GROUP = 128
_TINY = torch.finfo(torch.float32).tiny


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x [..., R, C] as float32, zero-padded to [..., rows, cols] (no copy beyond the cast when it fits)."""
    x = x.float()
    return x if x.shape[-2:] == (rows, cols) else F.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))


def _scale_inv(amax: torch.Tensor) -> torch.Tensor:
    return (amax / FP8_MAX).clamp_min(_TINY)


def _cast(x: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return (x / scale_inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_groups(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] (any float dtype) -> (x_fp8 [N, H], scale_inv [N, ceil(H / group)] float32), per row per group."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    n, h = x.shape
    groups = cdiv(h, group)
    xf = _pad(x, n, groups * group).reshape(n, groups, group)
    scale_inv = _scale_inv(xf.abs().amax(-1))
    return _cast(xf, scale_inv.unsqueeze(-1)).view(n, groups * group)[:, :h].contiguous(), scale_inv


def dequantize_groups(x_fp8: torch.Tensor, scale_inv: torch.Tensor, group: int = ACT_GROUP,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, h = x_fp8.shape
    groups = cdiv(h, group)
    x = _pad(x_fp8, n, groups * group).reshape(n, groups, group) * scale_inv.unsqueeze(-1)
    return x.view(n, groups * group)[:, :h].to(dtype)


def quantize_blocks(w: torch.Tensor, block: int = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] -> (w_fp8 [..., R, C], scale_inv [..., ceil(R/block), ceil(C/block)] float32), per tile."""
    *lead, r, c = w.shape
    br, bc = cdiv(r, block), cdiv(c, block)
    tiles = _pad(w, br * block, bc * block).reshape(*lead, br, block, bc, block)
    scale_inv = _scale_inv(tiles.abs().amax(dim=(-3, -1)))
    w_fp8 = _cast(tiles, scale_inv[..., :, None, :, None]).view(*lead, br * block, bc * block)[..., :r, :c]
    return w_fp8.contiguous(), scale_inv


def dequantize_blocks(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: int = WEIGHT_BLOCK,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    *lead, r, c = w_fp8.shape
    br, bc = cdiv(r, block), cdiv(c, block)
    tiles = _pad(w_fp8, br * block, bc * block).reshape(*lead, br, block, bc, block)
    return (tiles * scale_inv[..., :, None, :, None]).view(*lead, br * block, bc * block)[..., :r, :c].to(dtype)


def matvec_blocks(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: int = WEIGHT_BLOCK
                  ) -> torch.Tensor:
    """One row x [..., K] times the block-scaled weight [N, K] transposed, float32 [..., N]: each weight row's
    128-channel partial sums, then each times its block's scale, so the scales meet N x K / 128 sums rather than
    every weight (the form inductor streams the FP8 weight fastest in)."""
    n, k = w_fp8.shape
    br, bc = cdiv(n, block), cdiv(k, block)
    w = _pad(w_fp8, br * block, bc * block).view(br, block, bc, block)
    row = F.pad(x.float().reshape(k), (0, bc * block - k)).view(1, 1, bc, block)
    partial = (w * row).sum(-1)  # [N / block, block, K / block]
    return (partial * scale_inv[:, None, :]).sum(-1).reshape(br * block)[:n].view(*x.shape[:-1], n)


def fake_quantize_groups(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """quantize then dequantize (float32): what an FP8 GEMM sees of a higher-precision activation."""
    return dequantize_groups(*quantize_groups(x, group), group)


def rowwise_from_blocks(w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled weights [E, R, C] -> (fp8 [E, R, C], scale_inv [E, R] float32), one scale per row (output
    channel): the form a GEMM that applies its scales after the K loop takes. The values are rounded a second time."""
    q = torch.empty_like(w_fp8)
    s = torch.empty(w_fp8.shape[:-1], dtype=torch.float32, device=w_fp8.device)
    for e in range(w_fp8.shape[0]):  # one expert at a time: the float32 copy of all of them can be gigabytes
        q[e], row_scale = quantize_groups(dequantize_blocks(w_fp8[e], scale_inv[e]), w_fp8.shape[-1])
        s[e] = row_scale[:, 0]
    return q, s
