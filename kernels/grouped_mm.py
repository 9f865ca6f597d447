"""torch._grouped_mm (CUTLASS grouped GEMMs on sm_90+) over rows in expert order, and the small torch ops around it:
per-expert bias, per-expert row sums. No host synchronisation: CUDA-graph capturable."""
import torch


def supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """What torch._grouped_mm takes: CUDA on sm_90+, bf16 operands, rows, the inner sizes multiples of 8 (any row
    count: one decoded token at top-2 is 2 rows)."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and x.shape[0] > 0):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    tensors = (x, *weights)
    sizes = (x.shape[-1], *(s for w in weights for s in w.shape[-2:]))
    return all(t.dtype == torch.bfloat16 for t in tensors) and all(s % 8 == 0 for s in sizes)


def grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm: 2-D a x 3-D b multiplies each row group of a (ending at offsets) by its expert's matrix;
    2-D a x 2-D b splits the shared K dimension at offsets and gives one product per group (weight gradients)."""
    return torch._grouped_mm(a, b, offs=offsets)


def row_expert(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Expert of each sorted row; rows past the last group get len(offsets) (dropped)."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)


def add_expert_bias(y: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor) -> None:
    """y[r] += bias[expert of row r], in place (rows past the groups get the last expert's: unspecified anyway)."""
    y += bias.index_select(0, row_expert(offsets, y.shape[0]).clamp_max(bias.shape[0] - 1))


def segment_sum(values: torch.Tensor, offsets: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Sum of each expert's rows of values (rows past the groups ignored), accumulated in float32."""
    rows = row_expert(offsets, values.shape[0])
    sums = values.new_zeros(num_experts + 1, values.shape[1], dtype=torch.float32)
    return sums.index_add_(0, rows, values.float())[:num_experts].to(values.dtype)
