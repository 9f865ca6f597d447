"""CUDA kernels: registered for device type "cuda" when triton is available, else the reference kernels run."""
import warnings

from moecompile.runtime.registry import register_kernel

try:
    from moecompile.kernels import cuda as _cuda
except ImportError as e:  # no triton: the reference kernels (plain PyTorch) also run on CUDA
    warnings.warn(f"moecompile: CUDA kernels unavailable ({e}); using the reference kernels", stacklevel=2)
else:
    for _op in ("route", "route_grouped", "dispatch", "route_dispatch", "experts", "experts_train",
                "experts_backward", "combine", "combine_backward", "dispatch_backward", "quantize_fp8", "experts_fp8"):
        register_kernel(_op, "cuda", getattr(_cuda, _op))
