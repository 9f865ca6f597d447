"""Router logits in float32 from 16-bit operands. On CUDA they take one tensor-core GEMM with a float32 output: the
products of 16-bit values are exact in float32 and only the summation order differs from upcasting both operands
first, which costs a float32 copy of the activations and a GEMM off the tensor cores."""
import torch


def on_tensor_cores(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.dim() == 2


def float32_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) in float32, x [T, H]; no derivative on tensor cores (torch.mm's out_dtype overload has none)."""
    if on_tensor_cores(x, weight):
        logits = torch.mm(x, weight.t(), out_dtype=torch.float32)
        return logits if bias is None else logits + bias.float()
    return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())


def float32_logits_backward(grad_logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    """(grad_x, grad_weight) of float32_logits' product. On tensor cores the logits' gradient is rounded to the
    operands' dtype, as a router run in that dtype has it, and both GEMMs run in it (accumulating in float32);
    otherwise both run in float32."""
    if on_tensor_cores(x, weight):
        grad = grad_logits.to(x.dtype)
        return grad @ weight, grad.t() @ x
    return (grad_logits @ weight.float()).to(x.dtype), (grad_logits.t() @ x.float()).to(weight.dtype)
