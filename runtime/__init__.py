"""Runtime: maps each moecompile op to a kernel per device (see registry.py)."""
from .registry import kernel_for, register_kernel, registered_kernels

__all__ = ["kernel_for", "register_kernel", "registered_kernels"]
